"""The attention's input layout and rotary embedding as one operator pair: the QKV
product's output is split into query, key and value heads and q and k are rotated in one
Triton kernel; the backward rotates the gradients back and writes them straight into the
layout of the QKV product's gradient, also in one kernel.

Why: torch.compile fuses the same arithmetic, but its kernels for this ran far below the
memory bandwidth (benchmarks/rope_probe.py: 0.66 ms forward + backward per llama-1b
layer for ~0.4 GB moved). On the CPU the operators compute the rotation with torch ops
(the fallbacks in `_split_op` and `_split_backward_op`), from the same cos and sin table
(`rotary.rotary_table`); the tests run the Triton kernels on the CPU through Triton's
interpreter (`INTERPRET_ON_CPU`).

Layout: qkv is [s, b, g * (p + 2) * d] (Megatron's: per query group, its p query heads,
then its key head, then its value head); q comes out [s, b, g * p, d], k and v
[s, b, g, d]. The first `rot` channels of each q and k head are rotated in two halves
(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in fp32, by the angles of the token's
position (its index along s), whose cos and sin `table` holds ([2, s, 1, 1, rot]).
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megatron.core.triton_jit import import_triton, jitted, runs_on

triton, tl = import_triton()  # (None, None) without a working Triton: torch's ops

BLOCK_T = 8  # tokens per program
INTERPRET_ON_CPU = False  # tests: run the kernels on CPU tensors through the interpreter
_NUM_WARPS = 4


def _rope_source(src_ptr, q_ptr, k_ptr, v_ptr, table_ptr, tokens, batch, groups,
                 q_tok, q_head, k_tok, k_head, v_tok, v_head, table_stride, table_half,
                 P: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HP: tl.constexpr,
                 DP: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr):
    """BLOCK_T tokens of one query group. Forward: read the group's p + 2 heads from the
    qkv rows (src), rotate q and k, store q, k, v. Backward: read dq, dk, dv, rotate q's
    and k's back (the transpose of the rotation), store the group's part of the dqkv rows
    (src). *_tok, *_head: element strides of q, k, v (channels contiguous)."""
    grp = tl.program_id(1)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, HP)[None, :, None]  # head slot in the group: q 0..P-1, k P, v P+1
    c = tl.arange(0, DP)[None, None, :]
    half = ROT // 2
    mask = (t < tokens) & (h < P + 2) & (c < D)
    rot = mask & (c < ROT) & (h <= P)  # the rotated elements
    partner = tl.where(c < half, c + half, c - half)
    pos = t // batch
    cos = tl.load(table_ptr + pos * table_stride + c, mask=rot, other=1.0)
    is_q, is_k, is_v = h < P, h == P, h == P + 1
    head = tl.where(is_q, grp * P + h, grp)
    off_q = t * q_tok + head * q_head
    off_k = t * k_tok + head * k_head
    off_v = t * v_tok + head * v_head
    src = t * (groups * (P + 2) * D) + (grp * (P + 2) + h) * D
    if BACKWARD:
        g = (tl.load(q_ptr + off_q + c, mask=mask & is_q, other=0.0).to(tl.float32)
             + tl.load(k_ptr + off_k + c, mask=mask & is_k, other=0.0).to(tl.float32)
             + tl.load(v_ptr + off_v + c, mask=mask & is_v, other=0.0).to(tl.float32))
        g_p = (tl.load(q_ptr + off_q + partner, mask=rot & is_q, other=0.0).to(tl.float32)
               + tl.load(k_ptr + off_k + partner, mask=rot & is_k, other=0.0).to(tl.float32))
        sin_p = tl.load(table_ptr + table_half + pos * table_stride + partner, mask=rot,
                        other=0.0)
        out = g * cos + tl.where(c < half, 1.0, -1.0) * g_p * sin_p
        tl.store(src_ptr + src + c, out.to(src_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(src_ptr + src + c, mask=mask, other=0.0).to(tl.float32)
        x_p = tl.load(src_ptr + src + partner, mask=rot, other=0.0).to(tl.float32)
        sin = tl.load(table_ptr + table_half + pos * table_stride + c, mask=rot, other=0.0)
        out = (x * cos + tl.where(c < half, -1.0, 1.0) * x_p * sin).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + off_q + c, out, mask=mask & is_q)
        tl.store(k_ptr + off_k + c, out, mask=mask & is_k)
        tl.store(v_ptr + off_v + c, out, mask=mask & is_v)


def _kernel():
    return jitted(_rope_source, INTERPRET_ON_CPU)


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA, or the CPU interpreter in tests)."""
    return runs_on(device, INTERPRET_ON_CPU)


def _strides(x: torch.Tensor, shape: Tuple[int, ...]) -> Tuple[torch.Tensor, int, int]:
    """x as [s, b, heads, d] with a single token stride (s's = b * b's) and contiguous
    channels -- a copy only if it is not -- and its (token, head) strides."""
    x = x.reshape(shape) if x.shape != shape else x
    if x.stride(-1) != 1 or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x, x.stride(1), x.stride(2)


def _launch(src, q, k, v, table, groups: int, p: int, backward: bool):
    s, b, d, rot = src.shape[0], src.shape[1], q.shape[-1], table.shape[-1]
    q, q_tok, q_head = _strides(q, (s, b, groups * p, d))
    k, k_tok, k_head = _strides(k, (s, b, groups, d))
    v, v_tok, v_head = _strides(v, (s, b, groups, d))
    tokens = s * b
    _kernel()[(triton.cdiv(tokens, BLOCK_T), groups)](
        src, q, k, v, table, tokens, b, groups, q_tok, q_head, k_tok, k_head, v_tok, v_head,
        table.stride(1), table.stride(0), P=p, D=d, ROT=rot,
        HP=triton.next_power_of_2(p + 2), DP=triton.next_power_of_2(d), BACKWARD=backward,
        BLOCK_T=BLOCK_T, num_warps=_NUM_WARPS)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check(qkv: torch.Tensor, table: torch.Tensor, groups: int, p: int, d: int) -> None:
    s, b, width = qkv.shape
    if width != groups * (p + 2) * d:
        raise ValueError(f"qkv rows have {width} values, not groups {groups} x (query heads "
                         f"per group {p} + 2) x head dim {d}")
    if table.dim() != 5 or table.shape[0] != 2 or table.shape[1] < s or \
            table.shape[-1] > d or table.shape[-1] % 2 or table.dtype != torch.float32:
        raise ValueError(f"rotary table {tuple(table.shape)} {table.dtype}: expected fp32 "
                         f"[2, >= {s}, 1, 1, even rotary dim <= {d}]")


@torch.library.custom_op("megatron::rope_split", mutates_args=())
def _split_op(qkv: torch.Tensor, table: torch.Tensor, groups: int, p: int, d: int
              ) -> List[torch.Tensor]:
    _check(qkv, table, groups, p, d)
    s, b, _ = qkv.shape
    qkv = qkv.contiguous()
    if available(qkv.device):
        q = qkv.new_empty(s, b, groups * p, d)
        k, v = qkv.new_empty(s, b, groups, d), qkv.new_empty(s, b, groups, d)
        _launch(qkv, q, k, v, table, groups, p, backward=False)
        return [q, k, v]
    x = qkv.view(s, b, groups, (p + 2) * d)
    q, k, v = torch.split(x, [p * d, d, d], dim=-1)
    cos, sin = table[0, :s], table[1, :s]
    rot = cos.shape[-1]

    def rotate(t):
        r = t[..., :rot].float()
        out = (r * cos + _rotate_half(r) * sin).to(t.dtype)
        return torch.cat((out, t[..., rot:]), dim=-1)

    # a copy even where v is already contiguous (one token, one group: decoding with a
    # key/value cache): a custom op may not return a view of its input
    return [rotate(q.reshape(s, b, groups * p, d)), rotate(k),
            v.clone(memory_format=torch.contiguous_format)]


@torch.library.custom_op("megatron::rope_split_backward", mutates_args=())
def _split_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                       table: torch.Tensor, groups: int, p: int) -> torch.Tensor:
    s, b, _, d = dv.shape
    if available(dv.device):
        dqkv = dv.new_empty(s, b, groups * (p + 2) * d)
        _launch(dqkv, dq, dk, dv, table, groups, p, backward=True)
        return dqkv
    cos, sin = table[0, :s], table[1, :s]
    rot = cos.shape[-1]

    def unrotate(g):  # the transpose of the forward's rotation
        r = g[..., :rot].float()
        out = (r * cos - _rotate_half(r * sin)).to(g.dtype)
        return torch.cat((out, g[..., rot:]), dim=-1)

    dq = unrotate(dq).reshape(s, b, groups, p * d)
    return torch.cat((dq, unrotate(dk), dv), dim=-1).reshape(s, b, groups * (p + 2) * d)


@_split_op.register_fake
def _(qkv, table, groups, p, d):
    s, b, _ = qkv.shape
    return [qkv.new_empty(s, b, groups * p, d), qkv.new_empty(s, b, groups, d),
            qkv.new_empty(s, b, groups, d)]


@_split_backward_op.register_fake
def _(dq, dk, dv, table, groups, p):
    s, b, _, d = dv.shape
    return dv.new_empty(s, b, groups * (p + 2) * d)


def _setup_context(ctx, inputs, output) -> None:
    _, table, groups, p, _ = inputs
    ctx.save_for_backward(table)
    ctx.groups, ctx.p = groups, p


def _backward(ctx, grads):
    (table,) = ctx.saved_tensors
    dq, dk, dv = grads
    return _split_backward_op(dq, dk, dv, table, ctx.groups, ctx.p), None, None, None, None


_split_op.register_autograd(_backward, setup_context=_setup_context)


def split_and_rotate(qkv: torch.Tensor, table: torch.Tensor, groups: int,
                     heads_per_group: int, head_dim: int):
    """(q [s, b, groups * heads_per_group, d], k [s, b, groups, d], v [s, b, groups, d])
    from the QKV product's output [s, b, groups * (heads_per_group + 2) * d], q and k
    rotated by `table` (`rotary.rotary_table`): Triton kernels on CUDA, torch ops on the
    CPU."""
    q, k, v = _split_op(qkv, table, groups, heads_per_group, head_dim)
    return q, k, v
