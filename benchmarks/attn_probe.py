#!/usr/bin/env python
"""Time causal attention forward + backward on one GPU for each SDPA backend, with q/k/v
laid out as the model lays them out (views of the packed QKV projection output) and as
separate contiguous [b, n, s, d] tensors (CUDA).

    python benchmarks/attn_probe.py [--batch 8] [--heads 16] [--seq 2048] [--head-dim 128]

Rows: ms for the forward, for forward + backward, and the TFLOP/s reached counting the
causal half of the score matrix (forward 2 GEMMs, backward 5, of b*n*s*s*d/2 MACs each).
"packed" rows include what the model pays around the kernel: the backward's gradient of
the packed QKV tensor (the concatenation of dq, dk, dv) and the output's transpose.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}




def packed_inputs(b, n, s, d):
    """q, k, v as the model makes them: [s, b, n, 3d] projection output, split per head,
    permuted to [b, n, s, d] (strided views)."""
    qkv = torch.randn(s, b, n, 3 * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def views():
        q, k, v = torch.split(qkv, [d, d, d], dim=-1)
        return qkv, [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    return views


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    b, n, s, d = a.batch, a.heads, a.seq, a.head_dim
    half_macs = b * n * s * s * d / 2
    print(f"causal attention b={b} n={n} s={s} d={d} bf16; torch {torch.__version__}")
    print(f"{'backend':<10} {'layout':<11} {'fwd ms':>7} {'TFLOP/s':>8} {'fwd+bwd ms':>11} "
          f"{'TFLOP/s':>8}")
    for name, backend in BACKENDS.items():
        for layout in ("contiguous", "packed"):
            if layout == "packed":
                make = packed_inputs(b, n, s, d)
                leaf, qkv = make()
            else:
                qkv = [torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3)]
                leaf = None
            try:
                with sdpa_kernel([backend]):
                    def fwd():
                        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
                        if layout == "packed":  # what the model does with the output
                            out = out.permute(2, 0, 1, 3).reshape(s, b, n * d)
                        return out
                    with torch.no_grad():
                        f_ms = mean_ms(fwd, a.iters)
                    grad = torch.randn_like(fwd())

                    def fwd_bwd():
                        out = fwd()
                        inputs = [leaf] if leaf is not None else qkv
                        torch.autograd.grad(out, inputs, grad)
                    fb_ms = mean_ms(fwd_bwd, a.iters)
            except RuntimeError as exc:
                print(f"{name:<10} {layout:<11} unavailable: {str(exc).splitlines()[0][:80]}")
                continue
            print(f"{name:<10} {layout:<11} {f_ms:>7.3f} {4 * half_macs / f_ms / 1e9:>8.0f} "
                  f"{fb_ms:>11.3f} {14 * half_macs / fb_ms / 1e9:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
