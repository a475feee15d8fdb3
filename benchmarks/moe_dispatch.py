#!/usr/bin/env python
"""Time one switch MLP's forward + backward with the loop dispatch and the grouped
dispatch (megatron/core/models/gpt/grouped_experts.py), on the CPU or one GPU.

    python benchmarks/moe_dispatch.py [--device cuda] [--dtype bf16] [--tokens 8192]
        [--hidden 768] [--ffn 3072] [--experts 8] [--iters 20]

Both modules hold the same weights; the router's weights are scaled up so that the
tokens spread over every expert. Prints ms per forward + backward for each dispatch,
their ratio, and the largest output difference between them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core.config import ModelConfig  # noqa: E402
from megatron.core.models.gpt.transformer import SwitchMLP  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(args, dispatch: str) -> SwitchMLP:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=12, hidden_size=args.hidden, num_attention_heads=12,
                      padded_vocab_size=128, seq_length=1024, max_position_embeddings=1024,
                      ffn_hidden_size=args.ffn, num_experts=args.experts,
                      params_dtype=DTYPES[args.dtype], use_cpu_initialization=True)
    mlp = SwitchMLP(cfg, device="cpu").to(args.device)
    with torch.no_grad():
        mlp.router.weight.mul_(20)
    mlp.dispatch = dispatch
    return mlp


def time_ms(mlp: SwitchMLP, x: torch.Tensor, iters: int) -> float:
    def step():
        out, bias = mlp(x)
        (out + bias).float().square().mean().backward()

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    x = torch.randn(args.tokens, 1, args.hidden, generator=torch.Generator().manual_seed(1))
    x = x.to(args.device, DTYPES[args.dtype]).requires_grad_()
    loop, grouped = build(args, "loop"), build(args, "auto")
    print(f"{args.device} {args.dtype} tokens={args.tokens} h={args.hidden} "
          f"ffn={args.ffn} experts={args.experts}; grouped dispatch available: "
          f"{grouped.grouped_dispatch()}, host-free: {grouped.sync_free()}")
    with torch.no_grad():
        diff = (loop(x)[0] - grouped(x)[0]).abs().max().item()
    ms = {name: time_ms(m, x, args.iters) for name, m in (("loop", loop), ("grouped", grouped))}
    for name, value in ms.items():
        print(f"  {name:8s} {value:9.3f} ms per forward + backward")
    print(f"  speed-up {ms['loop'] / ms['grouped']:.2f}x; max |output difference| {diff:.3g}")


if __name__ == "__main__":
    main()
