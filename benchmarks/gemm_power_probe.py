#!/usr/bin/env python
"""Matrix products of gpt-1.3b timed under sustained load, where the H200 sits at its
power limit (CUDA).

    python benchmarks/gemm_power_probe.py [--seconds 3] [--tunableop-log FILE]

A product timed alone for a few milliseconds runs at the idle chip's clock; inside a
training step the board draws its 700 W limit and the clock drops. Each case here runs
back to back for `--seconds` (the first third heats the chip, the rest is timed with CUDA
events while nvidia-smi samples clock and power), so the table shows which variant does
more work per joule. Cases: the fc1 forward product through cuBLAS and cuBLASLt, and the
fc1 weight-gradient product into an fp32 buffer accumulating (beta 1, what the layers do),
overwriting (beta 0) and as a bf16 product. With --tunableop-log, TunableOp tunes the fc1
forward product once (verbose) and its log goes to FILE, to list the candidates it has.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import child_processes  # noqa: E402
from tools.benchmark import ChipMonitor, chip_id  # noqa: E402

T, H, F = 16384, 2048, 8192  # tokens per micro-batch, hidden, ffn hidden (gpt-1.3b)


def sustained(fn, flops: float, seconds: float, gpu: str) -> dict:
    """TFLOP/s over the last two thirds of `seconds` of back-to-back calls, with the
    chip's median clock and power over that window."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < seconds / 3:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / calls
    n = max(10, int(2 * seconds / 3 / per_call))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with ChipMonitor(gpu, period_ms=100) as mon:
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / n
    return {"ms": ms, "tflops": flops / ms / 1e9, **mon.summary()}


def cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(F, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(T, F, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(F, H, device="cuda", dtype=torch.float32)
    wgrad16 = torch.empty(F, H, device="cuda", dtype=torch.bfloat16)
    return [
        ("fc1 fwd x@W.t()", "cublas", lambda: torch.mm(x, w.t(), out=out)),
        ("fc1 fwd x@W.t()", "cublaslt", lambda: torch.mm(x, w.t(), out=out)),
        ("fc1 wgrad fp32 beta 1", "cublas",
         lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)),
        ("fc1 wgrad fp32 beta 0", "cublas",
         lambda: torch.mm(dy.t(), x, out_dtype=torch.float32, out=main_grad)),
        ("fc1 wgrad bf16", "cublas", lambda: torch.mm(dy.t(), x, out=wgrad16)),
    ]


def tunableop_log(path: str) -> None:
    """Tune the fc1 forward product once with TunableOp's verbose log in `path`."""
    code = ("import torch; x=torch.randn(%d,%d,device='cuda',dtype=torch.bfloat16); "
            "w=torch.randn(%d,%d,device='cuda',dtype=torch.bfloat16); "
            "[torch.mm(x,w.t()) for _ in range(3)]; torch.cuda.synchronize(); "
            "print(torch.cuda.tunable.get_results())" % (T, H, F, H))
    env = dict(os.environ, PYTORCH_TUNABLEOP_ENABLED="1", PYTORCH_TUNABLEOP_TUNING="1",
               PYTORCH_TUNABLEOP_VERBOSE="3", CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTORCH_TUNABLEOP_FILENAME=os.path.join(os.path.dirname(path) or ".",
                                                       "tunableop%d.csv"))
    with open(path, "w") as f:
        child_processes.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT,
                            env=env, timeout=300)
    print(f"TunableOp log: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--tunableop-log", default=None)
    a = ap.parse_args()
    gpu = chip_id(torch, torch.device("cuda", 0))
    print(f"torch {torch.__version__}; {T} tokens, hidden {H}, ffn {F}; "
          f"{a.seconds:g} s per case")
    print(f"{'product':<24}{'library':<10}{'ms':>8}{'TFLOP/s':>9}{'MHz':>7}{'W':>6}")
    default = torch.backends.cuda.preferred_blas_library()
    for label, lib, fn in cases():
        torch.backends.cuda.preferred_blas_library(lib)
        r = sustained(fn, 2.0 * T * H * F, a.seconds, gpu)
        print(f"{label:<24}{lib:<10}{r['ms']:>8.3f}{r['tflops']:>9.1f}"
              f"{r.get('sm_clock_mhz', float('nan')):>7}{r.get('power_w', float('nan')):>6}",
              flush=True)
    torch.backends.cuda.preferred_blas_library(default)
    if a.tunableop_log:
        tunableop_log(a.tunableop_log)


if __name__ == "__main__":
    child_processes.sigterm_as_exit()  # SIGTERM ends the TunableOp child and the sampler too
    main()
