"""Where the rotary embedding's time goes: the compiled forward + backward of the part of
a llama-1b attention between the QKV product and SDPA (split into query groups, rotate q
and k, lay out for SDPA): torch.compile's kernels with the angles' cos and sin computed
in the kernel (as it fuses `freqs.cos()`) or read from a precomputed table, and the
project's operator pair (megatron/core/fused_rotary.py, two Triton kernels). The GPU
kernel time is what a layer pays inside the whole-step CUDA graph; the wall time of these
small eager iterations also counts the host's launches.

    python benchmarks/rope_probe.py [--iters 30]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402
from megatron.core import fused_rotary  # noqa: E402


def rotate(t, cos, sin):
    rot = cos.shape[-1]
    x = t[..., :rot].float()
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(t.dtype)


def part(qkv, tables, n, g, d, from_angles):
    if from_angles is None:  # the operator pair
        q, k, v = fused_rotary.split_and_rotate(qkv, tables, g, n // g, d)
        return [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    s, b, _ = qkv.shape
    pg = n // g
    x = qkv.view(s, b, g, (pg + 2) * d)
    q, k, v = torch.split(x, [pg * d, d, d], dim=-1)
    q = q.reshape(s, b, n, d)
    cos, sin = (tables.cos(), tables.sin()) if from_angles else tables
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return [t.permute(1, 2, 0, 3) for t in (q, k, v)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    s, b, n, g, d = 2048, 8, 32, 8, 64
    qkv = torch.randn(s, b, (n + 2 * g) * d, device="cuda", dtype=torch.bfloat16,
                      requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    angles = torch.outer(torch.arange(s, device="cuda").float(), inv)
    angles = torch.cat((angles, angles), -1)[:, None, None, :]
    variants = [(f"{how}, grads {layout}", tables, fa, layout)
                for how, tables, fa in (("cos/sin computed", angles, True),
                                        ("cos/sin from a table", (angles.cos(), angles.sin()),
                                         False),
                                        ("operator pair", torch.stack((angles.cos(),
                                                                       angles.sin())), None))
                for layout in ("[s,b,n,d] (as cuDNN's)", "[b,n,s,d]")]
    for label, tables, from_angles, layout in variants:
        if layout.startswith("[s"):  # laid out as the inputs, seen as [b, n, s, d]
            grads = [torch.randn(s, b, m, d, device="cuda", dtype=torch.bfloat16)
                     .permute(1, 2, 0, 3) for m in (n, g, g)]
        else:
            grads = [torch.randn(b, m, s, d, device="cuda", dtype=torch.bfloat16)
                     for m in (n, g, g)]
        torch._dynamo.reset()
        fn = torch.compile(lambda x, t, fa=from_angles: part(x, t, n, g, d, fa))

        def step():
            outs = fn(qkv, tables)
            torch.autograd.backward(outs, grads)
            qkv.grad = None

        wall = mean_ms(step, a.iters)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.iters):
                step()
            torch.cuda.synchronize()
        kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / a.iters
        print(f"{label:45s} forward + backward: GPU kernels {kernels:.3f} ms, "
              f"wall {wall:.3f} ms (host-bound when larger)")


if __name__ == "__main__":
    main()
