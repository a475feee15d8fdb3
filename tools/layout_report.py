"""What tools/plan_layout.py prints: the table of layouts, the best one's flags, and the
messages when no layout passes the validation or none fits."""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/layout_report.py is a library module (the report of the layout "
                     "planner); run python tools/plan_layout.py --help")

import argparse
import math
import shlex
from typing import TYPE_CHECKING, List, Optional, Sequence

from megatron.memory_estimate import GiB
from tools.layout_cost import CONSTANTS

if TYPE_CHECKING:  # the planner imports this module, not the other way round
    from tools.plan_layout import Layout, Plan, PlanResult, Request

# Input switches the planner chooses (dest -> flag): added flags cannot turn them off.
LAYOUT_SWITCHES = {
    "sequence_parallel": "--sequence-parallel",
    "use_distributed_optimizer": "--use-distributed-optimizer",
    "num_layers_per_virtual_pipeline_stage": "--num-layers-per-virtual-pipeline-stage",
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_activations": "--recompute-activations",
    "checkpoint_activations": "--checkpoint-activations",
    "distribute_saved_activations": "--distribute-saved-activations",
}
# Valued input flags the planner chooses: the check command leaves the input's out.
LAYOUT_VALUED = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--model-parallel-size", "--micro-batch-size", "--recompute-num-layers",
                 "--num-layers-per-virtual-pipeline-stage", "--recompute-granularity",
                 "--recompute-method")
TABLE_HEADER = ["rank", "tp", "pp", "vp", "dp", "mbs", "SP", "distopt", "recompute",
                "peak GiB", "bubble %", "rel. time"]


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def describe(layout: Layout, dp: int) -> str:
    """'tp 4, pp 2, dp 8, micro batch 1, sequence parallel, no recompute' and the like."""
    parts = [f"tp {layout.tp}", f"pp {layout.pp}"]
    if layout.vp > 1:
        parts.append(f"{layout.vp} virtual stages")
    parts += [f"dp {dp}", f"micro batch {layout.mbs}"]
    if layout.sp:
        parts.append("sequence parallel")
    if layout.dist_opt:
        parts.append("distributed optimizer")
    parts.append(f"{layout.recompute or 'no'} recompute")
    return ", ".join(parts)


def table_rows(plans: Sequence[Plan]) -> List[List[str]]:
    """One row of TABLE_HEADER cells per plan; rel. time is over the first plan's."""
    best = plans[0].cost.total
    rows = []
    for i, p in enumerate(plans, 1):
        lay = p.layout
        rows.append([str(i), str(lay.tp), str(lay.pp), str(lay.vp) if lay.vp > 1 else "-",
                     str(p.config.parallel.dp_size), str(lay.mbs), "on" if lay.sp else "off",
                     "on" if lay.dist_opt else "off", lay.recompute or "none",
                     _gib(p.memory["total"]), f"{100 * p.cost.bubble:.1f}",
                     f"{p.cost.total / best:.2f}"])
    return rows


def format_table(plans: Sequence[Plan]) -> str:
    rows = [TABLE_HEADER] + table_rows(plans)
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def inputs_to_remove(ns: argparse.Namespace, explicit: set, layout: Layout) -> List[str]:
    """Layout switches the input turns on that `layout` does not use."""
    wanted = {"sequence_parallel": layout.sp, "use_distributed_optimizer": layout.dist_opt,
              "num_layers_per_virtual_pipeline_stage": layout.vp > 1,
              "recompute_granularity": layout.recompute is not None,
              "recompute_method": layout.recompute == "full"}
    return [flag for dest, flag in LAYOUT_SWITCHES.items()
            if dest in explicit and getattr(ns, dest, None) not in (None, False)
            and not wanted.get(dest, False)]


def split_layout_flags(argv: Sequence[str]) -> tuple:
    """(argv without the layout flags the planner chooses, those flags as given): the
    valued ones of LAYOUT_VALUED with their value (`--flag V` or `--flag=V`) and the
    switches of LAYOUT_SWITCHES."""
    switches = set(LAYOUT_SWITCHES.values())
    kept: List[str] = []
    taken: List[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in LAYOUT_VALUED and "=" not in argv[i] and i + 1 < len(argv):
            taken += argv[i:i + 2]
            i += 2
            continue
        (taken if flag in LAYOUT_VALUED or flag in switches else kept).append(argv[i])
        i += 1
    return kept, taken


def check_command(req: Request, layout: Layout) -> List[str]:
    """argv of the --dry-run that checks `layout` (run with WORLD_SIZE=--gpus): the input
    without its own layout flags, then the layout's."""
    kept, _ = split_layout_flags(req.argv)
    return (["python", "pretrain_gpt.py"] + kept + layout.flags(req.ns.num_layers)
            + req.placeholders + ["--dry-run"])


def format_plan(req: Request, result: PlanResult) -> str:
    """The report: what was considered, the table of the best `req.top` layouts, the flags
    of the best one, how to check it, and what the numbers are."""
    best = result.fitting[0]
    m, d = best.config.model, best.config.data
    dtype = "bf16" if req.ns.bf16 else "fp16" if req.ns.fp16 else "fp32"
    gb = _gib(req.gpu_memory_bytes)
    lines = [
        f"layout plan for {result.gpus} GPUs ({req.gpus_per_node} per node) of {gb} GiB: "
        f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"sequence {d.seq_length}, global batch {d.global_batch_size}, {dtype}",
        f"  {result.num_candidates} layouts considered, {result.num_valid} pass the validation "
        f"for world size {result.gpus}, {len(result.fitting)} fit in {_gib(req.limit_bytes)} GiB "
        f"({gb} less a {req.memory_margin:.0%} margin) and are not beaten on both time and memory",
        "  by another SP / optimizer / recompute choice of the same tp / pp / vp / mbs",
        "",
        format_table(result.fitting[:req.top]),
        "",
        f"best: {describe(best.layout, best.config.parallel.dp_size)}. Flags for "
        "pretrain_gpt.py:",
        "  " + " ".join(best.layout.flags(m.num_layers)),
    ]
    _, given = split_layout_flags(req.argv)
    if given:
        lines.append(f"  in place of the command line's {' '.join(given)} (the planner "
                     "chooses the layout; the check below leaves them out)")
    given_flags = {g.split("=", 1)[0] for g in given}
    remove = [f for f in inputs_to_remove(req.ns, req.explicit, best.layout)
              if f not in given_flags]  # the rest came from a --config file
    if remove:
        lines.append("  and remove from the --config file: " + ", ".join(remove))
    lines += [
        "check it:",
        f"  WORLD_SIZE={result.gpus} " + shlex.join(check_command(req, best.layout)),
    ]
    if {"data_path", "train_data_path"} & req.explicit:
        lines.append("  (it also checks that the data files exist: run it where they are, "
                     "or in place of the data flags pass --mock-data)")
    lines += [
        "",
        "peak GiB: --dry-run's memory estimate for the worst pipeline stage (compiled layers, as "
        "on a GPU). bubble %: the pipeline's idle time over its busy time, (p - 1) / (m v) for "
        "m micro-batches (100 = half the step idle). rel. time: an ESTIMATE from the cost model in tools/layout_cost.py, not a "
        "measurement -- a few percent is below what it can tell apart. It adds compute, "
        "tensor-parallel traffic, pipeline p2p and bubble, the data-parallel reduction and a "
        "per-micro-batch overhead, with " + "; ".join(f"{k} = {v}" for k, v in CONSTANTS.items())
        + ".",
    ]
    return "\n".join(lines)


def nothing_fits(req: Request, result: PlanResult, more_gpus: Optional[int]) -> str:
    """No layout fits: the least any needs, what was tried, what would help. `more_gpus`:
    a GPU count where the least-memory layouts fit (None: none of those tried)."""
    small = result.smallest
    need = small.memory["total"]
    lines = [
        f"no layout fits: of the {result.num_valid} layouts that pass the validation for "
        f"{result.gpus} GPUs, the one needing the least memory "
        f"({describe(small.layout, small.config.parallel.dp_size)}) needs {_gib(need)} GiB per "
        f"GPU; the limit is {_gib(req.limit_bytes)} GiB (--gpu-memory-gb "
        f"{_gib(req.gpu_memory_bytes)} less a {req.memory_margin:.0%} margin).",
        "already considered: micro batch down to 1, full recompute, sequence parallelism, the "
        "distributed optimizer, every tensor-parallel size within a node and every pipeline "
        "size that the validation accepts.",
        "what would help:",
    ]
    if more_gpus is not None:
        lines.append(f"  - more GPUs: the least-memory layouts fit with --gpus {more_gpus}")
    else:
        lines.append(f"  - not more GPUs alone: nothing fits up to --gpus {result.gpus * 64}")
    lines += [f"  - GPUs with more memory: --gpu-memory-gb "  # rounded up: a value that fits
              f"{math.ceil(need / (1 - req.memory_margin) / GiB)} or more",
              "  - a shorter --seq-length or a smaller model"]
    return "\n".join(lines)


def no_valid_layout(result: PlanResult, near: Sequence[int]) -> str:
    """Every candidate failed validation: the reasons, most frequent first, and GPU counts
    near --gpus where some layout passes (`near`)."""
    reasons = sorted(result.rejections.items(), key=lambda kv: -kv[1])[:4]
    lines = [f"no layout of --gpus {result.gpus} passes the validation "
             f"({result.num_candidates} tried); the reasons, most frequent first:"]
    lines += [f"  ({count} layouts) {message}" for message, count in reasons]
    if near:
        lines.append("GPU counts near it with layouts that pass: "
                     + ", ".join(f"--gpus {n}" for n in near))
    return "\n".join(lines)
