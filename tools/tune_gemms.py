#!/usr/bin/env python
"""Measure which cuBLASLt algorithm runs each of a model's products fastest at the GPU's
power limit, and write the table that `--gemm-algorithms FILE` reads (CUDA).

    python tools/tune_gemms.py --out gemms.json --preset gpt-1.3b
    python tools/tune_gemms.py --out gemms.json -- <pretrain_gpt.py flags of your run>
    python tools/tune_gemms.py --record-only --device cpu --preset tiny
    torchrun --nproc-per-node 8 tools/tune_gemms.py --out gemms.json -- <flags with TP/PP>

One eager training step with the run's flags records the shapes the linear layers
multiply (forward, input grad, weight grad into the fp32 main grad) and how often. Then,
per shape, torch's own product and every candidate cuBLASLt's heuristic offers are each
run back to back for --seconds (the first third heats the chip to its power limit, the
rest is timed with CUDA events), --rounds times in alternation. A candidate enters the
table when its result matches torch's and it beats torch's product by more than
--min-gain. Where the run computes the MLP's GeLU in the products (the tanh form:
`--openai-gelu`, the default GeLU with biases, or `--gelu-kernel epilogue`) those products
(GELU_AUX or GELU_AUX_BIAS forward, DGELU input grad) are recorded too, and so are the
forward products that add a bias (BIAS epilogue); their baseline is cuBLASLt's heuristic's
first algorithm (what the run takes without a table, or as torch's addmm does). Train with
`--gemm-algorithms gemms.json` on the same GPU model and software (the table records both
and is refused elsewhere). Tune with the flags of the real run: the shapes depend on the
micro batch, sequence length and parallel layout.
"""
from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK_TOLERANCE = 1e-3  # |candidate - torch| / max|torch|: a wrong layout is O(1)
EPILOGUE_TOLERANCE = 1e-2  # against an fp32 reference: one bf16 rounding is 2**-9 relative


def record_shapes(argv: list, device: str, rank: int = 0, world: int = 1, local_rank: int = 0):
    """Counter{Shape: calls} of one eager training step with `argv`, on this rank (under
    torchrun every rank records its own: tensor-parallel slices, pipeline stages). With
    --use-checkpoint-args rank 0 reads the checkpoint's arguments for every rank through
    the launch's rendezvous store, which then makes the process group (pretrain_gpt.py's
    start)."""
    from megatron.arguments import parse_and_validate
    from megatron.core.tensor_parallel import gemm_algos
    from megatron.initialize import initialize_entry_point, set_random_seed
    from megatron.startup_store import JobStore
    from megatron.training import build_trainer, data_iterator, train_step
    from tools.benchmark import loaders_closed

    argv = argv + ["--no-compile", "--cuda-graph-step", "off"]
    job = JobStore(os.environ, rank, world)
    config = parse_and_validate(argv, world_size=world, env={"RANK": str(rank)},
                                cuda_available=device == "cuda", job_store=job)
    config.args["gemm_algorithms"] = None  # record torch's products, whatever argv says
    rt = initialize_entry_point(config.parallel, config.args["cublas_workspace"], rank, world,
                                local_rank, os.environ, store=job.store)
    set_random_seed(config.training.seed, rt)
    tr = build_trainer(config, rt)
    data = data_iterator(config, rt, "train", 0)
    with loaders_closed(tr, data), gemm_algos.recording() as counts:
        train_step(tr, data)
    return counts


def operands(shape, torch):
    """(A, B, C, beta, epilogue operands, baseline fn, reference fn): cuBLASLt's operands,
    the epilogue's aux matrix and bias vector (a dict for CublasLt.matmul), what runs
    without a table (torch's product as the layers run it;
    for an epilogue product the heuristic's first algorithm) and the expected result."""
    from megatron.core.tensor_parallel import gemm_algos

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]

    def rand(*size, scale=1.0):
        return (torch.randn(*size, device="cuda", generator=gen) * scale).to(dtype)

    m, n, k, ep = shape.m, shape.n, shape.k, shape.epilogue
    if shape.kind in ("forward", "dgrad"):
        b, w = rand(m, k), (rand(n, k, scale=0.02) if shape.kind == "forward"
                            else rand(k, n, scale=0.02))
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        product = (lambda: b @ w.t()) if shape.kind == "forward" else (lambda: b @ w)
        extra, ref = {}, product
        if ep == "bias":
            extra = {"bias": rand(n, scale=0.5)}
            ref = (lambda: product().float() + extra["bias"].float())
        elif ep == "gelu_aux":
            extra = {"aux": torch.empty_like(out)}
            ref = (lambda: torch.nn.functional.gelu(product().float(), approximate="tanh"))
        elif ep == "gelu_aux_bias":
            extra = {"aux": torch.empty_like(out), "bias": rand(n, scale=0.5)}
            ref = (lambda: torch.nn.functional.gelu(product().float() + extra["bias"].float(),
                                                    approximate="tanh"))
        elif ep == "dgelu":
            extra = {"aux": rand(m, n)}
            ref = (lambda: gemm_algos.gelu_tanh_grad(product().float(), extra["aux"]))
        if ep:
            lt = gemm_algos.cublaslt()
            first = _as_algo(lt.candidates(shape, 1, ep)[0])
            return (w, b, out, 0.0, extra,
                    lambda: lt.matmul(shape, first, w, b, out, 0.0, ep, **extra), ref)
        return w, b, out, 0.0, {}, ref, ref
    dy, x = rand(k, m), rand(k, n)
    out = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    return (x, dy, out, 1.0, {},
            lambda: torch.addmm(out, dy.t(), x, out_dtype=torch.float32, out=out),
            lambda: torch.mm(dy.t(), x, out_dtype=torch.float32))


def sustained_ms(fn, seconds: float, torch) -> float:
    """ms per call over the last two thirds of `seconds` of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 3:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    start.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds * 2 / 3:
        for _ in range(10):
            fn()
        calls += 10
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / calls


def tune_shape(shape, args, lt, torch) -> dict:
    """Times of the baseline (torch's product; for an epilogue product the heuristic's
    first algorithm) and of every candidate that matches it; the best one."""
    a, b, out, beta, extra, baseline, reference = operands(shape, torch)
    want = reference().float()
    scale = want.abs().max().item() or 1.0
    ep = shape.epilogue
    good = []
    for algo in lt.candidates(shape, args.candidates, ep):
        as_struct = _as_algo(algo)
        out.zero_()
        lt.matmul(shape, as_struct, a, b, out, 0.0, ep, **extra)
        tolerance = EPILOGUE_TOLERANCE if ep else CHECK_TOLERANCE
        if (out.float() - want).abs().max().item() <= tolerance * scale:
            good.append((algo, as_struct))
    runs = [baseline] + [(lambda x=x: lt.matmul(shape, x, a, b, out, beta, ep, **extra))
                         for _, x in good]
    times = [[] for _ in runs]
    for _ in range(args.rounds):
        for t, fn in zip(times, runs):
            t.append(sustained_ms(fn, args.seconds, torch))
    ms = [sum(t) / len(t) for t in times]
    best = min(range(1, len(ms)), key=lambda i: ms[i], default=None)
    row = {"shape": shape, "torch_ms": round(ms[0], 4), "candidates": len(good)}
    if ep:  # the baseline was cuBLASLt's first choice, not torch
        row["baseline_ms"] = row.pop("torch_ms")
    if best is not None:
        row.update(algo=good[best - 1][0], ms=round(ms[best], 4),
                   algorithm=lt.describe(good[best - 1][0]))
    return row


def _as_algo(algo: bytes):
    import ctypes

    return (ctypes.c_uint64 * 8).from_buffer_copy(algo)


def main(argv=None) -> int:
    """The command line (None: sys.argv[1:]); the exit status. Callable more than once in
    one process: the environment variables it sets (megatron.entry_state.ENTRY_POINT_ENV)
    and the warnings hooks come back as they were, and the process group the run made is
    ended (one the caller made is kept)."""
    from megatron.entry_state import entry_point_changes_undone
    from megatron.rank_failure import process_group_closed

    with entry_point_changes_undone(os.environ), \
            process_group_closed("while recording the products", os.environ):
        return _main(argv)


def _check_counts(ap, args) -> None:
    """Refuse timing settings no tuning can use before the step is recorded: --rounds 0
    and --seconds 0 (or nan) divided by zero on the GPU after the recording."""
    import math

    if not (math.isfinite(args.seconds) and args.seconds > 0):
        ap.error(f"--seconds {args.seconds} must be a number > 0 (seconds per timing, "
                 "default 1.2)")
    for flag, value in (("--rounds", args.rounds), ("--candidates", args.candidates)):
        if value < 1:
            ap.error(f"{flag} {value} must be >= 1")
    if not math.isfinite(args.min_gain):
        ap.error(f"--min-gain {args.min_gain} must be a finite number (default 0.01)")


def _main(argv) -> int:
    from megatron.cli_suggest import SuggestingParser
    from megatron.srun_tasks import launcher_ranks

    ap = SuggestingParser(description=__doc__.split("\n\n")[0],  # first paragraph
                          epilog="flags after -- are pretrain_gpt.py's")
    ap.add_argument("--out", help="table to write (JSON)")
    ap.add_argument("--preset", help="a tools/benchmark.py preset instead of flags after --")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seconds", type=float, default=1.2, help="per timing (default 1.2)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating passes (default 1)")
    ap.add_argument("--candidates", type=int, default=8, help="asked of the heuristic")
    ap.add_argument("--min-gain", type=float, default=0.01,
                    help="keep a candidate that beats torch by more than this (default 0.01)")
    ap.add_argument("--record-only", action="store_true",
                    help="print the recorded shapes and stop (works on the CPU)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    _check_counts(ap, args)
    if args.preset:
        from tools.benchmark import PRESETS, build_argv

        if args.preset not in PRESETS:
            raise SystemExit(f"error: --preset {args.preset!r}; choose from {sorted(PRESETS)}")
        flags = build_argv(args.preset, 4, 0, PRESETS[args.preset][1], extra)  # > lr warm-up
    elif extra:
        flags = [f for i, f in enumerate(extra)
                 if f != "--gemm-algorithms" and (i == 0 or extra[i - 1] != "--gemm-algorithms")]
    else:
        raise SystemExit("error: give --preset NAME or your pretrain_gpt.py flags after --")
    if not args.record_only and (args.out is None or args.device != "cuda"):
        raise SystemExit("error: tuning needs --out FILE and CUDA (--record-only lists the "
                         "shapes on any device)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device cuda, but CUDA is not available here (torch "
                         f"{torch.__version__}); tune on the GPU machine of the run, or list "
                         "the shapes here with --record-only --device cpu")
    rank, world, local_rank = launcher_ranks(os.environ)
    counts = record_shapes(flags, args.device, rank, world, local_rank)
    args.quiet = rank != 0  # under torchrun rank 0 prints and writes the table
    say = (lambda *a, **k: None) if args.quiet else print
    say("| product | m | n | k | dtype | per step |")
    say("|---|---|---|---|---|---|")
    for s, c in sorted(counts.items(), key=lambda sc: -sc[0].flops() * sc[1]):
        say(f"| {s.kind}{' ' + s.epilogue if s.epilogue else ''} | {s.m} | {s.n} | {s.k} | "
            f"{s.dtype} | {c} |", flush=True)
    if args.record_only:
        return 0
    return tune(counts, args, say)


def tune(counts, args, say=print) -> int:
    """Time every recorded shape on this rank's GPU; rank 0 writes the union of what the
    ranks kept (their chips tune at the same time, each its own shapes)."""
    import torch
    import torch.distributed as dist

    from megatron.core.tensor_parallel import gemm_algos

    gc.collect()
    torch.cuda.empty_cache()
    lt = gemm_algos.cublaslt()
    say("\n| product | m | n | k | torch ms (epilogue: cuBLASLt's first) | best candidate | ms "
        "| gain | ms saved per step |")
    say("|---|---|---|---|---|---|---|---|---|")
    kept, saved = [], 0.0
    for s, count in sorted(counts.items(), key=lambda sc: -sc[0].flops() * sc[1]):
        if s.dtype not in ("bf16", "fp16"):
            say(f"| {s.kind} | {s.m} | {s.n} | {s.k} | {s.dtype}: only 16-bit products "
                "are tuned | | | | |")
            continue
        row = tune_shape(s, args, lt, torch)
        base = row.get("torch_ms", row.get("baseline_ms"))
        gain = 1 - row["ms"] / base if "ms" in row else 0.0
        win = gain > args.min_gain
        if win:
            kept.append(row)
            saved += (base - row["ms"]) * count
        say(f"| {s.kind}{' ' + s.epilogue if s.epilogue else ''} | {s.m} | {s.n} | {s.k} | "
            f"{base:.3f} | "
              f"{row.get('algorithm', 'none of %d' % row['candidates'])} | "
              f"{row.get('ms', float('nan')):.3f} | {100 * gain:+.1f}%{'' if win else ' (kept torch)'} "
              f"| {(base - row['ms']) * count if win else 0.0:.2f} |", flush=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, kept)
        kept = list({row["shape"]: row for rows in gathered for row in rows}.values())
    if not args.quiet:
        gemm_algos.save_table(args.out, torch.cuda.get_device_name(), lt.version, kept)
    say(f"\n{len(kept)} shapes in {args.out} (rank 0's of {len(counts)}: predicted saving "
        f"{saved:.2f} ms per step, measured one product at a time at the power limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
