#!/usr/bin/env python
"""Time the QKV projection's backward from the attention's separate dq, dk, dv (CUDA):
the fused weight in Megatron's per-group order (q heads, k, v of each query group) needs
the three gradients concatenated into that order before its two products; a weight
stored grouped by kind ([all q; all k; all v]) takes them as three products each.

    python benchmarks/qkv_grad_probe.py [--tokens 16384] [--hidden 2048] [--heads 16]
        [--groups 16] [--head-dim 128] [--iters 30]

Rows (ms per layer and micro-batch; the step pays each once per layer):
- concat: dq, dk, dv (dense [tokens, heads * d] as the attention backward writes them)
  into the [tokens, g * (p + 2) * d] per-group order;
- per-group order: concat + input grad (one product) + weight grad into an fp32 buffer;
- grouped order: input grad as three products accumulating in bf16 + weight grad as three
  products into slices of the fp32 buffer;
- weight reorder: the per-group weight copied to grouped order (what keeping Megatron's
  order in the parameter and reordering per micro-batch would add).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402


def _tensors(t, h, n, g, d):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = (torch.randn(t, c * d, **bf) for c in (n, g, g))
    x = torch.randn(t, h, **bf)
    w = torch.randn((n + 2 * g) * d, h, **bf) * 0.02
    main_grad = torch.zeros((n + 2 * g) * d, h, device="cuda", dtype=torch.float32)
    return dq, dk, dv, x, w, main_grad


def per_group_order(dq, dk, dv, x, w, main_grad, g):
    t = dq.shape[0]
    dqkv = torch.cat([dq.view(t, g, -1), dk.view(t, g, -1), dv.view(t, g, -1)], dim=-1)
    dqkv = dqkv.view(t, -1)
    dx = dqkv @ w
    torch.addmm(main_grad, dqkv.t(), x, out_dtype=torch.float32, out=main_grad)
    return dx


def grouped_order(dq, dk, dv, x, w, main_grad, n, g, d):
    rows = [0, n * d, (n + g) * d, (n + 2 * g) * d]
    dx = dq @ w[: rows[1]]
    for grad, lo, hi in ((dk, rows[1], rows[2]), (dv, rows[2], rows[3])):
        torch.addmm(dx, grad, w[lo:hi], out=dx)
    for grad, lo, hi in zip((dq, dk, dv), rows[:-1], rows[1:]):
        part = main_grad[lo:hi]
        torch.addmm(part, grad.t(), x, out_dtype=torch.float32, out=part)
    return dx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    t, h, n, g, d = a.tokens, a.hidden, a.heads, a.groups, a.head_dim
    dq, dk, dv, x, w, mg = _tensors(t, h, n, g, d)
    p = n // g

    def concat():
        torch.cat([dq.view(t, g, -1), dk.view(t, g, -1), dv.view(t, g, -1)], dim=-1)

    def reorder():
        w.view(g, p + 2, d, h).permute(1, 0, 2, 3).contiguous()

    rows = {
        "concat only": lambda: concat(),
        "per-group order (today)": lambda: per_group_order(dq, dk, dv, x, w, mg, g),
        "grouped order, 3+3 products": lambda: grouped_order(dq, dk, dv, x, w, mg, n, g, d),
        "weight reorder copy": lambda: reorder(),
    }
    # correctness: both orders give the same input grad and weight grad (up to the order)
    ref_mg = torch.zeros_like(mg)
    dx_a = per_group_order(dq, dk, dv, x, w, ref_mg, g)
    w_grouped = w.view(g, p + 2, d, h)
    w_grouped = torch.cat([w_grouped[:, :p].reshape(-1, h), w_grouped[:, p].reshape(-1, h),
                           w_grouped[:, p + 1].reshape(-1, h)])
    mg_b = torch.zeros_like(mg)
    dx_b = grouped_order(dq, dk, dv, x, w_grouped, mg_b, n, g, d)
    ref_grouped = ref_mg.view(g, p + 2, d, h)
    ref_grouped = torch.cat([ref_grouped[:, :p].reshape(-1, h), ref_grouped[:, p].reshape(-1, h),
                             ref_grouped[:, p + 1].reshape(-1, h)])
    print(f"# check: input grad max diff {(dx_a.float() - dx_b.float()).abs().max().item():.3g}"
          f" (|dx| max {dx_a.float().abs().max().item():.3g}), weight grad max diff "
          f"{(ref_grouped - mg_b).abs().max().item():.3g}")
    print(f"# tokens {t} hidden {h} heads {n} groups {g} head dim {d}; "
          f"{torch.cuda.get_device_name()}")
    print("| case | ms |\n|---|---|")
    for _ in range(2):  # two rounds, alternating, to show the spread
        for name, fn in rows.items():
            mg.zero_()
            print(f"| {name} | {mean_ms(fn, a.iters):.3f} |")


if __name__ == "__main__":
    main()
