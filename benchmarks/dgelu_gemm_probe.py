#!/usr/bin/env python
"""Can one Triton product with the erf GeLU in its epilogue beat cuBLAS + the polynomial
GeLU kernel around the MLP's fc1 forward (--direction fwd) or fc2's input grad
(--direction bwd)? (CUDA)

    python benchmarks/dgelu_gemm_probe.py [--direction bwd|fwd|both] [--preset gpt-1.3b]
        [--seconds 1.5] [--rounds 2]

bwd: dh = (dy @ w2) * GeLU'(h): today torch's (or the tuned cuBLASLt) product writes
dy @ w2 (bf16), then the polynomial kernel reads it and h and writes dh. Fused, the
epilogue reads the tile of h and writes dh: one [tokens, ffn] write and one read fewer.
fwd: h = x @ w1.T, a = GeLU(h): fused, the epilogue writes h and a from the accumulator:
one [tokens, ffn] read fewer. The "ptr" kernels keep their epilogue out of shared memory
(pointer loads and stores), so that two programs fit on an SM and one's epilogue can run
while the other's main loop holds the tensor cores; each row prints the registers, the
shared memory and the programs per SM that allows. Each case runs back to back for
--seconds (the first third heats the chip to its power limit, the rest is timed with
CUDA events), cases alternating over --rounds, as inside a training step.
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
from megatron.core.tensor_parallel import gemm_algos  # noqa: E402
from tools.tune_gemms import sustained_ms  # noqa: E402

SHAPES = {"gpt-1.3b": (16384, 2048, 8192), "gpt2-124m": (16384, 768, 3072)}
SM_REGISTERS, SM_SHARED = 65536, 228 * 1024


@triton.jit
def _pdf_cdf(x):
    e = tl.exp(-0.5 * x * x)
    t = 1.0 / (1.0 + 0.3275911 * (tl.abs(x) * 0.7071067811865476))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * e
    return e * 0.3989422804014327, tl.where(x >= 0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _dgelu(acc, h):
    x = h.to(tl.float32)
    pdf, cdf = _pdf_cdf(x)
    return acc * (cdf + x * pdf)


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


@triton.jit
def _tiled_ptr(a_desc, b_desc, h_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GROUP_M: tl.constexpr, MODE: tl.constexpr,
               B_NK: tl.constexpr):
    """MODE 0: c = a @ b; 1 (bwd): c = (a @ b) * GeLU'(h); 2 (fwd): h = a @ b, c = GeLU(h).
    B_NK: b is stored [N, K] (a weight used transposed)."""
    pid_m, pid_n = _tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    om, on = pid_m * BM, pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BK)):
        a = a_desc.load([om, ki * BK])
        if B_NK:
            b = b_desc.load([on, ki * BK]).T
        else:
            b = b_desc.load([ki * BK, on])
        acc = tl.dot(a, b, acc)
    rows = (om + tl.arange(0, BM)).to(tl.int64)
    offs = rows[:, None] * N + (on + tl.arange(0, BN))[None, :]
    if MODE == 1:
        acc = _dgelu(acc, tl.load(h_ptr + offs))
    if MODE == 2:
        pre = acc.to(tl.bfloat16)
        tl.store(h_ptr + offs, pre)
        x = pre.to(tl.float32)
        acc = x * _pdf_cdf(x)[1]
    tl.store(c_ptr + offs, acc.to(tl.bfloat16))


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


def ptr_case(a, b, h, out, mode, b_nk, bm, bn, bk, stages, warps, maxnreg):
    """A launcher of _tiled_ptr and a function that compiles it and describes it."""
    M, K = a.shape
    N = out.shape[1]
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bn, bk] if b_nk else [bk, bn])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    extra = {"maxnreg": maxnreg} if maxnreg else {}

    def run():
        return _tiled_ptr[grid](ad, bd, h, out, M, N, K, bm, bn, bk, 8, mode, b_nk,
                                num_stages=stages, num_warps=warps, **extra)

    def describe():
        k = run()
        regs, shared = k.n_regs, k.metadata.shared
        per_sm = min(SM_REGISTERS // max(1, regs * warps * 32), SM_SHARED // (shared + 1024))
        return f"{regs} regs, {shared // 1024} KiB shared, {per_sm} per SM"
    return run, describe


PTR_CONFIGS = [  # (BM, BN, BK, stages, warps, maxnreg)
    (128, 256, 64, 3, 8, None),
    (128, 128, 64, 3, 4, None),
    (128, 128, 64, 2, 4, None),
    (128, 128, 64, 3, 8, 128),
    (128, 128, 32, 5, 4, None),
    (256, 128, 64, 3, 8, None),
]

BWD_CONFIGS = [  # the first probe's kernels: (BM, BN, BK, stages, warps, persistent, ws)
    (128, 256, 64, 3, 8, False, False),
    (128, 128, 64, 4, 8, True, False),
]


def activate_shipped_tables() -> bool:
    """Route gemm_algos' products through the shipped cuBLASLt tables of this GPU (the
    run's default, `--gemm-algorithms auto`); False when there are none here."""
    table, _ = gemm_algos.shipped_tables(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "megatron", "gemm_tables"),
        torch.cuda.get_device_name(), gemm_algos.cublaslt().version)
    gemm_algos.activate(table, torch.device("cuda"))
    return bool(table)


def add_ptr_cases(cases, want, out, a, b, h, mode, b_nk):
    for cfg in PTR_CONFIGS:
        name = "triton ptr {}x{}x{} s{} w{}{}".format(
            *cfg[:5], f" maxnreg {cfg[5]}" if cfg[5] else "")
        try:
            run, describe = ptr_case(a, b, h, out, mode, b_nk, *cfg)
            info = describe()
            torch.cuda.synchronize()
        except Exception as e:  # a config this Triton cannot build
            print(f"{name}: failed ({type(e).__name__}: {str(e)[:160]})", flush=True)
            continue
        errs = [((got.float() - ref).abs().max() / ref.abs().max()).item()
                for got, ref in want(out, h)]
        print(f"{name}: {info}; max error / max " + ", ".join(f"{e:.2e}" for e in errs),
              flush=True)
        cases[f"{name} [{info}]"] = run
        plain, _ = ptr_case(a, b, h if mode == 1 else out, out, 0, b_nk, *cfg)
        cases[f"{name}, no epilogue"] = plain


def bwd_cases(tokens, hidden, ffn, g):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, hidden, generator=g, **bf)
    w2 = torch.randn(hidden, ffn, generator=g, **bf) * 0.02
    h = torch.randn(tokens, ffn, generator=g, **bf)
    out = torch.empty(tokens, ffn, **bf)
    ref = fa.gelu_backward(torch.mm(dy, w2), h).float()
    cases = {"torch mm + polynomial kernel": lambda: fa.gelu_backward(torch.mm(dy, w2), h),
             "torch mm alone": lambda: torch.mm(dy, w2)}
    if activate_shipped_tables():
        cases["tuned cuBLASLt + polynomial kernel (today)"] = (
            lambda: fa.gelu_backward(gemm_algos.linear_dgrad(dy, w2), h))
        cases["tuned cuBLASLt alone"] = lambda: gemm_algos.linear_dgrad(dy, w2)
    for cfg in BWD_CONFIGS:
        name = "triton tma {}x{}x{} s{} w{}{}{}".format(
            *cfg[:5], " persistent" if cfg[5] else "", " ws" if cfg[6] else "")
        try:
            fn = triton_case(dy, w2, h, out, *cfg)
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # a config this Triton cannot build
            print(f"{name}: failed ({type(e).__name__}: {str(e)[:160]})", flush=True)
            continue
        cases[name] = fn
    add_ptr_cases(cases, lambda o, _h: [(o, ref)], out, dy, w2, h, 1, False)
    return cases


def fwd_cases(tokens, hidden, ffn, g):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g, **bf)
    w1 = torch.randn(ffn, hidden, generator=g, **bf) * 0.02
    h = torch.empty(tokens, ffn, **bf)
    out = torch.empty(tokens, ffn, **bf)
    pre = torch.mm(x, w1.t())
    refs = [pre.float(), fa.gelu_forward(pre).float()]
    cases = {"torch mm + polynomial kernel": lambda: fa.gelu_forward(torch.mm(x, w1.t())),
             "torch mm alone": lambda: torch.mm(x, w1.t())}
    if activate_shipped_tables():
        cases["tuned cuBLASLt + polynomial kernel (today)"] = (
            lambda: fa.gelu_forward(gemm_algos.linear_forward(x, w1)))
        cases["tuned cuBLASLt alone"] = lambda: gemm_algos.linear_forward(x, w1)
    add_ptr_cases(cases, lambda o, hh: [(hh, refs[0]), (o, refs[1])], out, x, w1, h, 2, True)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-1.3b", choices=sorted(SHAPES))
    ap.add_argument("--direction", default="both", choices=["bwd", "fwd", "both"])
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tokens, hidden, ffn = SHAPES[args.preset]
    g = torch.Generator(device="cuda").manual_seed(0)
    for direction in ["fwd", "bwd"] if args.direction == "both" else [args.direction]:
        build = fwd_cases if direction == "fwd" else bwd_cases
        cases = build(tokens, hidden, ffn, g)
        times = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, fn in cases.items():
                times[k].append(sustained_ms(fn, args.seconds, torch))
        flops = 2 * tokens * hidden * ffn
        what = ("fc1 forward + GeLU" if direction == "fwd" else "fc2 input grad + GeLU'")
        print(f"\n{args.preset} {what} ({tokens}x{ffn}, k={hidden}), {args.rounds} rounds "
              f"of {args.seconds}s each, at the power limit")
        print("| case | ms | TFLOP/s |\n|---|---|---|")
        for k, t in times.items():
            ms = sum(t) / len(t)
            print(f"| {k} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
