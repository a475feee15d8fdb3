"""Tokens per second of tools/generate.py's `generate` on a small random GPT: full
recompute (--no-kv-cache), the key/value cache's eager dynamic step ("cache eager"), its
static one-token step run eagerly ("static eager", megatron/core/models/gpt/
static_decode.py) and, on CUDA, that step replayed from a CUDA graph ("cache graphed";
skipped elsewhere; the one capture is timed on its own). Greedy, one sequence, a prompt of
--prompt tokens and --new generated tokens, fp32 unless --dtype says otherwise; --experts E
makes every MLP a switch MLP of E experts. Prints one
line per path and whether it gave the tokens of the recompute and cache-eager paths. A
report, not a test.

2 shared CPU cores, --threads 1, the defaults: recompute 11.7 tokens/s, cache eager 87.1,
static eager 88.6 (7.4x), the same tokens (graphed: skipped). Earlier: with --vocab 1024,
206.9 vs 33.2 (6.2x). H200 figures: benchmarks/RESULTS.md.

    python benchmarks/kv_cache_speed.py [--layers 6 --hidden 256 --heads 8 --vocab 50304
                                         --prompt 64 --new 128 --device cpu --threads N]
    python benchmarks/kv_cache_speed.py --device cuda --dtype bf16 --layers 24 \
        --hidden 2048 --heads 16 --prompt 128 --new 256      # gpt-1.3b's shape
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core.config import ModelConfig  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.models.gpt.static_decode import StaticDecoder  # noqa: E402
from tools.generate import generate  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--layers", 6), ("--hidden", 256), ("--heads", 8),
                          ("--vocab", 50304), ("--prompt", 64), ("--new", 128),
                          ("--threads", 0), ("--experts", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    return ap.parse_args(argv)


def _timed(fn, device: str):
    """(result, seconds) of fn(), the device synchronised at both ends."""
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    a = _args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    max_len = a.prompt + a.new
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                      padded_vocab_size=a.vocab, seq_length=max_len,
                      max_position_embeddings=max_len, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=_DTYPES[a.dtype],
                      num_experts=a.experts or None)
    model = GPTModel(cfg, device=a.device).to(a.device).eval()  # norms are built on the host
    prompt = torch.randint(0, a.vocab, (a.prompt,)).tolist()
    experts = f", {a.experts} experts (top-1)" if a.experts else ""
    print(f"{a.layers} layers, hidden {a.hidden}{experts}, vocab {a.vocab}, {a.dtype} on {a.device} "
          f"({torch.get_num_threads()} threads): {a.new} tokens after a {a.prompt}-token prompt")
    generate(model, prompt, 4, greedy=True)  # warm-up
    paths = {"recompute": dict(use_cache=False), "cache eager": {},
             "static eager": dict(decoder=StaticDecoder(model, graphed=False))}
    decoder = StaticDecoder.for_mode(model, "auto")
    if decoder is not None:  # the capture (warm-up steps included) is timed on its own
        _, seconds = _timed(lambda: decoder.new_cache(1, a.prompt + a.new - 1), a.device)
        print(f"  CUDA graph capture of the one-token step: {seconds:.2f} s (once per shape)")
        paths["cache graphed"] = dict(decoder=decoder)
    print(f"  {'path':<14} {'seconds':>8} {'tokens/s':>9} {'ms/token':>9}  "
          "same tokens as recompute / cache eager")
    tokens = {}
    for name, kw in paths.items():
        tokens[name], seconds = _timed(lambda: generate(model, prompt, a.new, greedy=True, **kw),
                                       a.device)
        same = [str(tokens[name] == tokens[ref]) for ref in ("recompute", "cache eager")
                if ref in tokens and ref != name]
        print(f"  {name:<14} {seconds:8.2f} {a.new / seconds:9.1f} "
              f"{1000 * seconds / a.new:9.2f}  {' / '.join(same) or '-'}")
    if decoder is None:
        print("  cache graphed: skipped (the one-token step is captured on CUDA only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
