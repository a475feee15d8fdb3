#!/usr/bin/env python
"""Time the fused cross entropy's row kernel (megatron/core/fused_cross_entropy.py) on
[tokens, vocab] bf16 logits, against variants and against plain passes over the same
bytes (CUDA).

    python benchmarks/ce_rows_probe.py [--rows 16384] [--vocab 50304] [--iters 20]

The kernel reads each row twice (log-sum-exp, then softmax - onehot written in place):
at least one read and one write of the logits from HBM, the second read from L2 when the
row is still there. Its first pass keeps a running max per lane, so it takes two
exponentials per element and the second pass one. Rows printed:

  shipped       the kernel as it ships, at its BLOCK and warp count (and others)
  scalar-max    first pass with one running max per row: one exponential per element
                there (a block max and a block sum per iteration instead)
  persistent    the shipped arithmetic on a fixed grid of programs (N per SM) walking
                the rows, so fewer rows are in flight and the second pass can hit L2
  read+write    torch's in-place multiply: one read and one write (the floor)
  read          torch's row max: one read
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_timing import mean_ms  # noqa: E402
from megatron.core import fused_cross_entropy as fce  # noqa: E402


@triton.jit
def _scalar_max_rows(logits, labels, losses, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    label = tl.load(labels + row)
    lanes = tl.arange(0, BLOCK)
    row_max = -1.0e30
    row_sum = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        x = tl.load(base + offs, mask=offs < vocab, other=-1.0e30).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
    lse = row_max + tl.log(row_sum)
    tl.store(losses + row, lse - tl.load(base + label).to(tl.float32))
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        valid = offs < vocab
        x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)
        tl.store(base + offs, grad.to(logits.dtype.element_ty), mask=valid)


@triton.jit
def _persistent_rows(logits, labels, losses, rows, vocab, stride, BLOCK: tl.constexpr,
                     REVERSE: tl.constexpr):
    """The shipped kernel's arithmetic, but a fixed grid of programs walking the rows
    (row = pid, pid + grid, ...): fewer rows in flight, so a row read by the first pass
    can still be in L2 for the second. REVERSE: the second pass walks the row backwards
    (the most recently read blocks first)."""
    lanes = tl.arange(0, BLOCK)
    nblocks = tl.cdiv(vocab, BLOCK)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        base = logits + row * stride  # < 2**31 elements in the probe
        label = tl.load(labels + row)
        run_max = tl.full([BLOCK], -1.0e30, tl.float32)
        run_sum = tl.full([BLOCK], 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            valid = offs < vocab
            x = tl.load(base + offs, mask=valid, other=-1.0e30).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.where(valid, tl.exp(x - new_max), 0.0)
            run_max = new_max
        row_max = tl.max(run_max, axis=0)
        lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
        tl.store(losses + row, lse - tl.load(base + label).to(tl.float32))
        for i in range(0, nblocks):
            blk = nblocks - 1 - i if REVERSE else i
            offs = blk * BLOCK + lanes
            valid = offs < vocab
            x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)
            tl.store(base + offs, grad.to(logits.dtype.element_ty), mask=valid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    fresh = torch.randn(a.rows, a.vocab, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, a.vocab, (a.rows,), device="cuda")
    logits = fresh.clone()
    gb = fresh.numel() * fresh.element_size() / 1e9
    rows = []

    def shipped(block, warps):
        def fn():
            fce._kernel()[(a.rows,)](logits, labels, losses, losses, losses, losses, a.vocab,
                                     logits.stride(0), 0, MODE=0, BLOCK=block,
                                     num_warps=warps)
        return fn

    losses = torch.empty(a.rows, device="cuda")
    ref_loss = fce.loss_and_grad_rows_(fresh.clone(), labels)
    for block, warps in ((fce.BLOCK, fce._NUM_WARPS), (1024, 4), (2048, 4), (4096, 8),
                         (4096, 16), (8192, 16)):
        logits.copy_(fresh)
        rows.append((f"shipped BLOCK {block} warps {warps}", mean_ms(shipped(block, warps),
                                                                    a.iters)))
    for block, warps in ((2048, 8), (4096, 8), (4096, 16), (8192, 16)):
        logits.copy_(fresh)
        out = torch.empty(a.rows, device="cuda")

        def scalar(block=block, warps=warps, out=out):
            _scalar_max_rows[(a.rows,)](logits, labels, out, a.vocab, logits.stride(0),
                                        BLOCK=block, num_warps=warps)
        scalar()
        err = (out - ref_loss).abs().max().item()
        grad_ref = fresh.clone()
        fce.loss_and_grad_rows_(grad_ref, labels)
        logits.copy_(fresh)
        scalar()
        gerr = (logits.float() - grad_ref.float()).abs().max().item()
        rows.append((f"scalar-max BLOCK {block} warps {warps} (loss err {err:.1e}, "
                     f"grad err {gerr:.1e})", mean_ms(scalar, a.iters)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grad_ref = fresh.clone()
    fce.loss_and_grad_rows_(grad_ref, labels)
    for per_sm, block, warps, reverse in ((1, 2048, 8, False), (2, 2048, 8, False),
                                          (3, 2048, 8, False), (4, 2048, 8, False),
                                          (2, 2048, 8, True), (4, 2048, 8, True),
                                          (2, 4096, 16, False), (1, 4096, 16, False),
                                          (8, 2048, 8, True)):
        out = torch.empty(a.rows, device="cuda")

        def persistent(per_sm=per_sm, block=block, warps=warps, reverse=reverse, out=out):
            _persistent_rows[(per_sm * sms,)](logits, labels, out, a.rows, a.vocab,
                                              logits.stride(0), BLOCK=block, REVERSE=reverse,
                                              num_warps=warps)
        logits.copy_(fresh)
        persistent()
        same = torch.equal(logits, grad_ref) and torch.equal(out, ref_loss)
        rows.append((f"persistent {per_sm}/SM BLOCK {block} warps {warps}"
                     f"{' reverse' if reverse else ''} (bitwise equal: {same})",
                     mean_ms(persistent, a.iters)))
    rows.append(("read+write (torch mul_)", mean_ms(lambda: logits.mul_(1.0), a.iters)))
    rows.append(("read (torch amax over rows)", mean_ms(lambda: logits.amax(dim=1), a.iters)))
    print(f"[{a.rows}, {a.vocab}] bf16 logits, {gb:.2f} GB; {torch.cuda.get_device_name()}")
    print(f"{'variant':<72}{'ms':>8}{'GB/s at 2 passes':>18}")
    for name, ms in rows:
        print(f"{name:<72}{ms:>8.3f}{2 * gb / ms * 1e3:>18.0f}")


if __name__ == "__main__":
    main()
