"""Which scaled_dot_product_attention backends take grouped-query attention natively
(`enable_gqa=True`, k/v with fewer heads than q), and how fast forward + backward is
against repeating k and v to every query head first (llama-1b's attention: batch 8,
32 query heads, 8 groups, sequence 2048, head dim 64, bf16, causal).

    python benchmarks/gqa_probe.py [--iters 20]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def backend(name: str):
    return contextlib.nullcontext() if name == "auto" else sdpa_kernel([BACKENDS[name]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    b, n, g, s, d = a.batch, a.heads, a.groups, a.seq, a.head_dim
    q = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, g, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, g, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16)
    ref = None
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'backend':10s} {'k/v':8s} {'fwd+bwd ms':>10s} {'max |diff|':>10s}")
    for name in ("auto", "cudnn", "flash", "efficient"):
        for mode in ("repeat", "native"):
            def run():
                kk, vv = k, v
                if mode == "repeat":
                    kk, vv = k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1)
                with backend(name):
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                         enable_gqa=mode == "native")
                out.backward(dout)
                return out
            try:
                ms = mean_ms(run, a.iters)
                q.grad = k.grad = v.grad = None
                out = run().float()
                grads = [t.grad.float() for t in (q, k, v)]
                q.grad = k.grad = v.grad = None
                if ref is None:
                    ref = (out, grads)
                diff = max((out - ref[0]).abs().max().item(),
                           *[(x - y).abs().max().item() for x, y in zip(grads, ref[1])])
                print(f"{name:10s} {mode:8s} {ms:10.3f} {diff:10.2e}")
            except RuntimeError as exc:
                print(f"{name:10s} {mode:8s} {'--':>10s} {str(exc).splitlines()[0][:70]}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)
        torch.cuda.synchronize()
    names = sorted({e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"})
    print("auto + native GQA runs:", "; ".join(names))


if __name__ == "__main__":
    main()
