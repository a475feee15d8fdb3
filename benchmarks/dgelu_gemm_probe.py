#!/usr/bin/env python
"""Can one Triton product with the erf GeLU's derivative in its epilogue beat cuBLAS + the
polynomial GeLU-backward kernel for fc2's input grad? (CUDA)

    python benchmarks/dgelu_gemm_probe.py [--preset gpt-1.3b|gpt2-124m] [--seconds 2]

dh = (dy @ w2) * GeLU'(h): today torch's product writes dy @ w2 (bf16), then the
polynomial kernel reads it and h and writes dh. Fused, the product's epilogue reads the
tile of h and writes dh: one [tokens, ffn] write and one read fewer. Each case runs back
to back for --seconds (the first third heats the chip to its power limit, the rest is
timed with CUDA events), cases alternating over --rounds, as inside a training step.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core import fused_activation as fa  # noqa: E402
from tools.tune_gemms import sustained_ms  # noqa: E402

SHAPES = {"gpt-1.3b": (16384, 2048, 8192), "gpt2-124m": (16384, 768, 3072)}


@triton.jit
def _dgelu(acc, h):
    x = h.to(tl.float32)
    e = tl.exp(-0.5 * x * x)
    t = 1.0 / (1.0 + 0.3275911 * (tl.abs(x) * 0.7071067811865476))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * e
    cdf = tl.where(x >= 0, 1.0 - half_erfc, half_erfc)
    return acc * (cdf + x * (e * 0.3989422804014327))


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group) % size_m
    pid_n = (tile_id % group) // size_m
    return pid_m, pid_n


@triton.jit
def _persistent(a_desc, b_desc, h_desc, c_desc, M, N, K, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                NUM_SMS: tl.constexpr, FUSE: tl.constexpr, WS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True,
                            warp_specialize=WS):
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om, on = pid_m * BM, pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([ki * BK, on])
            acc = tl.dot(a, b, acc)
        if FUSE:
            acc = _dgelu(acc, h_desc.load([om, on]))
        c_desc.store([om, on], acc.to(tl.bfloat16))


@triton.jit
def _tiled(a_desc, b_desc, h_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, GROUP_M: tl.constexpr, FUSE: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    om, on = pid_m * BM, pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BK)):
        acc = tl.dot(a_desc.load([om, ki * BK]), b_desc.load([ki * BK, on]), acc)
    if FUSE:
        acc = _dgelu(acc, h_desc.load([om, on]))
    c_desc.store([om, on], acc.to(tl.bfloat16))


def triton_case(dy, w2, h, out, bm, bn, bk, stages, warps, persistent, ws, fuse=True):
    M, K = dy.shape
    N = w2.shape[1]
    a = TensorDescriptor.from_tensor(dy, [bm, bk])
    b = TensorDescriptor.from_tensor(w2, [bk, bn])
    hd = TensorDescriptor.from_tensor(h, [bm, bn])
    c = TensorDescriptor.from_tensor(out, [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if persistent:
        sms = torch.cuda.get_device_properties(dy.device).multi_processor_count
        grid = (min(sms, tiles),)
        return lambda: _persistent[grid](a, b, hd, c, M, N, K, bm, bn, bk, 8, sms, fuse, ws,
                                         num_stages=stages, num_warps=warps)
    return lambda: _tiled[(tiles,)](a, b, hd, c, M, N, K, bm, bn, bk, 8, fuse,
                                    num_stages=stages, num_warps=warps)


CONFIGS = [  # (BM, BN, BK, stages, warps, persistent, warp-specialized)
    (128, 256, 64, 3, 8, True, False),
    (128, 256, 64, 4, 8, True, False),
    (128, 128, 64, 4, 8, True, False),
    (128, 256, 64, 3, 8, True, True),
    (128, 128, 64, 4, 4, True, True),
    (128, 256, 64, 3, 8, False, False),
    (128, 128, 64, 4, 4, False, False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-1.3b", choices=sorted(SHAPES))
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tokens, hidden, ffn = SHAPES[args.preset]
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, hidden, generator=g, **bf)
    w2 = torch.randn(hidden, ffn, generator=g, **bf) * 0.02
    h = torch.randn(tokens, ffn, generator=g, **bf)
    out = torch.empty(tokens, ffn, **bf)
    want = fa.gelu_backward(torch.mm(dy, w2), h).float()
    cases = {"torch mm + polynomial kernel (today)": lambda: fa.gelu_backward(torch.mm(dy, w2), h),
             "torch mm alone": lambda: torch.mm(dy, w2)}
    for cfg in CONFIGS:
        name = "triton {}x{}x{} s{} w{}{}{}".format(*cfg[:5], " persistent" if cfg[5] else "",
                                                     " ws" if cfg[6] else "")
        try:
            fn = triton_case(dy, w2, h, out, *cfg)
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # a config this Triton cannot build
            print(f"{name}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
            continue
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        print(f"{name}: max error / max {err:.2e}", flush=True)
        cases[name] = fn
        plain = triton_case(dy, w2, h, out, *cfg, fuse=False)
        cases[name + " (no epilogue)"] = plain
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, fn in cases.items():
            times[k].append(sustained_ms(fn, args.seconds, torch))
    flops = 2 * tokens * hidden * ffn
    print(f"\n{args.preset} fc2 input grad + GeLU' ({tokens}x{ffn}, k={hidden}), "
          f"{args.rounds} rounds of {args.seconds}s each, at the power limit")
    print("| case | ms | TFLOP/s |\n|---|---|---|")
    for k, t in times.items():
        ms = sum(t) / len(t)
        print(f"| {k} | {ms:.3f} | {flops / ms / 1e9:.0f} |")


if __name__ == "__main__":
    main()
