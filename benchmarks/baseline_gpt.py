#!/usr/bin/env python
"""A plain single-file GPT trainer, the kind issue 7's targets were set against, to time
on the same machine as tools/benchmark.py (CUDA; `--device cpu --preset tiny` runs it
small on the CPU).

    python benchmarks/baseline_gpt.py --preset gpt-1.3b [--steps 12] [--warmup 3]

What it is: fp32 weights under bf16 autocast, the whole model under torch.compile,
torch's scaled_dot_product_attention (causal), the erf GeLU (`--gelu tanh`: GPT-2's tanh
form), no biases, tied input and output embeddings, torch's fused AdamW (learning rate
6e-4 after a linear warm-up over --lr-warmup steps), gradient clipping at 1.0, one micro-batch per step (or
--micro-batches N, gradient accumulation), the same fixed batch of random tokens. It
prints one JSON line with the fields tools/benchmark.py uses for the same quantities
(tokens/s, TFLOP/s, MFU with the same FLOP count and peak, step ms, peak GB, time to the
first step), so the two can be put side by side; the step time is taken with CUDA events after the warm-up steps.
`--profile-steps N` then profiles N more steps and prints, to stderr, the kernel time per
step by category, the kernels per step and the GPU's idle time between them, in the form
`tools/benchmark.py --profile-steps` uses, so the two steps can be compared piece by piece.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# layers, hidden, heads, sequence, micro batch, vocabulary
PRESETS = {"gpt2-124m": (12, 768, 12, 1024, 16, 50304),
           "gpt-1.3b": (24, 2048, 16, 2048, 8, 50304),
           "tiny": (2, 64, 4, 32, 2, 128)}
PEAK_TFLOPS = 989.0  # H200 bf16 dense


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, gelu: str = "erf"):
        super().__init__()
        self.heads = heads
        self.approximate = "tanh" if gelu == "tanh" else "none"
        self.norm1 = nn.LayerNorm(hidden, bias=False)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(h, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate=self.approximate))


class Model(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                 gelu: str = "erf"):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, gelu) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # residual outputs scaled down with depth, the rest 0.02
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(pos)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.norm(x), self.tokens.weight)  # tied output layer
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    return 72 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def print_profile(step, steps: int, cuda: bool) -> None:
    """Profile `steps` calls of `step`; print the top kernels and the per-category table
    of tools/benchmark.py to stderr."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.benchmark import kernel_summary, kernel_timeline

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000 / steps
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=90),
          file=sys.stderr)
    if not cuda:
        return
    rows = kernel_summary(prof.events(), steps)
    tl = kernel_timeline(prof.events(), steps)
    print(f"GPU kernel time per step {sum(ms for _, ms, _ in rows):.2f} ms of {wall_ms:.2f} ms "
          f"wall (profiled)\n  {tl['kernels']:.0f} kernels per step; no kernel running for "
          f"{tl['idle_ms']:.2f} ms per step between them ({tl['gaps_over_5us']:.0f} gaps over "
          "5 us)", file=sys.stderr)
    for cat, ms, share in rows:
        print(f"  {cat:<20}{ms:>9.2f} ms {share:>7.1%}", file=sys.stderr)


def run(preset: str, steps: int, warmup: int, device: str, compile_model: bool,
        lr_warmup: int = 100, micro_batches: int = 1, profile_steps: int = 0,
        gelu: str = "erf") -> dict:
    t_launch = time.perf_counter()
    layers, hidden, heads, seq, mb, vocab = PRESETS[preset]
    torch.manual_seed(0)
    model = Model(layers, hidden, heads, seq, vocab, gelu).to(device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=device == "cuda")
    step_fn = torch.compile(model) if compile_model else model
    ids = torch.randint(0, vocab, (mb, seq + 1), device=device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    cuda = device == "cuda"

    done = [0]

    def step() -> torch.Tensor:
        done[0] += 1
        for group in opt.param_groups:
            group["lr"] = 6e-4 * min(1.0, done[0] / lr_warmup)
        for _ in range(micro_batches):  # gradient accumulation, the loss averaged
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = step_fn(x, y) / micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = None
    for i in range(warmup):
        loss = step()
        if i == 0:
            loss.item()
            first = time.perf_counter() - t_launch
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        stop.record()
        stop.synchronize()
        step_ms = start.elapsed_time(stop) / steps
    else:
        step_ms = (time.perf_counter() - t0) * 1000 / steps
    peak_gb = round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None
    if profile_steps:
        print_profile(step, profile_steps, cuda)
    tokens_per_s = micro_batches * mb * seq / (step_ms / 1000)
    tflops = tokens_per_s * flops_per_token(layers, hidden, seq, vocab) / 1e12
    return {"preset": preset, "trainer": "baseline", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "micro_batch": mb, "micro_batches": micro_batches, "seq_length": seq, "steps": steps, "step_ms": round(step_ms, 2),
            "tokens_per_s": round(tokens_per_s), "tflops": round(tflops, 1),
            "mfu": round(tflops / PEAK_TFLOPS, 4),
            "peak_mem_gb": peak_gb,
            "time_to_first_step_s": round(first, 1) if first is not None else None,
            "loss": round(loss.item() * micro_batches, 4), "compile": compile_model, "gelu": gelu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-1.3b", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--lr-warmup", type=int, default=100)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches per optimizer step (gradient accumulation)")
    ap.add_argument("--gelu", default="erf", choices=["erf", "tanh"],
                    help="the MLP's GeLU: erf (torch's default) or tanh (GPT-2's form, what "
                         "pretrain_gpt.py --openai-gelu computes)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many steps and print the kernel time "
                         "per step by category (stderr)")
    a = ap.parse_args()
    if a.warmup < 1:
        ap.error(f"--warmup {a.warmup}: at least 1 (the first step compiles)")
    if a.steps < 1:
        ap.error(f"--steps {a.steps}: at least 1 timed step")
    if a.micro_batches < 1:
        ap.error(f"--micro-batches {a.micro_batches}: at least 1")
    if a.profile_steps < 0:
        ap.error(f"--profile-steps {a.profile_steps}: 0 (no profile) or more")
    if a.lr_warmup < 1:
        ap.error(f"--lr-warmup {a.lr_warmup}: at least 1 step")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --device cpu --preset tiny")
    print(json.dumps(run(a.preset, a.steps, a.warmup, a.device, not a.no_compile,
                         a.lr_warmup, a.micro_batches, a.profile_steps, a.gelu)), flush=True)


if __name__ == "__main__":
    main()
