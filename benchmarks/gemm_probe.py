#!/usr/bin/env python
"""Time the training step's matrix-product shapes under different BLAS settings (CUDA).

    python benchmarks/gemm_probe.py [--preset gpt-1.3b|gpt2-124m|all] [--iters 30]

For each shape (tokens x in -> out, bf16) it times, with CUDA events after warm-up:
the forward product as the layers issue it (x @ W.t(), W stored [out, in]), the same
with W stored [in, out], the input-gradient product (dy @ W), and the weight-gradient
product accumulated into an fp32 buffer (addmm, out_dtype fp32, beta 1) -- first with
cuBLAS, then with cuBLASLt preferred. Prints TFLOP/s per cell.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402

SHAPES = {  # preset: [(tokens, in, out)]
    "gpt-1.3b": [(16384, 2048, 6144), (16384, 2048, 2048), (16384, 2048, 8192),
                 (16384, 8192, 2048), (16384, 2048, 50304)],
    "gpt2-124m": [(16384, 768, 2304), (16384, 768, 768), (16384, 768, 3072),
                  (16384, 3072, 768), (16384, 768, 50304)],
}



def timed(fn, iters: int) -> float:
    """Mean seconds per call (CUDA events, after 5 warm-up calls)."""
    return mean_ms(fn, iters, warmup=5) / 1000


def cases(t: int, k: int, n: int):
    """(label, callable) for one layer shape: x [t, k], W [n, k]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w_kn = w.t().contiguous()
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(t, k, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
    return [
        ("fwd x@W.t()", lambda: torch.mm(x, w.t(), out=out)),
        ("fwd x@W[k,n]", lambda: torch.mm(x, w_kn, out=out)),
        ("dgrad dy@W", lambda: torch.mm(dy, w, out=dx)),
        ("wgrad fp32+=", lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32,
                                             out=main_grad)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="all", choices=["all"] + sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    presets = sorted(SHAPES) if a.preset == "all" else [a.preset]
    default = str(torch.backends.cuda.preferred_blas_library()).split(".")[-1].lower()
    print(f"torch {torch.__version__}, default BLAS library: {default}")
    libraries = ["cublas", "cublaslt"]
    print(f"{'shape (tokens x in -> out)':<28}{'product':<15}" + "".join(f"{x:>10}" for x in libraries))
    for preset in presets:
        for t, k, n in SHAPES[preset]:
            flops = 2 * t * k * n
            rows = {}
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                for label, fn in cases(t, k, n):
                    try:
                        rows.setdefault(label, []).append(flops / timed(fn, a.iters) / 1e12)
                    except RuntimeError as exc:  # a library without this product
                        print(f"  {label} {lib}: {str(exc).splitlines()[0]}")
                        rows.setdefault(label, []).append(float("nan"))
            for label, rates in rows.items():
                print(f"{f'{t} x {k} -> {n}':<28}{label:<15}" + "".join(f"{r:>10.1f}" for r in rates))
    torch.backends.cuda.preferred_blas_library(default)


if __name__ == "__main__":
    main()
