#!/usr/bin/env python
"""Time the real training step of pretrain_gpt.py for a model preset.

    python tools/benchmark.py --preset gpt2-124m --steps 30
    python tools/benchmark.py --preset tiny --device cpu --steps 5
    python tools/benchmark.py --preset gpt-1.3b -- --no-compile      # extra flags after --

The command line goes through the same parser, model, optimizer, mixed precision and
(mock) data path as pretrain_gpt.py. After warm-up steps (compilation happens there), the
timed steps run between synchronised timers. One JSON line per run: tokens/s, TFLOP/s and
MFU (FLOPs per token 72*l*h^2*(1 + s/6h + V/12lh), peak 989 TFLOP/s bf16 dense), peak
memory and time from launch to the end of the first optimizer step.
"""
from __future__ import annotations

import time

T_LAUNCH = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2",
          "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
          "--log-interval", "1000000", "--eval-iters", "0", "--seed", "1234"]

PRESETS = {
    # name: (flags, default micro batch)
    "gpt2-124m": (["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                   "--seq-length", "1024", "--max-position-embeddings", "1024",
                   "--vocab-size", "50303", "--disable-bias-linear", "--bf16"], 16),
    "gpt-1.3b": (["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                  "--seq-length", "2048", "--max-position-embeddings", "2048",
                  "--vocab-size", "50303", "--disable-bias-linear", "--bf16"], 8),
    "llama-1b": (["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
                  "--group-query-attention", "--num-query-groups", "8",
                  "--ffn-hidden-size", "8192", "--swiglu", "--normalization", "RMSNorm",
                  "--use-rotary-position-embeddings", "--no-position-embedding",
                  "--untie-embeddings-and-output-weights",
                  "--seq-length", "2048", "--max-position-embeddings", "2048",
                  "--vocab-size", "31999", "--disable-bias-linear", "--bf16"], 8),
    "tiny": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "511"], 4),
}


def build_argv(preset: str, steps: int, warmup: int, micro_batch: int, extra: list) -> list:
    flags, _ = PRESETS[preset]
    total = steps + warmup
    return flags + COMMON + ["--micro-batch-size", str(micro_batch), "--global-batch-size",
                             str(micro_batch), "--train-iters", str(total)] + extra


def print_profile(tr, data, steps: int, use_cuda: bool) -> None:
    """Profile a few more steps and print the most expensive operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron.training import train_step

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            train_step(tr, data)
        if use_cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if use_cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70),
          file=sys.stderr)


def run(preset: str, steps: int, warmup: int, micro_batch: int, extra: list, device: str,
        profile_steps: int = 0) -> dict:
    import torch

    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed, set_random_seed
    from megatron.logging_utils import flops_per_token
    from megatron.memory_estimate import estimate_memory
    from megatron.training import build_trainer, data_iterator, train_step

    use_cuda = device == "cuda"
    config = parse_and_validate(build_argv(preset, steps, warmup, micro_batch, extra),
                                world_size=1, env={}, cuda_available=use_cuda)
    rt = initialize_distributed(config.parallel, 0, 1, 0)
    set_random_seed(config.training.seed, rt)
    tr = build_trainer(config, rt)
    data = data_iterator(config, rt, "train", 0)
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    t_first = None
    for i in range(warmup):
        loss, *_ = train_step(tr, data)
        if i == 0:
            sync()
            t_first = time.time() - T_LAUNCH
    if use_cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, *_ = train_step(tr, data)
    sync()
    elapsed = time.perf_counter() - t0
    if profile_steps:
        print_profile(tr, data, profile_steps, use_cuda)
    m, d = config.model, config.data
    tokens_per_s = d.global_batch_size * d.seq_length * steps / elapsed
    fpt = flops_per_token(m.num_layers, m.hidden_size, d.seq_length, m.padded_vocab_size)
    return {
        "preset": preset, "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "micro_batch": micro_batch, "seq_length": d.seq_length, "steps": steps,
        "step_ms": round(elapsed / steps * 1000, 2), "tokens_per_s": round(tokens_per_s),
        "tflops": round(tokens_per_s * fpt / 1e12, 1), "mfu": round(tokens_per_s * fpt / 989e12, 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if use_cuda else None,
        "time_to_first_step_s": round(t_first, 1), "loss": round(float(loss), 4),
        "est_mem_gb": round(estimate_memory(config)["allocated"] / 2**30, 2),
        "compile": m.compile_layers, "extra": " ".join(extra),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-124m")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--micro-batch-size", type=int, default=None)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many steps and print the top operators")
    ap.add_argument("extra", nargs="*", help="extra pretrain_gpt.py flags (after --)")
    a = ap.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available")
    mbs = a.micro_batch_size or PRESETS[a.preset][1]
    print(json.dumps(run(a.preset, a.steps, a.warmup, mbs, a.extra, device, a.profile_steps)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
