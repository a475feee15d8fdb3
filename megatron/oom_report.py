"""Out-of-memory errors that say what to do.

`pretrain()` runs inside `OomReport(config, rt)`. When a CUDA out-of-memory error
(`torch.OutOfMemoryError`, the same class as `torch.cuda.OutOfMemoryError`; or the runtime's
"CUDA error: out of memory") or a host allocation failure ("DefaultCPUAllocator: can't
allocate memory", the gloo path) reaches it, the rank that hit it prints to stderr:

    [rank 1] out of GPU memory in iteration 3 (forward)
      rank 1 of 4: tensor-parallel rank 1 of 2, pipeline rank 0 of 1, data-parallel rank 0 of 2
      torch: CUDA out of memory. Tried to allocate 2.00 GiB ...
      cuda:1: allocated 70.10 GiB, reserved 75.30 GiB, peak allocated 76.00 GiB, total ...
      --dry-run's estimate for this layout (this GPU: 79.10 GiB):
        memory per GPU, estimate: ...
      what may help here (...):
        --recompute-granularity selective: ...
      traceback (most recent call last): one line per frame

and the process ends with status EXIT_CODE (1) through `OutOfMemoryExit`, a SystemExit:
no second traceback. Only the first rank of the job to run out prints the whole report
(`first_to_report`, a count in the job's store): when every GPU runs out, as happens
when the layout does not fit, each other rank prints one line with its own phase and
figures,

    [rank 5] out of GPU memory in iteration 3 (forward), as rank 1 (its report says what
    may help); cuda:5: allocated 70.10 GiB, reserved 75.30 GiB, ...

instead of the same report again (thousands of copies at scale), then waits under a
launcher for the first one to print. Nothing here is a collective, so a rank that runs out
of memory while the others wait for it in one still gets to its report and its exit; the
launcher (torchrun) then ends the others. The phase comes from the traceback's frames
(free on the hot path): the outermost frame listed in `_PHASES` names it, and inside a
training step the outermost of `_STEP_PARTS` says which part.

Library code sets no environment variables: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:
True` is only suggested (for the launch environment) when much of what the allocator holds
is cached but unallocated.
"""
from __future__ import annotations

import os
import resource
import sys
import traceback
from typing import Dict, List, Optional, TextIO

import torch

from megatron.memory_estimate import GiB, format_memory_report
from megatron.rank_failure import first_to_report

EXIT_CODE = 1  # an ordinary failure; the watchdog's 124 and flag errors' 2 mean other things
CPU_ALLOC_FAILURE = "DefaultCPUAllocator: can't allocate memory"
CUDA_RUNTIME_OOM = "CUDA error: out of memory"
# cached-but-unallocated at least this fraction of what is reserved (and 1 GiB): suggest
# the expandable-segments allocator setting
FRAGMENTATION_FRACTION = 0.2
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
# host figures, as the report names them
_HOST_FIGURES = (("rss", "resident"), ("peak_rss", "peak resident"), ("total", "host total"),
                 ("address_limit", "address-space limit (ulimit -v)"),
                 ("cgroup_limit", "cgroup memory limit"))


class OutOfMemoryExit(SystemExit):
    """The out-of-memory report has been printed; end the process with its `code`.
    `first`: the rank that printed the whole report when this one printed its line only
    (-1: unknown), else None."""

    first: Optional[int] = None


def out_of_memory_kind(exc: BaseException) -> Optional[str]:
    """"device" for a CUDA out-of-memory error, "host" for a failed CPU allocation, else
    None (recognised by type, or by the allocator's own words for RuntimeErrors)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "device"
    if isinstance(exc, MemoryError):  # Python's own (pickling, numpy, a bytes buffer)
        return "host"
    if isinstance(exc, RuntimeError):
        text = str(exc)
        if CUDA_RUNTIME_OOM in text:
            return "device"
        if CPU_ALLOC_FAILURE in text:
            return "host"
    return None


# --------------------------------------------------------------------------- the phase
_PHASES = (  # (file, function, what the rank was doing); {it}: iterations done
    ("megatron/training.py", "build_model", "building the model"),
    ("megatron/core/optimizer/build.py", "build_optimizer", "building the optimizer"),
    ("megatron/nan_policy.py", "rollback", "rolling back after iteration {it}"),
    ("megatron/trainer_checkpoint.py", "load_trainer_checkpoint", "loading the checkpoint"),
    ("megatron/training.py", "_build_data", "building the data loaders"),
    ("megatron/training.py", "final_evaluation", "the final evaluation at iteration {it}"),
    ("megatron/training.py", "evaluate", "evaluation at iteration {it}"),
    ("megatron/training.py", "_save", "saving the checkpoint of iteration {it}"),
    ("megatron/train_step.py", "train_step", "iteration {next}"),
)
_STEP_PARTS = (
    ("megatron/core/pipeline_parallel/executor.py", "_forward", "forward"),
    ("megatron/core/pipeline_parallel/executor.py", "_backward", "backward"),
    ("megatron/train_step.py", "_finish_grads", "gradient reduction"),
    ("megatron/core/optimizer/", "step", "optimizer step"),
)


def _frames(tb) -> List[tuple]:
    """(file with / separators, function, line) of each frame, outermost first."""
    return [(f.f_code.co_filename.replace(os.sep, "/"), f.f_code.co_name, line)
            for f, line in traceback.walk_tb(tb)]


def _first(frames: List[tuple], table: tuple) -> Optional[str]:
    for path, func, _ in frames:
        for where, name, label in table:
            if func == name and ("/" + where in path if where.endswith("/")
                                 else path.endswith("/" + where)):
                return label
    return None


def describe_phase(tb, iteration: Optional[int]) -> str:
    """What the rank was doing when the error was raised, from its traceback `tb`;
    `iteration`: the iterations done (None: before the trainer exists)."""
    frames = _frames(tb)
    label = _first(frames, _PHASES)
    it = "?" if iteration is None else iteration
    if label is None:
        return "setting up" if iteration is None else f"the training loop at iteration {it}"
    if label == "iteration {next}":
        part = _first(frames, _STEP_PARTS)
        label += f" ({part})" if part else ""
    return label.format(it=it, next="?" if iteration is None else iteration + 1)


# --------------------------------------------------------------------------- the figures
def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def device_memory(device: torch.device) -> Dict[str, int]:
    """allocated, reserved, peak (max allocated) and total/free bytes of a CUDA device.
    Raises whatever the queries raise (the caller guards)."""
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "peak": torch.cuda.max_memory_allocated(device), "total": total, "free": free}


def host_memory() -> Dict[str, int]:
    """This process's resident set (now, and its peak) and the host's memory, in bytes;
    only the figures that could be read."""
    out: Dict[str, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm") as f:
            out["rss"] = int(f.read().split()[1]) * page
    except (OSError, ValueError, IndexError):
        pass
    try:  # ru_maxrss is KiB on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss"] = peak if sys.platform == "darwin" else peak * 1024
        out["total"] = os.sysconf("SC_PHYS_PAGES") * page
    except (OSError, ValueError, AttributeError):
        pass
    out.update(host_memory_limits())
    return out


def host_memory_limits() -> Dict[str, int]:
    """The limits below the host's memory that end an allocation first, in bytes, where
    set: the address-space limit (`ulimit -v`, RLIMIT_AS) and the cgroup's memory limit
    (a container's or a Slurm job's: cgroup v2 memory.max, v1 memory.limit_in_bytes)."""
    out: Dict[str, int] = {}
    try:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            out["address_limit"] = soft
    except (OSError, ValueError, AttributeError):
        pass
    for path in CGROUP_LIMIT_FILES:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isascii() and text.isdigit() and int(text) < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"):
            out["cgroup_limit"] = int(text)  # v1's "no limit" is a huge number, v2's "max"
        break
    return out


def _figure_lines(kind: str, device: torch.device) -> tuple:
    """(lines, figures) for the memory the error ran out of; never raises."""
    try:
        if kind == "device" and device.type == "cuda":
            m = device_memory(device)
            return [f"{device}: allocated {_gib(m['allocated'])}, reserved {_gib(m['reserved'])}, "
                    f"peak allocated {_gib(m['peak'])}, total {_gib(m['total'])} (free "
                    f"{_gib(m['free'])})"], m
        m = host_memory()
        parts = [f"{name} {_gib(m[key])}" for key, name in _HOST_FIGURES if key in m]
        return [f"host memory of this process: {', '.join(parts) or 'unknown'}"], m
    except Exception as e:  # noqa: BLE001 - the report must not fail on its figures
        return [f"memory figures unavailable ({type(e).__name__}: {e})".splitlines()[0]], {}


def _estimate_lines(config, total: Optional[int], where: str) -> List[str]:
    """--dry-run's estimate (megatron/memory_estimate.py), beside `total` bytes of `where`
    (the GPU or the host)."""
    try:
        lines = [line.strip() for line in format_memory_report(config, None)]
    except Exception as e:  # noqa: BLE001
        return [f"no estimate for this layout ({type(e).__name__}: {e})".splitlines()[0]]
    where = f" (this {where}: {_gib(total)})" if total else ""
    return [f"--dry-run's estimate for this layout{where}:"] + ["  " + x for x in lines]


# --------------------------------------------------------------------------- what may help
def _smaller_divisor(n: int) -> int:
    """The largest divisor of `n` below it (a micro-batch size that still divides the
    global batch wherever `n` did)."""
    return next(d for d in range(n // 2, 0, -1) if n % d == 0)


def suggestions(config, activations: bool = True, figures: Optional[dict] = None) -> List[str]:
    """The changes that would lower memory per GPU in this configuration, one line each.
    `activations`: the error came where activations exist (not while building or loading);
    `figures`: `device_memory`'s, for the fragmentation hint."""
    m, p, d = config.model, config.parallel, config.data
    out = []
    if activations and not m.recompute_granularity:
        out.append("--recompute-granularity selective: recompute the attention core in "
                   "backward instead of keeping its activations (little extra compute)")
    if activations and m.recompute_granularity != "full":
        out.append("--recompute-granularity full --recompute-method uniform: keep only each "
                   "layer's input and recompute the layer in backward (about a third more "
                   "compute)")
    if activations and d.micro_batch_size > 1:
        gbs = d.target_global_batch_size or d.global_batch_size
        out.append(f"--micro-batch-size {_smaller_divisor(d.micro_batch_size)} (now "
                   f"{d.micro_batch_size}) with the same --global-batch-size {gbs}: more "
                   "micro-batches per step, fewer activations at a time, the same training")
    if p.dp_size > 1 and not p.use_distributed_optimizer:
        out.append(f"--use-distributed-optimizer: shard the optimizer state and fp32 main "
                   f"weights over the {p.dp_size} data-parallel ranks")
    if activations and p.tp_size > 1 and not p.sequence_parallel:
        out.append(f"--sequence-parallel: split the norm and dropout activations over the "
                   f"{p.tp_size} tensor-parallel ranks too")
    bigger = []
    if m.num_attention_heads % (2 * p.tp_size) == 0 and m.num_query_groups % (2 * p.tp_size) == 0:
        bigger.append(f"--tensor-model-parallel-size {2 * p.tp_size} (now {p.tp_size})")
    if m.num_layers % (2 * p.pp_size) == 0:
        bigger.append(f"--pipeline-model-parallel-size {2 * p.pp_size} (now {p.pp_size})")
    if bigger:
        out.append(f"{' or '.join(bigger)}: split the model over more GPUs")
    if figures and "reserved" in figures:
        cached = figures["reserved"] - figures["allocated"]
        if cached >= max(FRAGMENTATION_FRACTION * figures["reserved"], GiB):
            out.append(f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the launch "
                       f"environment: {_gib(cached)} of the {_gib(figures['reserved'])} "
                       "reserved is cached but unallocated (fragmentation)")
    world = p.tp_size * p.pp_size * p.dp_size
    out.append(f"check a change first: WORLD_SIZE={world} python pretrain_gpt.py <these "
               "flags> --dry-run prints the estimate above for any layout")
    return out


# --------------------------------------------------------------------------- the report
_NO_ACTIVATIONS = ("building", "loading", "setting up")


def _compact_traceback(tb) -> List[str]:
    """One `file:line function` line per frame, outermost first; paths inside this
    repository or a site-packages directory shortened."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/")
    lines = []
    for path, func, line in _frames(tb):
        if path.startswith(root + "/"):
            path = path[len(root) + 1:]
        elif "site-packages/" in path:
            path = path.split("site-packages/", 1)[1]
        lines.append(f"  {path}:{line} {func}")
    return lines


def _usable(figures: dict) -> Optional[int]:
    """The most memory this process can have: the device's or host's total, or a lower
    host limit."""
    found = [figures[k] for k in ("total", "address_limit", "cgroup_limit") if k in figures]
    return min(found) if found else None


def format_repeat(ps, device: torch.device, kind: str, phase: str, first: int) -> str:
    """The one line of a rank that ran out of memory after rank `first` (-1: unknown)
    printed the whole report: this rank's phase and figures."""
    figure_lines, _ = _figure_lines(kind, device)
    who = f"rank {first}" if first >= 0 else "another rank"
    return (f"[rank {ps.rank}] out of {'GPU' if kind == 'device' else 'host'} memory in "
            f"{phase}, as {who} (its report says what may help); {figure_lines[0]}")


def format_report(config, ps, device: torch.device, exc: BaseException, kind: str,
                  phase: str) -> str:
    """The whole report for `exc` (see the module docstring); never raises on its figures
    or the estimate."""
    message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    figure_lines, figures = _figure_lines(kind, device)
    head = (f"rank {ps.rank} of {ps.world_size}: tensor-parallel rank {ps.tp_rank} of "
            f"{ps.tp_size}, pipeline rank {ps.pp_rank} of {ps.pp_size}, data-parallel rank "
            f"{ps.dp_rank} of {ps.dp_size}")
    what = "GPU" if kind == "device" else "host"
    lines = [f"[rank {ps.rank}] out of {what} memory in {phase}", head,
             f"{'python' if isinstance(exc, MemoryError) else 'torch'}: {message}",
             *figure_lines,
             *_estimate_lines(config, _usable(figures), "GPU" if "reserved" in figures
                              else "host" if _usable(figures) == figures.get("total")
                              else "process's limit"),
             "what may help here (each lowers memory per GPU):"]
    lines += ["  " + s for s in suggestions(config, not phase.startswith(_NO_ACTIVATIONS),
                                            figures)]
    lines += ["traceback (most recent call last):", *_compact_traceback(exc.__traceback__),
              f"exiting with status {EXIT_CODE}"]
    return "\n  ".join(lines)


class OomReport:
    """Context manager: an out-of-memory error inside is reported (to `stream`, default
    stderr) and becomes `OutOfMemoryExit(EXIT_CODE)`; other exceptions pass. Set
    `trainer` once it exists, so that the report can name the iteration."""

    def __init__(self, config, rt, stream: Optional[TextIO] = None,
                 memory_history=None) -> None:
        self.config, self.rt, self.stream = config, rt, stream
        self.trainer = None
        # megatron.memory_history.MemoryHistory: its snapshot is written first and named
        self.memory_history = memory_history

    def __enter__(self) -> "OomReport":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        kind = None if exc is None else out_of_memory_kind(exc)
        if kind is None:
            return False
        state = getattr(self.trainer, "state", None)
        ps = self.rt.ps
        first = first_to_report("out of memory", ps.rank) if ps.world_size > 1 else None
        try:
            phase = describe_phase(tb, None if state is None else state.iteration)
            report = (format_report(self.config, ps, self.rt.device, exc, kind, phase)
                      if first is None else format_repeat(ps, self.rt.device, kind, phase, first))
        except Exception as e:  # noqa: BLE001 - never hide the error behind the report's own
            report = (f"out of memory: {exc}\n  (the out-of-memory report failed: {e!r})\n  "
                      + "\n  ".join(_compact_traceback(tb)))
        snapshot = None if self.memory_history is None else self.memory_history.write_oom()
        if snapshot is not None:
            report += f"\n  memory snapshot (--record-memory-history): {snapshot}"
        stream = self.stream or sys.stderr
        sys.stdout.flush()
        print(report, file=stream, flush=True)
        ending = OutOfMemoryExit(EXIT_CODE)
        ending.first = first
        raise ending from exc


__all__ = ["EXIT_CODE", "OomReport", "OutOfMemoryExit", "describe_phase", "format_repeat",
           "format_report", "out_of_memory_kind", "suggestions"]
