#!/usr/bin/env python
"""Does the MLP's GeLU pay as a cuBLASLt epilogue? (CUDA)

    python benchmarks/epilogue_probe.py [--preset gpt-1.3b|gpt2-124m|all] [--iters 60]

For the MLP shapes of a preset (16384 tokens) it times, with CUDA events after warm-up,
back to back (a chip at its power limit, as inside a step):
  forward:  fc1 product + the polynomial GeLU kernel (today's path) against one cuBLASLt
            product with the GELU_AUX epilogue (writes gelu(h) and h);
  backward: fc2's input-grad product + the GeLU backward kernel against one product with
            the DGELU epilogue (reads h, writes the gradient of h);
for each of the heuristic's first candidates, and checks the epilogue's results against
torch's tanh-form GeLU (cuBLASLt's GELU is the tanh form).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402
from megatron.core import fused_activation as fa  # noqa: E402
from megatron.core.tensor_parallel import gemm_algos as ga  # noqa: E402

SHAPES = {"gpt-1.3b": (16384, 2048, 8192), "gpt2-124m": (16384, 768, 3072)}


def mlp_operands(tokens: int, hidden: int, ffn: int):
    """(x, fc1 weight, fc2 weight, output grad, h = x @ fc1.T) in bf16 on CUDA, seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g, **bf)
    w1 = torch.randn(ffn, hidden, generator=g, **bf) * 0.02
    w2 = torch.randn(hidden, ffn, generator=g, **bf) * 0.02
    dy = torch.randn(tokens, hidden, generator=g, **bf)
    return x, w1, w2, dy, x @ w1.t()


def probe(tokens: int, hidden: int, ffn: int, iters: int, count: int) -> None:
    lt = ga.cublaslt()
    x, w1, w2, dy, h = mlp_operands(tokens, hidden, ffn)
    act, pre = torch.empty_like(h), torch.empty_like(h)
    dh = torch.empty_like(h)
    fwd = ga.Shape("forward", tokens, ffn, hidden, "bf16")
    bwd = ga.Shape("dgrad", tokens, ffn, hidden, "bf16")

    # numerics, first candidate
    hr = h.float().requires_grad_(True)
    ref_act = F.gelu(hr, approximate="tanh")
    ref_dh, = torch.autograd.grad(ref_act, hr, (dy @ w2).float())
    algo_f = [(c, (ga.ctypes.c_uint64 * 8).from_buffer_copy(c))
              for c in lt.candidates(fwd, count, "gelu_aux")]
    algo_b = [(c, (ga.ctypes.c_uint64 * 8).from_buffer_copy(c))
              for c in lt.candidates(bwd, count, "dgelu")]
    print(f"[{tokens}, {hidden}] -> [{ffn}]: {len(algo_f)} GELU_AUX candidates, "
          f"{len(algo_b)} DGELU candidates", flush=True)
    if not algo_f or not algo_b:
        return
    lt.matmul(fwd, algo_f[0][1], w1, x, act, 0.0, "gelu_aux", pre)
    lt.matmul(bwd, algo_b[0][1], w2, dy, dh, 0.0, "dgelu", h)
    torch.cuda.synchronize()
    print(f"  aux == x@w1.T bitwise: {torch.equal(pre, h)}; "
          f"max |act - gelu_tanh(h)| {(act.float() - ref_act).abs().max().item():.3g} "
          f"(|act| max {act.abs().max().item():.3g}); "
          f"max |act - gelu_erf(h)| {(act.float() - F.gelu(h.float())).abs().max().item():.3g}; "
          f"dh rel err {((dh.float() - ref_dh).norm() / ref_dh.norm()).item():.3g}")

    def today_fwd():
        fa.gelu_forward(torch.mm(x, w1.t()))

    def today_bwd():
        fa.gelu_backward(torch.mm(dy, w2), h)

    base_f, base_b = mean_ms(today_fwd, iters, 10), mean_ms(today_bwd, iters, 10)
    mm_f = mean_ms(lambda: torch.mm(x, w1.t()), iters, 10)
    mm_b = mean_ms(lambda: torch.mm(dy, w2), iters, 10)
    print(f"  today: fwd {base_f:.3f} ms (product alone {mm_f:.3f}), "
          f"bwd {base_b:.3f} ms (product alone {mm_b:.3f})")
    for i, (raw, algo) in enumerate(algo_f):
        t = mean_ms(lambda: lt.matmul(fwd, algo, w1, x, act, 0.0, "gelu_aux", pre), iters, 10)
        print(f"  GELU_AUX #{i} {lt.describe(raw)}: {t:.3f} ms ({base_f / t - 1:+.1%})",
              flush=True)
    for i, (raw, algo) in enumerate(algo_b):
        t = mean_ms(lambda: lt.matmul(bwd, algo, w2, dy, dh, 0.0, "dgelu", h), iters, 10)
        print(f"  DGELU #{i} {lt.describe(raw)}: {t:.3f} ms ({base_b / t - 1:+.1%})",
              flush=True)
    # again, after the candidates heated the chip
    print(f"  today again: fwd {mean_ms(today_fwd, iters, 10):.3f} ms, "
          f"bwd {mean_ms(today_bwd, iters, 10):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="all", choices=["all"] + sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--candidates", type=int, default=6)
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "cuBLASLt", ga.cublaslt().version)
    for name, shape in SHAPES.items():
        if a.preset in ("all", name):
            print(name)
            probe(*shape, a.iters, a.candidates)


if __name__ == "__main__":
    main()
