#!/usr/bin/env python
"""Every algorithm cuBLASLt's heuristic offers for gpt-1.3b's big products, timed at the
H200's power limit (CUDA).

    python benchmarks/cublaslt_algo_probe.py [--seconds 1.2] [--algos 8] [--rounds 1] [--only fc1]

torch asks cuBLAS(Lt) for one algorithm per product shape, and TunableOp on this torch
offers no other candidate. Inside a training step the board sits at its 700 W limit, so
what decides the speed is work per joule, which the heuristic does not rank by. This
probe calls cuBLASLt through ctypes (the library torch already loaded), asks for up to
`--algos` candidates per shape, checks each one's result against torch's, and times each
back to back for `--seconds` (the first third heats the chip) with CUDA events; `--rounds`
passes alternate over the candidates so that the chip's drift spreads over all of them.
Shapes: every product of a gpt-1.3b step (16384 tokens, hidden 2048, ffn 8192, vocabulary
50304): forward, input grad (dgrad) and weight grad into an fp32 buffer (wgrad, beta 1, as
the layers accumulate); the last line sums, over the step, what the fastest candidate
would save against the heuristic's first choice (what torch gets).
"""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

T, H, FF, VOCAB = 16384, 2048, 8192, 50304
CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE = 3, 4, 1
ALGO_ID, ALGO_TILE, ALGO_SPLITK, ALGO_STAGES, ALGO_CLUSTER = 0, 1, 2, 6, 8
WORKSPACE = 64 << 20


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    """The libcublasLt torch uses (found in this process's mapped files)."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt" in line}
    if not paths:
        raise SystemExit("libcublasLt is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


class Lt:
    def __init__(self):
        self.lib = _library()
        vp, i32, sz, u64, i64 = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                 ctypes.c_uint64, ctypes.c_int64)
        for fn, types in {
            "cublasLtCreate": [vp],
            "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, i64],
            "cublasLtMatmulDescCreate": [vp, i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulPreferenceCreate": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, vp],
            "cublasLtMatmulAlgoConfigGetAttribute": [vp, i32, vp, sz, vp],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }.items():
            getattr(self.lib, fn).argtypes = types
            getattr(self.lib, fn).restype = ctypes.c_int
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    @staticmethod
    def _ok(status, what):
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what} returned status {status}")

    def layout(self, dtype, rows, cols, ld):
        lay = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(lay), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
            ctypes.c_int64(ld)), "layout")
        return lay

    def problem(self, trans_a, trans_b, a_lay, b_lay, c_lay):
        """(descriptor, layouts) of D = op(A) op(B) (+ beta C), column-major, fp32 compute."""
        desc = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F,
                                                   CUDA_R_32F), "desc")
        for attr, value in ((DESC_TRANSA, trans_a), (DESC_TRANSB, trans_b)):
            v = ctypes.c_int32(value)
            self._ok(self.lib.cublasLtMatmulDescSetAttribute(
                desc, attr, ctypes.byref(v), ctypes.sizeof(v)), "desc attribute")
        return desc, (self.layout(*a_lay), self.layout(*b_lay), self.layout(*c_lay))

    def heuristics(self, desc, lays, count):
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE)
        self._ok(self.lib.cublasLtMatmulPreferenceSetAttribute(
            pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), ctypes.sizeof(ws)), "preference attr")
        results = (HeuristicResult * count)()
        got = ctypes.c_int(0)
        a, b, c = lays
        self._ok(self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, c, c, pref, count, results, ctypes.byref(got)), "heuristic")
        return [r for r in results[:got.value] if r.state == 0]

    def describe(self, result) -> str:
        algo = ctypes.byref(result.algo)
        parts = []
        for name, attr in (("id", ALGO_ID), ("tile", ALGO_TILE), ("splitk", ALGO_SPLITK),
                           ("stages", ALGO_STAGES), ("cluster", ALGO_CLUSTER)):
            v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                algo, attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written))
            parts.append(f"{name} {v.value if status == 0 else '?'}")
        return ", ".join(parts) + f", waves {result.waves:.2f}"

    def matmul(self, desc, lays, result, a, b, c, beta):
        alpha, beta_ = ctypes.c_float(1.0), ctypes.c_float(beta)
        la, lb, lc = lays
        self._ok(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(a.data_ptr()), la,
            ctypes.c_void_p(b.data_ptr()), lb, ctypes.byref(beta_),
            ctypes.c_void_p(c.data_ptr()), lc, ctypes.c_void_p(c.data_ptr()), lc,
            ctypes.byref(result.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
            "matmul")


# (name, kind, M, N, K, per step): row-major out[M, N]; forward x[M, K] @ W[N, K].T,
# dgrad dy[M, K] @ W[K, N], wgrad dy[T, M].T @ x[T, N] into fp32 (beta 1). Per step: how
# often gpt-1.3b (24 layers, one micro-batch of 16384 tokens) runs the shape.
SHAPES = [
    ("qkv forward", "forward", T, 3 * H, H, 24), ("proj forward", "forward", T, H, H, 24),
    ("fc1 forward", "forward", T, FF, H, 24), ("fc2 forward", "forward", T, H, FF, 24),
    ("qkv dgrad", "dgrad", T, H, 3 * H, 24), ("proj dgrad", "dgrad", T, H, H, 24),
    ("fc1 dgrad", "dgrad", T, H, FF, 24), ("fc2 dgrad", "dgrad", T, FF, H, 24),
    ("qkv wgrad", "wgrad", 3 * H, H, T, 24), ("proj wgrad", "wgrad", H, H, T, 24),
    ("fc1 wgrad", "wgrad", FF, H, T, 24), ("fc2 wgrad", "wgrad", H, FF, T, 24),
    ("output layer forward", "forward", T, VOCAB, H, 1),
    ("output layer dgrad", "dgrad", T, H, VOCAB, 1),
    ("output layer wgrad", "wgrad", VOCAB, H, T, 1),
]


def case(lt: Lt, kind: str, m: int, n: int, k: int):
    """(problem, (A, B, C, beta), reference fn, C) for cuBLASLt's column-major view:
    row-major out[M, N] = P[M, K] @ Q[K, N] is out^T = Q^T P^T, so A is Q's, B is P's."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    bf, f32 = CUDA_R_16BF, CUDA_R_32F
    if kind == "forward":
        x, w = rand(m, k), rand(n, k, scale=0.02)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        prob = lt.problem(1, 0, (bf, k, n, k), (bf, k, m, k), (bf, n, m, n))
        return prob, (w, x, c, 0.0), (lambda: x @ w.t()), c
    if kind == "dgrad":
        dy, w = rand(m, k), rand(k, n, scale=0.02)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        prob = lt.problem(0, 0, (bf, n, k, n), (bf, k, m, k), (bf, n, m, n))
        return prob, (w, dy, c, 0.0), (lambda: dy @ w), c
    dy, x = rand(k, m), rand(k, n)  # k is the token count here
    c = torch.zeros(m, n, device="cuda", dtype=torch.float32)
    prob = lt.problem(0, 1, (bf, n, k, n), (bf, m, k, m), (f32, n, m, n))
    return prob, (x, dy, c, 1.0), (lambda: torch.mm(dy.t(), x, out_dtype=torch.float32)), c


def sustained(fn, seconds):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 3:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    start.record()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds * 2 / 3:
        for _ in range(10):
            fn()
        calls += 10
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.2)
    ap.add_argument("--algos", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default="", help="shapes whose name contains this text")
    args = ap.parse_args()
    lt = Lt()
    print("| shape | candidates | heuristic's first: ms, TFLOP/s | best: #, tile, ms, TFLOP/s "
          "| gain per step (ms) | all (ms, # order; x: wrong result) |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for name, kind, m, n, k, per_step in SHAPES:
        if args.only not in name:
            continue
        (desc, lays), (a, b, c, beta), reference, _ = case(lt, kind, m, n, k)
        found = lt.heuristics(desc, lays, args.algos)
        good = []
        for r in found:
            c.zero_()
            lt.matmul(desc, lays, r, a, b, c, beta)
            want = reference().float()
            err = ((c.float() - want).abs().max() / want.abs().max()).item()
            good.append(err < 1e-2)
        times = [[] for _ in found]
        for _ in range(args.rounds):
            for i, r in enumerate(found):
                if good[i]:
                    times[i].append(sustained(
                        lambda r=r: lt.matmul(desc, lays, r, a, b, c, beta), args.seconds))
        ms = [sum(t) / len(t) if t else float("inf") for t in times]
        flops = 2 * m * n * k
        best = min(range(len(found)), key=lambda i: ms[i])
        gain = (ms[0] - ms[best]) * per_step
        total += gain
        tile = lt.describe(found[best]).split(", ")[1]
        cells = " ".join(f"{v:.3f}" if good[i] else "x" for i, v in enumerate(ms))
        print(f"| {name} | {len(found)} | {ms[0]:.3f}, {flops / ms[0] / 1e9:.0f} | #{best}, "
              f"{tile}, {ms[best]:.3f}, {flops / ms[best] / 1e9:.0f} | {gain:.2f} | {cells} |",
              flush=True)
    print(f"\nsum of gains per gpt-1.3b step (one micro-batch): {total:.2f} ms")


if __name__ == "__main__":
    main()
