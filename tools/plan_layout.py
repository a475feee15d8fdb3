#!/usr/bin/env python
"""Which parallel layout should this model use on these GPUs?

    python tools/plan_layout.py --config configs/gpt3-13b.yaml --gpus 64 --gpu-memory-gb 80
    python tools/plan_layout.py --gpus 16 --gpu-memory-gb 40 --num-layers 24 \
        --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
        --max-position-embeddings 2048 --global-batch-size 512 --bf16 [any pretrain_gpt.py flag]

Takes pretrain_gpt.py's command line (every Megatron-LM flag, `--config FILE.yaml`) plus
`--gpus N` (all GPUs), `--gpus-per-node G` (default 8) and `--top K`, and answers with
the layouts that fit, best first, and the flags of the best one.

Candidates: tensor-parallel size t (dividing N, at most G and dividing G, so a
tensor-parallel group never leaves a node), pipeline size p, virtual stages v (the
interleaved schedule), data parallel d = N / (t p), micro batch b (a divisor of global
batch / d, at most MAX_MICRO_BATCH), sequence parallelism (a choice when t > 1), the
distributed optimizer (a choice when d > 1), recompute none / selective / full (uniform).
The project's own validation (megatron/arguments_validate.py) runs on each for world size
N, as pretrain_gpt.py would run it on a GPU machine; a layout it rejects is dropped. The
memory figure is `--dry-run`'s estimate for the worst pipeline stage
(megatron/memory_estimate.py, compiled layers as on a GPU); a layout fits when that is at
most --gpu-memory-gb (GiB, as --dry-run reads it) less MEMORY_MARGIN (10%: allocator
fragmentation and temporaries the estimate leaves out). The layouts that fit are ordered by
the step time of tools/layout_cost.py: a simple model with named constants, NOT a
measurement. Within one t / p / v / b combination, a sequence-parallel, optimizer or
recompute choice beaten on both time and memory by another is not listed.

The layout flags of the input (tensor/pipeline sizes, virtual stages, micro batch,
--sequence-parallel, --use-distributed-optimizer, --recompute-*) are the planner's to
choose: their input values are ignored. Flags that do not change the layout may be left
out: without --lr or a run length it plans with placeholders, without tokenizer flags with
GPT-2's 50257-token vocabulary. --global-batch-size is needed: layouts are compared at one
global batch.

Exit status: 0 with a plan, 1 when no layout fits (the message says what would help),
2 for bad input (the message names the value and the fix).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.arguments import (  # noqa: E402
    ArgumentsError,
    apply_deprecated,
    build_config,
    check_not_supported,
    parse_args,
    validate_args,
)
from megatron.arguments_common import messages_for_rank, warn  # noqa: E402
from megatron.arguments_ranges import CHECKPOINT_ONLY_DESTS  # noqa: E402
from megatron.config import Config  # noqa: E402
from megatron.memory_estimate import GiB, estimate_memory  # noqa: E402
from tools.layout_cost import CONSTANTS, StepCost, step_cost  # noqa: E402

# Share of --gpu-memory-gb kept free: the caching allocator's fragmentation and one
# layer's backward temporaries, which the estimate does not count.
MEMORY_MARGIN = 0.10
MAX_MICRO_BATCH = 16
RECOMPUTE_CHOICES = (None, "selective", "full")
# A choice that saves less than this share of memory saves nothing worth listing.
SAME_MEMORY = 0.01
# GPT-2's vocabulary, used when the input names no tokenizer (NullTokenizer adds one id).
DEFAULT_VOCAB = 50257
PROGRESS_AFTER_S = 2.0


@dataclass(frozen=True)
class Layout:
    """One candidate: sizes and switches (vp = virtual stages per pipeline rank, 1 = none)."""

    tp: int
    pp: int
    vp: int
    mbs: int
    sp: bool
    dist_opt: bool
    recompute: Optional[str]

    def flags(self, num_layers: int) -> List[str]:
        """The pretrain_gpt.py flags that select this layout."""
        out = ["--tensor-model-parallel-size", str(self.tp),
               "--pipeline-model-parallel-size", str(self.pp)]
        if self.vp > 1:
            out += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (self.pp * self.vp))]
        out += ["--micro-batch-size", str(self.mbs)]
        if self.sp:
            out.append("--sequence-parallel")
        if self.dist_opt:
            out.append("--use-distributed-optimizer")
        if self.recompute == "selective":
            out += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"]
        return out


@dataclass
class Request:
    """What to plan: the model (namespace before validation, the dests the input set, its
    argv, the placeholder flags that stand in for what it leaves out), the cluster."""

    ns: argparse.Namespace
    explicit: set
    argv: List[str]
    gpus: int
    gpus_per_node: int
    gpu_memory_bytes: int
    placeholders: List[str] = field(default_factory=list)
    top: int = 10
    memory_margin: float = MEMORY_MARGIN

    @property
    def limit_bytes(self) -> int:
        """The most a layout's estimate may be: --gpu-memory-gb less the margin."""
        return int(self.gpu_memory_bytes * (1 - self.memory_margin))


@dataclass
class Plan:
    """A validated layout with its memory estimate (bytes, `estimate_memory`) and cost."""

    layout: Layout
    config: Config
    memory: Dict[str, int]
    cost: StepCost


@dataclass
class PlanResult:
    """What an enumeration found: the fitting plans best first, counts, the valid plan
    needing the least memory, and why layouts were rejected (message -> count)."""

    gpus: int
    fitting: List[Plan] = field(default_factory=list)
    num_candidates: int = 0
    num_valid: int = 0
    smallest: Optional[Plan] = None
    rejections: Dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------ input


def build_parser() -> argparse.ArgumentParser:
    """The planner's own flags; everything else goes to the pretrain_gpt.py argument layer."""
    consts = "; ".join(f"{k} = {v}" for k, v in CONSTANTS.items())
    p = argparse.ArgumentParser(
        prog="plan_layout.py", allow_abbrev=False,
        description="Rank the parallel layouts (tensor / pipeline / virtual stages / data "
                    "parallel, micro batch, sequence parallelism, distributed optimizer, "
                    "recompute) that the validation accepts for --gpus GPUs and whose "
                    "--dry-run memory estimate fits in --gpu-memory-gb less "
                    f"{MEMORY_MARGIN:.0%}. Every pretrain_gpt.py flag (and --config FILE.yaml) "
                    "describes the model; --gpu-memory-gb is the memory of one GPU in GiB "
                    "(default: the local GPU's). --global-batch-size is needed.",
        epilog="The ranking is an ESTIMATE from a simple cost model (tools/layout_cost.py), "
               "not a measurement: step = (compute + tensor-parallel comm + pipeline p2p + "
               "per-micro-batch overhead) x (1 + bubble) + exposed data-parallel reduction, "
               f"with {consts}. Exit status 0: a plan; 1: no layout fits; 2: bad input.")
    # Checked in build_request, not by argparse: a typo such as --gpu then gets named.
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs in all (required)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node (default 8); tensor parallelism stays inside a node")
    p.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    return p


def _missing_gpus_message(rest: Sequence[str]) -> str:
    """No --gpus: say it is required and name a flag that looks like a typo of it."""
    import difflib

    message = "--gpus N (the number of GPUs in all) is required"
    for token in rest:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and difflib.get_close_matches(flag, ["--gpus"], cutoff=0.8):
            return f"{message}; {flag} is not a flag: did you mean --gpus?"
    return message


def check_planner_args(args: argparse.Namespace) -> None:
    """--gpus / --gpus-per-node / --top: positive; whole nodes beyond one node."""
    for name in ("gpus", "gpus_per_node", "top"):
        if getattr(args, name) < 1:
            raise ArgumentsError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    n, g = args.gpus, args.gpus_per_node
    if n > g and n % g:
        raise ArgumentsError(f"--gpus {n} is more than one node of --gpus-per-node {g} but not "
                             f"whole nodes; use a multiple of {g} (e.g. {n - n % g} or "
                             f"{n - n % g + g}) or set --gpus-per-node")


@contextlib.contextmanager
def _messages(level: int) -> Iterator[None]:
    """The argument layer's warnings/notes at `level` and above (stderr)."""
    log = logging.getLogger("megatron.arguments")
    with messages_for_rank(0):
        old = log.level
        log.setLevel(level)
        try:
            yield
        finally:
            log.setLevel(old)


def parse_model(argv: Sequence[str]) -> tuple:
    """pretrain_gpt.py's argv -> (namespace before validation, dests the input set, the
    placeholder flags used for what the input leaves out and the layout does not depend on:
    --lr, a run length, a tokenizer (GPT-2's vocabulary size), data; --compile as on a GPU)."""
    ns, explicit = parse_args(argv)
    origins = apply_deprecated(ns, explicit)
    check_not_supported(ns, origins)
    if ns.use_checkpoint_args:
        from megatron.arguments_checkpoint import apply_checkpoint_args

        apply_checkpoint_args(ns, explicit, warn)
    if "global_batch_size" not in explicit:
        raise ArgumentsError("the planner compares layouts at one global batch: pass "
                             "--global-batch-size (e.g. 512)")
    placeholders: List[str] = []
    if ns.lr is None:
        ns.lr = 1e-4
        placeholders += ["--lr", "1e-4"]
    if ns.train_iters is None and ns.train_samples is None and not ns.skip_train:
        ns.skip_train = True
        placeholders.append("--skip-train")
    _check_tokenizer_files_here(ns)
    if not {"tokenizer_type", "vocab_file", "tokenizer_model", "vocab_size"} & explicit:
        ns.tokenizer_type, ns.vocab_size = "NullTokenizer", DEFAULT_VOCAB - 1
        placeholders += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(DEFAULT_VOCAB - 1)]
    if not {"data_path", "train_data_path", "mock_data"} & explicit:
        placeholders.append("--mock-data")  # only for the --dry-run check command
    if "compile_layers" not in explicit:
        # The plan assumes a GPU machine (compiled layers); the check command may run where
        # there is none, and eager layers keep more (RMSNorm), so it asks for the same.
        placeholders.append("--compile")
    return ns, explicit, placeholders


def _check_tokenizer_files_here(ns: argparse.Namespace) -> None:
    """A training command line planned on another machine (a login node, a laptop) may name
    tokenizer files that are not here; the plan needs only the vocabulary size."""
    for flag, dest in (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file"),
                       ("--tokenizer-model", "tokenizer_model")):
        path = getattr(ns, dest, None)
        if path and not os.path.exists(path):
            raise ArgumentsError(
                f"{flag} {path}: file not found. The plan needs only the vocabulary size: "
                "leave the tokenizer flags out (GPT-2's 50257 tokens), or pass "
                "--tokenizer-type NullTokenizer --vocab-size N for a vocabulary of N tokens")


def validate_layout(ns: argparse.Namespace, explicit: set, layout: Layout, gpus: int) -> Config:
    """The project's validation of `ns` with `layout` for `gpus` processes, as on a GPU
    machine. Raises ArgumentsError."""
    c = copy.copy(ns)
    c.tensor_model_parallel_size, c.pipeline_model_parallel_size = layout.tp, layout.pp
    c.num_layers_per_virtual_pipeline_stage = (
        ns.num_layers // (layout.pp * layout.vp) if layout.vp > 1 else None)
    c.micro_batch_size = layout.mbs
    c.sequence_parallel, c.use_distributed_optimizer = layout.sp, layout.dist_opt
    c.recompute_granularity = layout.recompute
    c.recompute_method = "uniform" if layout.recompute == "full" else None
    c.recompute_num_layers = 1
    c.recompute_activations = c.distribute_saved_activations = False
    c.rank, c.world_size = 0, gpus
    validate_args(c, gpus, explicit=explicit, cuda_available=True)
    return build_config(c)


# ------------------------------------------------------------------------ enumeration


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tensor_sizes(gpus: int, gpus_per_node: int) -> List[int]:
    """Tensor-parallel sizes that keep a group inside one node."""
    return [t for t in _divisors(gpus) if t <= gpus_per_node
            and (gpus <= gpus_per_node or gpus_per_node % t == 0)]


def _virtual_stages(num_layers: int, pp: int, standalone: bool) -> List[int]:
    """1 (no interleaving) and every v > 1 that splits a rank's layers evenly."""
    if pp < 2 or standalone or num_layers % pp:
        return [1]
    return [1] + [v for v in _divisors(num_layers // pp) if v > 1]


def enumerate_layouts(num_layers: int, global_batch: int, gpus: int, gpus_per_node: int,
                      standalone: bool = False) -> List[Layout]:
    """Every candidate (see the module doc); the validation decides which are possible."""
    out = []
    for tp in tensor_sizes(gpus, gpus_per_node):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            per_rank = global_batch // dp if global_batch % dp == 0 else 1
            for vp in _virtual_stages(num_layers, pp, standalone):
                for mbs in [b for b in _divisors(per_rank) if b <= MAX_MICRO_BATCH]:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for dist_opt in ((False, True) if dp > 1 else (False,)):
                            out += [Layout(tp, pp, vp, mbs, sp, dist_opt, rc)
                                    for rc in RECOMPUTE_CHOICES]
    return out


def _progress(start: float, done: int, total: int, last: List[float]) -> None:
    now = time.time()
    if now - start > PROGRESS_AFTER_S and now - last[0] > PROGRESS_AFTER_S:
        last[0] = now
        print(f"  ... {done}/{total} layouts considered", file=sys.stderr, flush=True)


def plan_layouts(req: Request, gpus: Optional[int] = None,
                 layouts: Optional[List[Layout]] = None,
                 progress: Optional[Callable] = _progress) -> PlanResult:
    """Validate, estimate and rank every candidate (or `layouts`) for `gpus` GPUs
    (default: the request's)."""
    ns, gpus = req.ns, gpus or req.gpus
    if layouts is None:
        layouts = enumerate_layouts(ns.num_layers, ns.global_batch_size, gpus,
                                    req.gpus_per_node, ns.standalone_embedding_stage)
    result = PlanResult(gpus, num_candidates=len(layouts))
    start, last = time.time(), [0.0]
    with _messages(logging.ERROR):  # the probe showed the model's warnings once
        for i, layout in enumerate(layouts):
            if progress is not None:
                progress(start, i, len(layouts), last)
            _evaluate(req, layout, gpus, result)
    result.fitting = _drop_beaten(result.fitting)
    result.fitting.sort(key=lambda p: (p.cost.total, p.memory["total"]))
    return result


def _evaluate(req: Request, layout: Layout, gpus: int, result: PlanResult) -> None:
    """Validate one layout, estimate its memory and cost, and file it in `result`."""
    try:
        config = validate_layout(req.ns, req.explicit, layout, gpus)
    except ArgumentsError as err:
        result.rejections[err.message] = result.rejections.get(err.message, 0) + 1
        return
    result.num_valid += 1
    plan = Plan(layout, config, estimate_memory(config), step_cost(config, req.gpus_per_node))
    if result.smallest is None or plan.memory["total"] < result.smallest.memory["total"]:
        result.smallest = plan
    if plan.memory["total"] <= req.limit_bytes:
        result.fitting.append(plan)


def _drop_beaten(plans: List[Plan]) -> List[Plan]:
    """Within one tp/pp/vp/mbs combination keep the SP / optimizer / recompute choices that
    no other choice beats on both step time and memory."""
    def key(p: Plan):
        return (p.layout.tp, p.layout.pp, p.layout.vp, p.layout.mbs)

    def beats(a: Plan, b: Plan) -> bool:  # memory within SAME_MEMORY counts as no saving
        ta, tb, ma, mb = a.cost.total, b.cost.total, a.memory["total"], b.memory["total"]
        return (ta <= tb and ma < mb) or (ta < tb and ma <= mb * (1 + SAME_MEMORY))

    groups: Dict[tuple, List[Plan]] = {}
    for p in plans:
        groups.setdefault(key(p), []).append(p)
    return [p for p in plans if not any(beats(q, p) for q in groups[key(p)])]


# ----------------------------------------------------------------- when nothing works


def smallest_layouts(gpus: int, gpus_per_node: int) -> List[Layout]:
    """Per tp / pp, the least-memory choices: micro batch 1, sequence parallel, distributed
    optimizer, full recompute, no virtual stages."""
    return [Layout(tp, pp, 1, 1, tp > 1, gpus // (tp * pp) > 1, "full")
            for tp in tensor_sizes(gpus, gpus_per_node) for pp in _divisors(gpus // tp)]


def gpus_that_fit(req: Request, factors: Sequence[int] = (2, 4, 8, 16, 32, 64)) -> Optional[int]:
    """The first of --gpus x `factors` (whole nodes) where a least-memory layout fits."""
    for factor in factors:
        n = req.gpus * factor
        if n > req.gpus_per_node and n % req.gpus_per_node:
            continue
        probe = plan_layouts(req, n, smallest_layouts(n, req.gpus_per_node), progress=None)
        if probe.fitting:
            return n
    return None


def gpus_that_validate(req: Request, want: int = 3) -> List[int]:
    """Up to `want` GPU counts nearest --gpus (half to twice it, whole nodes) where some
    layout passes the validation (memory not considered)."""
    found: List[int] = []
    g = req.gpus_per_node
    for n in sorted(range(max(1, req.gpus // 2), 2 * req.gpus + 1),
                    key=lambda n: (abs(n - req.gpus), n)):
        if n == req.gpus or (n > g and n % g):
            continue
        layouts = [Layout(tp, pp, 1, 1, False, False, None)
                   for tp in tensor_sizes(n, g) for pp in _divisors(n // tp)]
        if plan_layouts(req, n, layouts, progress=None).num_valid:
            found.append(n)
            if len(found) == want:
                break
    return sorted(found)


# ------------------------------------------------------------------------------- main


def gpu_memory_bytes(ns: argparse.Namespace) -> int:
    """--gpu-memory-gb (GiB, as --dry-run reads it), else the local GPU's memory."""
    gb = ns.gpu_memory_gb
    if gb is not None:
        if not math.isfinite(gb):
            raise ArgumentsError(f"--gpu-memory-gb {gb} is not a finite number; pass one GPU's "
                                 "memory in GiB, e.g. 80")
        if gb <= 0:
            raise ArgumentsError(f"--gpu-memory-gb {gb} must be > 0 (one GPU's memory in GiB, "
                                 "e.g. 80)")
        return int(gb * GiB)
    import torch

    if not torch.cuda.is_available():
        raise ArgumentsError("no GPU here to read the memory from: pass --gpu-memory-gb (one "
                             "GPU's memory in GiB, e.g. 80)")
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _probe_model(ns: argparse.Namespace, explicit: set) -> None:
    """Validate the model once with the simplest layout: the validation's warnings show
    once, and its errors for everything but the layout stop the planner (exit 2). The
    save/load flags (a preset's save-interval) are left out: the planner neither saves nor
    loads, so "add --save DIR" would be advice for another command."""
    pp = 2 if ns.standalone_embedding_stage else 1
    shown = explicit - CHECKPOINT_ONLY_DESTS
    with _messages(logging.WARNING):
        config = validate_layout(ns, shown, Layout(1, pp, 1, 1, False, False, None), pp)
    if ns.num_layers is None:  # given as --encoder-num-layers
        ns.num_layers, ns.encoder_num_layers = config.model.num_layers, None


def build_request(argv: Sequence[str]) -> Request:
    """Planner flags + pretrain_gpt.py flags -> Request; ArgumentsError for bad input.
    `--help` exits here (argparse)."""
    args, rest = build_parser().parse_known_args(list(argv))
    if args.gpus is None:
        raise ArgumentsError(_missing_gpus_message(rest))
    check_planner_args(args)
    with _messages(logging.WARNING):
        ns, explicit, placeholders = parse_model(rest)
    req = Request(ns, explicit, rest, args.gpus, args.gpus_per_node, gpu_memory_bytes(ns),
                  placeholders, args.top)
    _probe_model(ns, explicit)
    return req


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the plan (0), why nothing fits (1) or what is wrong with the input (2)."""
    from tools import layout_report as report

    try:
        req = build_request(sys.argv[1:] if argv is None else argv)
        result = plan_layouts(req)
        if result.num_valid == 0:
            raise ArgumentsError(report.no_valid_layout(result, gpus_that_validate(req)))
    except ArgumentsError as err:
        print(f"plan_layout.py: {err}", file=sys.stderr)
        return 2
    if not result.fitting:
        print(report.nothing_fits(req, result, gpus_that_fit(req)), file=sys.stderr)
        return 1
    print(report.format_plan(req, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
