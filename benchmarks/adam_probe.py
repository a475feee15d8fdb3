#!/usr/bin/env python
"""Time the Triton AdamW kernel (megatron/core/optimizer/multi_tensor_adam.py) over
block sizes and warp counts, on parameter sets shaped like a preset's (CUDA).

    python benchmarks/adam_probe.py [--preset gpt-1.3b|gpt2-124m] [--iters 20]

Prints ms per step and the bandwidth reached (30 bytes per parameter: fp32 p, g, m, v
read, p, m, v written, bf16 model copy written) for each (BLOCK, num_warps).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402
from megatron.core.optimizer import multi_tensor_adam as mta  # noqa: E402

PRESETS = {  # (layers, hidden, ffn, vocab, seq)
    "gpt-1.3b": (24, 2048, 8192, 50304, 2048),
    "gpt2-124m": (12, 768, 3072, 50304, 1024),
}


def shapes(layers: int, h: int, ffn: int, vocab: int, seq: int) -> list:
    per_layer = [(3 * h, h), (h, h), (ffn, h), (h, ffn), (h,), (h,), (h,), (h,)]
    return [(vocab, h), (seq, h), (h,), (h,)] + per_layer * layers


def one_config(params, block: int, warps: int, iters: int) -> float:
    """Mean ms per optimizer step with the kernel built for (block, warps)."""
    mta.BLOCK, mta._NUM_WARPS = block, warps
    opt = torch.optim.AdamW([{"params": params[: len(params) // 2], "weight_decay": 0.1},
                             {"params": params[len(params) // 2:], "weight_decay": 0.0}],
                            lr=1e-4)
    models = [[p.detach().to(torch.bfloat16) for p in g["params"]] for g in opt.param_groups]
    stepper = mta.MultiTensorAdamW(opt, models)
    scale = torch.tensor(1.5, device="cuda")
    return mean_ms(lambda: stepper.step(scale), iters)  # the state is freed on return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    params = []
    for shape in shapes(*PRESETS[a.preset]):
        p = torch.nn.Parameter(torch.randn(shape, device="cuda") * 0.02)
        p.grad = torch.randn(shape, device="cuda") * 1e-3
        params.append(p)
    n = sum(p.numel() for p in params)
    print(f"{a.preset}: {len(params)} tensors, {n / 1e6:.1f} M parameters")
    print(f"{'BLOCK':>6} {'warps':>5} {'ms':>8} {'TB/s':>6}")
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            ms = one_config(params, block, warps, a.iters)
            print(f"{block:>6} {warps:>5} {ms:>8.3f} {30 * n / ms / 1e9:>6.2f}")


if __name__ == "__main__":
    main()
