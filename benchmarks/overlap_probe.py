#!/usr/bin/env python
"""Does the optimizer step hide under the next forward pass on an H200 (CUDA)?

    python benchmarks/overlap_probe.py [--seconds 4] [--layers 24] [--kernel triton]

With one micro-batch per step the AdamW pass over gpt-1.3b's parameters (about 10 ms,
memory bound) runs between the backward and the next forward, which are compute bound and
hold the board at its power limit. Forward layer k only needs layer k's parameters, so the
optimizer could update layer after layer on a second stream while the forward runs. This
probe times one "iteration" = AdamW over every layer's fp32 state + a gpt-1.3b-shaped
forward (layer norm, qkv product, causal SDPA, projection, layer norm, fc1, GeLU, fc2),
three ways, alternating under sustained load:

  serial   AdamW over everything, then the forward (today's order)
  overlap  AdamW per layer on a side stream, an event after each; forward layer k waits
           for event k
  forward  the forward alone (the floor)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T, H, FF, HEADS, SEQ = 16384, 2048, 8192, 16, 2048


class Layer:
    def __init__(self, device, kernel="torch"):
        shapes = [(3 * H, H), (H, H), (FF, H), (H, FF), (H,), (H,), (H,), (H,)]
        self.main = [torch.randn(s, device=device) * 0.02 for s in shapes]
        self.grads = [torch.randn_like(p) * 1e-3 for p in self.main]
        self.m = [torch.zeros_like(p) for p in self.main]
        self.v = [torch.zeros_like(p) for p in self.main]
        self.steps = [torch.zeros((), device=device) for _ in self.main]
        self.model = [p.to(torch.bfloat16) for p in self.main]
        self.multi = None
        if kernel == "triton":  # the project's one-pass kernel (writes the bf16 copy too)
            from megatron.core.optimizer.multi_tensor_adam import MultiTensorAdamW

            params = [torch.nn.Parameter(p) for p in self.main]
            for p, g in zip(params, self.grads):
                p.grad = g
            opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
            self.multi = MultiTensorAdamW(opt, [self.model])

    def adam(self):
        if self.multi is not None:
            self.multi.step()
            return
        torch._fused_adamw_(self.main, self.grads, self.m, self.v, [], self.steps, lr=1e-4,
                            beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
                            amsgrad=False, maximize=False)
        torch._foreach_copy_(self.model, self.main)

    def forward(self, x):
        wqkv, wo, w1, w2, g1, b1, g2, b2 = self.model
        h = F.layer_norm(x, (H,), g1, b1)
        q, k, v = (h @ wqkv.t()).view(-1, SEQ, 3, HEADS, H // HEADS).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + a.transpose(1, 2).reshape(T, H) @ wo.t()
        h = F.layer_norm(x, (H,), g2, b2)
        return x + F.gelu(h @ w1.t()) @ w2.t()


def run(mode, layers, x, side, events):
    if mode == "serial":
        for layer in layers:
            layer.adam()
    elif mode == "overlap":
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for layer, ev in zip(layers, events):
                layer.adam()
                ev.record(side)
    for i, layer in enumerate(layers):
        if mode == "overlap":
            torch.cuda.current_stream().wait_event(events[i])
        x = layer.forward(x)
    if mode == "overlap":
        torch.cuda.current_stream().wait_stream(side)
    return x


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", choices=["torch", "triton"], default="torch",
                    help="AdamW: torch's fused kernel + a copy, or the project's Triton one")
    args = ap.parse_args()
    dev = torch.device("cuda")
    layers = [Layer(dev, args.kernel) for _ in range(args.layers)]
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in layers]
    modes = ["serial", "overlap", "forward"]
    results = {m: [] for m in modes}
    for m in modes:
        run(m, layers, x, side, events)
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        for m in modes:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.seconds / 3:  # heat the chip
                run(m, layers, x, side, events)
                torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 0
            start.record()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.seconds * 2 / 3:
                run(m, layers, x, side, events)
                n += 1
            stop.record()
            stop.synchronize()
            results[m].append(start.elapsed_time(stop) / n)
    torch.cuda.synchronize()
    print("| mode | ms per iteration (rounds) | mean |")
    print("|---|---|---|")
    for m in modes:
        r = results[m]
        print(f"| {m} | {' '.join(f'{v:.2f}' for v in r)} | {sum(r) / len(r):.2f} |")
    s, o, f = (sum(results[m]) / len(results[m]) for m in modes)
    print(f"\noptimizer alone (serial - forward): {s - f:.2f} ms; hidden by overlap: "
          f"{s - o:.2f} ms ({100 * (s - o) / max(s - f, 1e-9):.0f}%)")


if __name__ == "__main__":
    main()
