#!/usr/bin/env python
"""Time the MLP activation's forward and backward on one GPU, against a plain copy of
the same bytes, alone and right after the matrix product that feeds it (CUDA).

    python benchmarks/act_probe.py [--tokens 16384] [--hidden 2048] [--ffn 8192] [--sweep]

Rows: ms per call and the bandwidth reached (bytes the pass must move: forward reads the
pre-activation and writes the activation, backward reads the upstream gradient and the
pre-activation and writes the input gradient). "after GEMM" rows time GEMM + pass and
subtract the GEMM alone, i.e. the pass's cost on a chip that is drawing full power.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402


def variants():
    """name -> a differentiable forward fn(h), or a pair of kernels (fwd(h), bwd(g, h))."""
    out = {"eager gelu(erf)": F.gelu,
           "compiled gelu(erf)": torch.compile(F.gelu),
           "compiled gelu(tanh)": torch.compile(lambda x: F.gelu(x, approximate="tanh"))}
    try:
        from megatron.core import fused_activation as fa
    except ImportError:
        return out
    out["polynomial operator"] = fa.gelu  # Triton kernels on CUDA
    out["polynomial, compiled"] = torch.compile(fa.gelu)
    out["polynomial kernels direct"] = (fa.gelu_forward, fa.gelu_backward)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true",
                    help="instead: time the Triton kernels for each (BLOCK, num_warps)")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(a.tokens, a.hidden, device=dev, dtype=dt)
    w = torch.randn(a.ffn, a.hidden, device=dev, dtype=dt) * 0.02
    h = x @ w.t()
    g = torch.randn_like(h)
    nbytes = h.numel() * h.element_size()
    gemm_ms = mean_ms(lambda: torch.mm(x, w.t()), a.iters)
    print(f"activation [{a.tokens}, {a.ffn}] bf16 ({nbytes / 1e6:.0f} MB); "
          f"fc1 GEMM alone {gemm_ms:.3f} ms")
    print(f"{'pass':<26} {'alone ms':>9} {'TB/s':>6} {'after GEMM ms':>14} {'TB/s':>6}")

    def row(name, fn, moved):
        alone = mean_ms(fn, a.iters)
        ctx = mean_ms(lambda: (torch.mm(x, w.t()), fn()), a.iters) - gemm_ms
        print(f"{name:<26} {alone:>9.3f} {moved / alone / 1e9:>6.2f} {ctx:>14.3f} "
              f"{moved / max(ctx, 1e-6) / 1e9:>6.2f}", flush=True)

    row("copy (read + write)", lambda: h.clone(), 2 * nbytes)
    if a.sweep:
        from megatron.core import fused_activation as fa

        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                fa.BLOCK, fa._NUM_WARPS = block, warps
                row(f"BLOCK {block} warps {warps} fwd", lambda: fa.gelu_forward(h), 2 * nbytes)
                row(f"BLOCK {block} warps {warps} bwd", lambda: fa.gelu_backward(g, h),
                    3 * nbytes)
        return
    hr = h.detach().requires_grad_(True)
    for name, fn in variants().items():
        if isinstance(fn, tuple):
            fwd, bwd = fn
            row(f"{name} fwd", lambda: fwd(h), 2 * nbytes)
            row(f"{name} bwd", lambda: bwd(g, h), 3 * nbytes)
            continue
        y = fn(hr)
        row(f"{name} fwd", lambda: fn(hr), 2 * nbytes)
        row(f"{name} bwd", lambda: torch.autograd.grad(y, hr, g, retain_graph=True), 3 * nbytes)


if __name__ == "__main__":
    main()
