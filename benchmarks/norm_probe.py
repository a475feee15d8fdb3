#!/usr/bin/env python
"""Time the gradient-norm pass and the grad-buffer zeroing on one GPU, for gradients laid
out as the training step lays them out: fp32 views of one flat grad buffer (CUDA).

    python benchmarks/norm_probe.py [--preset gpt-1.3b|gpt2-124m] [--iters 20]

Rows: ms per pass, bandwidth (4 bytes read, or for the zeroing written, per gradient
element) and the norm's relative error against an fp64 reference.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.adam_probe import PRESETS, shapes  # noqa: E402
from benchmarks.cuda_timing import mean_ms  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    sizes = [torch.Size(s) for s in shapes(*PRESETS[a.preset])]
    total = sum(s.numel() for s in sizes)
    buffer = torch.randn(total, device="cuda", dtype=torch.float32)
    params, start = [], 0
    for s in sizes:
        p = torch.empty(s, device="cuda", dtype=torch.bfloat16)
        p.main_grad = buffer[start:start + s.numel()].view(s)
        params.append(p)
        start += s.numel()
    grads = [p.main_grad for p in params]
    nbytes = 4 * total
    print(f"{a.preset}: {len(params)} gradients, {total / 1e6:.0f} M fp32 elements "
          f"({nbytes / 1e9:.2f} GB)")
    ref = torch.linalg.vector_norm(buffer.double()).item()
    rows = {
        "get_grad_norm (per tensor)": lambda: clip_grads.get_grad_norm(params, None, 0),
        "_foreach_norm per tensor": lambda: torch._foreach_norm(grads, 2.0),
        "_foreach_norm one buffer": lambda: torch._foreach_norm([buffer], 2.0),
        "vector_norm one buffer": lambda: torch.linalg.vector_norm(buffer),
    }
    print(f"{'pass':<28} {'ms':>7} {'TB/s':>6} {'rel err':>9}")
    for name, fn in rows.items():
        ms = mean_ms(fn, a.iters)
        out = fn()
        if isinstance(out, (list, tuple)):
            out = torch.stack(list(out)).double().square().sum().sqrt()
        err = abs(out.double().item() - ref) / ref
        print(f"{name:<28} {ms:>7.3f} {nbytes / ms / 1e9:>6.2f} {err:>9.1e}", flush=True)
    ms = mean_ms(lambda: buffer.fill_(0.0), a.iters)
    print(f"{'fill_(0) buffer':<28} {ms:>7.3f} {nbytes / ms / 1e9:>6.2f}")


if __name__ == "__main__":
    main()
