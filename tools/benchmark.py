#!/usr/bin/env python
"""Time the real training step of pretrain_gpt.py for a model preset.

    python tools/benchmark.py --preset gpt2-124m --steps 30
    python tools/benchmark.py --preset tiny --device cpu --steps 5
    python tools/benchmark.py --preset gpt-1.3b -- --no-compile      # extra flags after --

The command line goes through the same parser, model, optimizer, mixed precision and
(mock) data path as pretrain_gpt.py. After warm-up steps (compilation happens there), the
timed steps run between synchronised timers. One JSON line per run: tokens/s and TFLOP/s
per GPU (`tokens_per_s`, `tflops`: the run's totals divided by its world size) and
MFU (FLOPs per token 72*l*h^2*(1 + s/6h + V/12lh), peak 989 TFLOP/s bf16 dense), peak
memory (of the last rank, which prints the line) beside the memory estimate of that rank's
pipeline stage, and time from launch to the end of the first optimizer step; on CUDA with
nvidia-smi, the GPU's median SM clock and power during the timed steps (an H200 trains at
its power limit, well under its top clock: these tell one machine's rows from another's).
"""
from __future__ import annotations

import time

T_LAUNCH = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.srun_tasks import launcher_ranks  # noqa: E402
from tools import child_processes  # noqa: E402

COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2",
          "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
          "--eval-iters", "0", "--seed", "1234"]

PRESETS = {
    # name: (flags, default micro batch)
    "gpt2-124m": (["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                   "--seq-length", "1024", "--max-position-embeddings", "1024",
                   "--vocab-size", "50303", "--disable-bias-linear", "--bf16"], 16),
    "gpt-1.3b": (["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                  "--seq-length", "2048", "--max-position-embeddings", "2048",
                  "--vocab-size", "50303", "--disable-bias-linear", "--bf16"], 8),
    "llama-1b": (["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
                  "--group-query-attention", "--num-query-groups", "8",
                  "--ffn-hidden-size", "8192", "--swiglu", "--normalization", "RMSNorm",
                  "--use-rotary-position-embeddings", "--no-position-embedding",
                  "--untie-embeddings-and-output-weights",
                  "--seq-length", "2048", "--max-position-embeddings", "2048",
                  "--vocab-size", "31999", "--disable-bias-linear", "--bf16"], 8),
    "tiny": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "511"], 4),
}
# The GPT shapes with Megatron-LM's default linear layers: biases, and with them the fused
# bias-GeLU (tanh form).
for _name in ("gpt2-124m", "gpt-1.3b"):
    _flags, _mbs = PRESETS[_name]
    PRESETS[_name + "-bias"] = ([f for f in _flags if f != "--disable-bias-linear"], _mbs)


def parse_layout(text: str) -> dict:
    """'tp2pp2dp2' -> {'tp': 2, 'pp': 2, 'dp': 2}; missing sizes are 1."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    for key, value in re.findall(r"(tp|pp|dp)(\d+)", text):
        sizes[key] = int(value)
    if not re.fullmatch(r"((tp|pp|dp)\d+)+", text) or 0 in sizes.values():
        raise SystemExit(f"error: bad layout {text!r}; write e.g. tp2, dp4, tp2pp2dp2")
    return sizes


def check_layout_world(text: str, layout: dict, world: int) -> None:
    """A layout needs tp*pp*dp processes: with fewer, tensor and pipeline sizes would be
    cut to the world size (as Megatron-LM does) and the run would time another layout."""
    need = layout["tp"] * layout["pp"] * layout["dp"]
    if need != world:
        raise SystemExit(
            f"error: --layout {text} needs {need} processes (tp x pp x dp); this run has "
            f"{world} (WORLD_SIZE). Start it with torchrun --nproc-per-node {need} "
            f"tools/benchmark.py ..., or let --scaling {text} start torchrun")


def build_argv(preset: str, steps: int, warmup: int, micro_batch: int, extra: list,
               layout: Optional[dict] = None) -> list:
    """Flags for one run. Each GPU keeps the preset's micro batch (weak scaling); with
    pipeline stages the global batch holds 2*pp micro-batches per data-parallel rank.
    Tensor parallelism comes with --sequence-parallel, except for --num-experts, whose
    switch MLP cannot run with it (the validation refuses the pair)."""
    flags, _ = PRESETS[preset]
    if "--fp16" in extra:  # the preset's precision gives way to the one asked for
        flags = [f for f in flags if f != "--bf16"]
    lay = layout or {"tp": 1, "pp": 1, "dp": 1}
    num_micro = 2 * lay["pp"] if lay["pp"] > 1 else 1
    experts = any(f == "--num-experts" or f.startswith("--num-experts=") for f in extra)
    total = steps + warmup
    # COMMON's 2 warm-up iterations must end before the decay (the run's length) does
    common = [str(min(2, total - 1)) if prev == "--lr-warmup-iters" else f
              for prev, f in zip([None] + COMMON, COMMON)]
    return flags + common + [
        "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(micro_batch * lay["dp"] * num_micro),
        "--tensor-model-parallel-size", str(lay["tp"]),
        "--pipeline-model-parallel-size", str(lay["pp"]),
        "--train-iters", str(total), "--log-interval", str(total),  # unused by the timing loop
    ] + (["--sequence-parallel"] if lay["tp"] > 1 and not experts else []) + extra


KERNEL_CLASSES = (  # (category, regex over the kernel name), first match wins
    ("attention", r"flash|fmha|cudnn|attention|sdpa"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|splitk"),
    ("optimizer", r"adam|multi_tensor"),
    ("compiled (triton)", r"^triton_"),
    ("copy/memset", r"memcpy|memset|copy"),
    ("reduction", r"reduce"),
)


def _is_kernel(e) -> bool:
    return (str(getattr(e, "device_type", None)) == "DeviceType.CUDA"
            and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(("Optimizer.", "Command ")))


def kernel_summary(events, steps: int) -> list:
    """[(category, ms per step, share)] of the CUDA kernels in a profiler's events."""
    totals = {}
    for e in events:
        if not _is_kernel(e):
            continue  # host events, annotations and host stalls
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        name = e.name.lower()
        cat = next((c for c, rx in KERNEL_CLASSES if re.search(rx, name)), "other")
        totals[cat] = totals.get(cat, 0.0) + us / 1000 / steps
    busy = sum(totals.values()) or 1.0
    return sorted(((c, ms, ms / busy) for c, ms in totals.items()), key=lambda r: -r[1])


def kernel_timeline(events, steps: int) -> dict:
    """Kernels per step, and how long per step the GPU ran no kernel between the first
    kernel's start and the last one's end (the launch gaps a replayed graph still has);
    `gaps_over_5us`: how many of those gaps per step were longer than 5 us."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if _is_kernel(e))
    idle, long_gaps, reach = 0.0, 0, None
    for start, end in spans:
        if reach is not None and start > reach:
            idle += start - reach
            long_gaps += start - reach > 5
        reach = end if reach is None else max(reach, end)
    return {"kernels": len(spans) / steps, "idle_ms": idle / 1000 / steps,
            "gaps_over_5us": long_gaps / steps}


def _gemm_flops(name: str, shapes) -> int:
    """FLOPs of one matrix-product call from its recorded input shapes (0: unknown)."""
    dims = [list(s) for s in shapes if s]
    if name in ("aten::mm",) and len(dims) >= 2 and len(dims[0]) == 2:
        return 2 * dims[0][0] * dims[0][1] * dims[1][-1]
    if name == "aten::addmm" and len(dims) >= 3 and len(dims[1]) == 2:
        return 2 * dims[1][0] * dims[1][1] * dims[2][-1]
    if name == "aten::bmm" and len(dims) >= 2 and len(dims[0]) == 3:
        return 2 * dims[0][0] * dims[0][1] * dims[0][2] * dims[1][-1]
    return 0


def gemm_rows(averages, steps: int) -> list:
    """[(op, shapes, calls per step, ms per step, TFLOP/s)] of the matrix products in a
    profile grouped by input shape, slowest first."""
    rows = []
    for e in averages:
        flops = _gemm_flops(e.key, getattr(e, "input_shapes", None) or [])
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if flops and us:
            rows.append((e.key, e.input_shapes, e.count / steps, us / 1000 / steps,
                         flops * e.count / (us * 1e-6) / 1e12))
    return sorted(rows, key=lambda r: -r[3])


def launch_rows(events, steps: int, pattern: str) -> list:
    """[(launches per step, operator, kernel)] for the kernels whose name matches
    `pattern`, attributed to the operator (or compiled graph) that launched them."""
    counts = {}
    for e in events:
        for k in getattr(e, "kernels", None) or []:
            if not re.search(pattern, k.name, re.I):
                continue
            op, parent = e.name, e.cpu_parent
            while op.startswith(("cuda", "cu")) and parent is not None:  # runtime call
                op, parent = parent.name, parent.cpu_parent
            key = (op[:70], k.name[:70])
            counts[key] = counts.get(key, 0) + 1
    return sorted(((n / steps, op, k) for (op, k), n in counts.items()), reverse=True)


def print_profile(tr, data, steps: int, use_cuda: bool, sort: str = "device",
                  limit: int = 40, launches: str = "") -> None:
    """Profile a few more steps; print the most expensive operators and, on CUDA, the
    kernel time per step by category against the wall time of the step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron.training import train_step

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with profile(activities=acts, record_shapes=use_cuda) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(tr, data)
        if use_cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000 / steps
    key = "self_cuda_time_total" if (use_cuda and sort == "device") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=limit, max_name_column_width=90),
          file=sys.stderr)
    if use_cuda:
        rows = kernel_summary(prof.events(), steps)
        busy = sum(ms for _, ms, _ in rows)
        print(f"GPU kernel time per step {busy:.2f} ms of {wall_ms:.2f} ms wall (profiled)",
              file=sys.stderr)
        tl = kernel_timeline(prof.events(), steps)
        print(f"  {tl['kernels']:.0f} kernels per step; no kernel running for {tl['idle_ms']:.2f}"
              f" ms per step between them ({tl['gaps_over_5us']:.0f} gaps over 5 us)",
              file=sys.stderr)
        for cat, ms, share in rows:
            print(f"  {cat:<20}{ms:>9.2f} ms {share:>7.1%}", file=sys.stderr)
        print("matrix products (per step): calls, ms, TFLOP/s, op and input shapes",
              file=sys.stderr)
        for op, shapes, calls, ms, rate in gemm_rows(prof.key_averages(group_by_input_shape=True),
                                                    steps)[:25]:
            print(f"  {calls:>5.0f} {ms:>8.2f} {rate:>7.1f}  {op} {shapes}", file=sys.stderr)
        if launches:
            print(f"kernels matching {launches!r} per step, by launching operator",
                  file=sys.stderr)
            for n, op, k in launch_rows(prof.events(), steps, launches)[:limit]:
                print(f"  {n:>6.1f}  {op}  ->  {k}", file=sys.stderr)


def count_syncs(tr, data, steps: int) -> int:
    """Run steps under CUDA's sync debug mode; return how many host synchronisations
    the steps made (each is also printed with its stack by torch's warning)."""
    import warnings

    import torch

    from megatron.training import train_step

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                train_step(tr, data)
            torch.cuda.set_sync_debug_mode("default")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()
             and "prototype feature" not in str(w.message)]  # torch's note on the mode itself
    for w in syncs[:5]:
        print(f"sync: {w.filename}:{w.lineno}: {w.message}", file=sys.stderr)
    return len(syncs)


CHIP_QUERY = "clocks.sm,power.draw,power.limit,clocks_event_reasons.active"
POWER_CAP = 0x4  # the software power cap bit of nvidia-smi's clocks_event_reasons


def chip_summary(text: str) -> dict:
    """Medians of nvidia-smi's samples (lines 'clock MHz, power W, limit W, reasons') and
    the share of samples whose clock the power cap held back; {} without a valid sample."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            clock, power, limit = (float(x) for x in parts[:3])
        except ValueError:
            continue  # a header, an error line, or [N/A] fields
        try:
            capped = bool(int(parts[3], 16) & POWER_CAP)
        except (IndexError, ValueError):
            capped = None
        rows.append((clock, power, limit, capped))
    if not rows:
        return {}
    out = {"sm_clock_mhz": round(statistics.median(r[0] for r in rows)),
           "power_w": round(statistics.median(r[1] for r in rows)),
           "power_limit_w": round(statistics.median(r[2] for r in rows))}
    flags = [r[3] for r in rows if r[3] is not None]
    if flags:
        out["power_capped"] = round(sum(flags) / len(flags), 2)
    return out


class ChipMonitor:
    """nvidia-smi sampling the GPU's clock and power every `period_ms` in the background
    while the timed steps run (its own process: the training process is not touched).
    Without nvidia-smi it records nothing and summary() is {}."""

    def __init__(self, gpu: str, period_ms: int = 250, command: Optional[list] = None):
        self.command = command or ["nvidia-smi", f"--query-gpu={CHIP_QUERY}",
                                   "--format=csv,noheader,nounits", "-i", gpu,
                                   "-lms", str(period_ms)]
        self.proc, self.text = None, ""

    def __enter__(self) -> "ChipMonitor":
        try:
            self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.text, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.text, _ = self.proc.communicate()

    def summary(self) -> dict:
        return chip_summary(self.text)


def recorded_event(torch):
    """A timing CUDA event recorded on the current stream now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def step_gaps(pairs) -> dict:
    """From (start, end) CUDA events around each timed step: the mean time from a step's
    first to its last GPU work, the mean and largest gap before the next step's work
    began (the GPU idles there when the host falls behind), and the slowest step's
    span over the median one. {} with fewer than two steps."""
    if len(pairs) < 2:
        return {}
    spans = [a.elapsed_time(b) for a, b in pairs]
    gaps = [b.elapsed_time(a) for (_, b), (a, _) in zip(pairs, pairs[1:])]
    return {"step_gpu_ms": round(statistics.fmean(spans), 2),
            "step_gap_ms": round(statistics.fmean(gaps), 3),
            "step_gap_max_ms": round(max(gaps), 3),
            "step_spread": round(max(spans) / statistics.median(spans), 3)}


def chip_id(torch, device) -> str:
    """nvidia-smi's name for `device`: its UUID (right under CUDA_VISIBLE_DEVICES too)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid else str(device.index or 0)


def timed_warmup(warmup: int, device: str, extra: list, world_size: int = 1) -> int:
    """Warm-up steps enough that no timed step is the whole-step CUDA graph's capture (it
    happens at step WARMUP_STEPS + 1 on one GPU unless `--cuda-graph-step off` is passed
    on); a lower --warmup is raised, saying so."""
    from megatron.step_graph import WARMUP_STEPS

    off = ("--cuda-graph-step=off" in extra
           or any(a == "--cuda-graph-step" and b == "off" for a, b in zip(extra, extra[1:])))
    needed = WARMUP_STEPS + 1
    if device != "cuda" or off or world_size > 1 or warmup >= needed:
        return warmup
    print(f"benchmark: --warmup {warmup} raised to {needed}: step {needed} captures the "
          "whole-step CUDA graph, and a timed capture is not a step time "
          "(pass -- --cuda-graph-step off to time eager steps)", file=sys.stderr)
    return needed


@contextlib.contextmanager
def loaders_closed(tr, *loaders):
    """Around a tool's steps on a Trainer it built itself (build_trainer, data_iterator):
    on leaving, the loaders' reader threads or worker processes and the TensorBoard
    writer stop, as pretrain's teardown stops them (an in-process call left them running
    until the interpreter's exit)."""
    from megatron.data_iterators import close_iterators

    try:
        yield
    finally:
        close_iterators(loaders)
        if tr.tb is not None:
            tr.tb.close()


def estimated_memory_gb(config, pp_rank: int) -> float:
    """The dry-run estimate of the allocated peak (GiB) on a GPU of pipeline stage
    `pp_rank`: the stage of the rank that prints the JSON line, whose measured peak is
    `peak_mem_gb` beside it. (The dry run's own figure is the stage that needs the most,
    stage 0 for most models: another GPU's number than the one measured.)"""
    from megatron.memory_estimate import estimate_stage_memory

    return round(estimate_stage_memory(config, pp_rank)["allocated"] / 2**30, 2)


def run(preset: str, steps: int, warmup: int, micro_batch: int, extra: list, device: str,
        profile_steps: int = 0, layout: Optional[dict] = None, sync_steps: int = 0,
        profile_sort: str = "device", profile_rows: int = 40,
        profile_launches: str = "", chip_sample_ms: int = 250) -> dict:
    import torch

    from megatron.arguments import parse_and_validate
    from megatron.core.tensor_parallel import gemm_algos
    from megatron.initialize import initialize_entry_point, set_random_seed
    from megatron.logging_utils import flops_per_token
    from megatron.startup_store import JobStore
    from megatron.training import build_trainer, data_iterator, train_step

    rank, world, local_rank = launcher_ranks(os.environ)
    use_cuda = device == "cuda"
    job = JobStore(os.environ, rank, world)  # --use-checkpoint-args: rank 0 reads for all
    config = parse_and_validate(build_argv(preset, steps, warmup, micro_batch, extra, layout),
                                world_size=world, env={"RANK": str(rank)}, cuda_available=use_cuda,
                                job_store=job)
    rt = initialize_entry_point(config.parallel, config.args["cublas_workspace"], rank, world,
                                local_rank, os.environ, store=job.store)
    set_random_seed(config.training.seed, rt)
    tr = build_trainer(config, rt)
    data = data_iterator(config, rt, "train", 0)
    with loaders_closed(tr, data):  # each in-process call stops its reader
        t_built = time.time() - T_LAUNCH  # imports, model, optimizer, data: all but the step
        sync = torch.cuda.synchronize if use_cuda else (lambda: None)
        t_first = None
        for i in range(warmup):
            loss, *_ = train_step(tr, data)
            if i == 0:
                sync()
                t_first = time.time() - T_LAUNCH
        # Peak memory since the start: a captured step's buffers live in the graph's pool,
        # allocated during the capture (a warm-up step), not during the timed replays.
        sync()
        monitor = (ChipMonitor(chip_id(torch, rt.device), chip_sample_ms)
                   if use_cuda and chip_sample_ms > 0 else contextlib.nullcontext())
        marks, host, oks = [], [], []  # CUDA events around each timed step's GPU work; host seconds
        with monitor:
            t0 = time.perf_counter()
            for _ in range(steps):
                start = recorded_event(torch) if use_cuda else None
                h0 = time.perf_counter()
                loss, ok, *_ = train_step(tr, data)
                oks.append(ok)  # fp16: False (or a device tensor) when an overflow skipped it
                host.append(time.perf_counter() - h0)
                if use_cuda:
                    marks.append((start, recorded_event(torch)))
            sync()
            elapsed = time.perf_counter() - t0
        skipped = sum(not bool(ok) for ok in oks)  # after the sync: reading them waits for nothing
        if marks:
            print("benchmark: GPU ms per timed step: "
                  + " ".join(f"{a.elapsed_time(b):.1f}" for a, b in marks), file=sys.stderr)
            print("benchmark: host ms per timed step: "
                  + " ".join(f"{1000 * t:.1f}" for t in host), file=sys.stderr)
        if profile_steps:
            print_profile(tr, data, profile_steps, use_cuda, profile_sort, profile_rows,
                          profile_launches)
        syncs = count_syncs(tr, data, sync_steps) if (sync_steps and use_cuda) else None
        m, d = config.model, config.data
        tokens_per_s = d.global_batch_size * d.seq_length * steps / elapsed / world  # per GPU
        fpt = flops_per_token(m.num_layers, m.hidden_size, d.seq_length, m.padded_vocab_size,
                              m.num_experts)
        return {
            "preset": preset, "device": torch.cuda.get_device_name() if use_cuda else "cpu",
            "layout": layout_name(config), "world_size": world,
            "micro_batch": micro_batch, "global_batch": d.global_batch_size,
            "seq_length": d.seq_length, "steps": steps,
            "step_ms": round(elapsed / steps * 1000, 2), "tokens_per_s": round(tokens_per_s),
            "tflops": round(tokens_per_s * fpt / 1e12, 1),
            "mfu": round(tokens_per_s * fpt / 989e12, 4),
            "peak_mem_gb": (round(torch.cuda.max_memory_allocated() / 2**30, 2) if use_cuda
                            else None),
            # None with --warmup 0
            "time_to_first_step_s": None if t_first is None else round(t_first, 1),
            "time_to_build_s": round(t_built, 1),
            "loss": round(float(loss), 4),
            "precision": ("fp16" if config.args["fp16"] else "bf16" if config.args["bf16"]
                          else "fp32"),
            "skipped_steps": skipped,
            "est_mem_gb": estimated_memory_gb(config, rt.ps.pp_rank),
            "compile": m.compile_layers, "extra": " ".join(extra),
            "gemm_table_entries": len(gemm_algos._ACTIVE),  # active --gemm-algorithms entries
            **({"host_syncs": syncs, "sync_steps": sync_steps} if syncs is not None else {}),
            **(monitor.summary() if isinstance(monitor, ChipMonitor) else {}),
            **step_gaps(marks),
        }


def layout_name(config) -> str:
    p = config.parallel
    return f"tp{p.tp_size}pp{p.pp_size}dp{p.dp_size}"


def scaling(a, device: str) -> int:
    """Run the preset over each layout through torchrun on this host; print per-GPU
    tokens/s, MFU and the efficiency against the first layout (normally one GPU)."""
    rows = []
    for text in a.scaling.split(","):
        lay = parse_layout(text)
        world = lay["tp"] * lay["pp"] * lay["dp"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(world), os.path.abspath(__file__), "--preset", a.preset,
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--layout", text,
               "--device", device] + (["--micro-batch-size", str(a.micro_batch_size)]
                                      if a.micro_batch_size else []) + ["--"] + a.extra
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
        # an exception here (Ctrl-C, SIGTERM: `main`) stops torchrun with SIGTERM, which
        # it passes on to its workers (SIGKILL would leave them running)
        proc = child_processes.run(cmd, capture_output=True, text=True, env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"{text}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1]))
        print(lines[-1], flush=True)
    base = rows[0]["tokens_per_s"]
    print(f"{'layout':<12}{'GPUs':>5}{'tokens/s/GPU':>14}{'MFU':>8}{'efficiency':>12}")
    for r in rows:
        print(f"{r['layout']:<12}{r['world_size']:>5}{r['tokens_per_s']:>14,}{r['mfu']:>8.1%}"
              f"{r['tokens_per_s'] / base:>12.1%}")
    return 0


def _check_counts(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """ap.error (exit 2) for a count no run can use, before anything is built: --steps 0
    divided by zero after the warm-up, and --micro-batch-size 0 fell back to the preset's."""
    for flag, value, low in (("--steps", a.steps, 1), ("--warmup", a.warmup, 0),
                             ("--micro-batch-size", a.micro_batch_size, 1),
                             ("--profile-steps", a.profile_steps, 0),
                             ("--sync-debug", a.sync_debug, 0),
                             ("--chip-sample-ms", a.chip_sample_ms, 0)):
        if value is not None and value < low:
            ap.error(f"{flag} {value} must be >= {low}")


def main(argv=None) -> int:
    """The command line (None: sys.argv[1:]); the exit status. Callable more than once in
    one process: the environment variables it sets (CUDA_VISIBLE_DEVICES for --device cpu,
    those of megatron.entry_state.ENTRY_POINT_ENV) and the warnings hooks come back as they
    were, and the process group the run made is ended (one the caller made is kept)."""
    from megatron.entry_state import entry_point_changes_undone
    from megatron.rank_failure import process_group_closed

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        with entry_point_changes_undone(os.environ), \
                process_group_closed("during the benchmark", os.environ):
            return _main(argv)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _main(argv) -> int:
    from megatron.cli_suggest import SuggestingParser

    ap = SuggestingParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-124m")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many steps and print the top operators")
    ap.add_argument("--profile-sort", choices=["device", "cpu"], default="device",
                    help="order the profile table by GPU (device) or host (cpu) self time")
    ap.add_argument("--profile-rows", type=int, default=40,
                    help="operators listed in the profile table")
    ap.add_argument("--profile-launches", default="", metavar="REGEX",
                    help="with --profile-steps on CUDA: count the kernels matching REGEX "
                         "per step by the operator that launched them (e.g. memset)")
    ap.add_argument("--sync-debug", type=int, default=0, metavar="N",
                    help="after timing, run N steps in CUDA sync-debug mode and report how "
                         "many host synchronisations they made (CUDA only)")
    ap.add_argument("--chip-sample-ms", type=int, default=250, metavar="MS",
                    help="period of the nvidia-smi clock and power samples during the timed "
                         "steps (CUDA); 0 turns the sampler off")
    ap.add_argument("--layout", default=None,
                    help="parallel layout of this run, e.g. tp2pp2dp2 (under torchrun)")
    ap.add_argument("--scaling", default=None,
                    help="comma-separated layouts to run one after another through torchrun "
                         "on this host, e.g. tp1,dp2,dp4,tp2dp2; prints the efficiency table")
    ap.add_argument("extra", nargs="*", help="extra pretrain_gpt.py flags (after --)")
    a = ap.parse_args(argv)
    _check_counts(ap, a)
    rank, world, _ = launcher_ranks(os.environ)  # a RANK that is no number: one line
    if a.device == "cpu":
        # the whole run on the CPU (gloo between ranks, --scaling's included) even where a
        # GPU is visible: the start-up picks NCCL and the GPU whenever CUDA is available
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if a.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("error: --device cpu: CUDA was initialised before tools/benchmark.py "
                         "started; run it as a command of its own (or with "
                         "CUDA_VISIBLE_DEVICES=\"\")")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available")
    if a.scaling:
        return scaling(a, device)
    mbs = PRESETS[a.preset][1] if a.micro_batch_size is None else a.micro_batch_size
    layout = parse_layout(a.layout) if a.layout else None
    if layout is not None:
        check_layout_world(a.layout, layout, world)
    warmup = timed_warmup(a.warmup, device, a.extra, world)
    result = run(a.preset, a.steps, warmup, mbs, a.extra, device, a.profile_steps, layout,
                 a.sync_debug, a.profile_sort, a.profile_rows, a.profile_launches,
                 a.chip_sample_ms)
    if rank == world - 1:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        # SIGTERM to this process alone (`kill`, a job's end) ends --scaling's torchrun and
        # the nvidia-smi sampler with it; torchrun's workers keep the default (torchrun
        # signals each worker's whole process group, the sampler included)
        child_processes.sigterm_as_exit()
    from megatron.process_exit import run as run_main

    run_main(main)  # sys.exit(main()) without the interpreter's teardown (about a second)
