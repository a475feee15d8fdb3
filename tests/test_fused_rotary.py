"""Split QKV + rotary embedding as one operator pair (megatron/core/fused_rotary.py).

- The operators (torch ops on the CPU) against an independent float64 reference that
  rotates each channel pair as a complex number by e^{i * position * frequency}: values
  within fp32 rounding, and the gradient of qkv equal to the reference's autograd one.
- The Triton kernels (CPU interpreter) give the operators' values and gradients (fp32:
  1e-6; fp16: one rounding step) for plain attention, query groups, a partial rotary
  dimension, and gradients laid out as cuDNN returns them.
- torch.library.opcheck passes; under torch.compile the operator gives eager's values.
- On CUDA (bf16) the kernels match the operators' torch arithmetic.
"""
from __future__ import annotations

import pytest
import torch

from megatron.core import fused_rotary as fr
from megatron.core.models.gpt.rotary import rotary_table

SHAPES = [  # (s, b, groups, heads per group, head dim, rotary dim)
    (5, 3, 2, 4, 16, 16),  # query groups, whole heads rotated
    (4, 2, 3, 1, 8, 4),    # plain attention, half of each head rotated
]


def _inputs(s, b, g, p, d, rot, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, b, g * (p + 2) * d, generator=gen).to(device, dtype)
    table = rotary_table(s + 2, rot, device=device)  # longer than s: the model slices
    return qkv, table


def _reference(qkv, s, b, g, p, d, rot):
    """float64 q, k, v: each rotated channel pair (x_j, x_{j + rot/2}) multiplied as the
    complex number x_j + i x_{j+rot/2} by e^{i pos theta_j}."""
    x = qkv.double().reshape(s, b, g, p + 2, d)
    theta = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta  # [s, rot/2]
    turn = torch.polar(torch.ones_like(angle), angle)[:, None, None, None, :]
    half = rot // 2
    z = torch.complex(x[..., :half], x[..., half:rot])
    qk = z[:, :, :, : p + 1] * turn
    rotated = torch.cat((qk.real, qk.imag, x[:, :, :, : p + 1, rot:]), dim=-1)
    q = rotated[:, :, :, :p].reshape(s, b, g * p, d)
    return q, rotated[:, :, :, p], x[:, :, :, p + 1]


@pytest.mark.parametrize("shape", SHAPES)
def test_operator_matches_the_complex_rotation(shape):
    s, b, g, p, d, rot = shape
    qkv, table = _inputs(*shape)
    qkv.requires_grad_(True)
    got = fr.split_and_rotate(qkv, table, g, p, d)
    x64 = qkv.detach().double().requires_grad_(True)
    want = _reference(x64, s, b, g, p, d, rot)
    for a, w in zip(got, want):
        assert a.shape == w.shape and a.dtype == torch.float32
        assert (a.double() - w).abs().max() < 1e-5
    grads = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i))
             for i, w in enumerate(want)]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, [x.double() for x in grads])
    assert (qkv.grad.double() - x64.grad).abs().max() < 1e-5


@pytest.fixture
def interpret(triton_interpreter, monkeypatch):
    """Run the Triton kernels on CPU tensors (tests/conftest.py's triton_interpreter)."""
    monkeypatch.setattr(fr, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fr, "BLOCK_T", 4)  # several programs and a ragged tail


def _both_ways(monkeypatch, shape, dtype, device="cpu"):
    """(kernel's q, k, v, dqkv), (torch ops' q, k, v, dqkv) for the same inputs; the
    output gradients laid out as cuDNN's (dense in [s, b, heads, d] order, seen through
    the [b, heads, s, d] permute) for q and as [b, heads, s, d] copies for k and v."""
    s, b, g, p, d, rot = shape
    qkv, table = _inputs(*shape, dtype=dtype, device=device)
    runs = []
    for kernels in (True, False):
        monkeypatch.setattr(fr, "available", lambda dev, k=kernels: k)
        x = qkv.clone().requires_grad_(True)
        outs = fr.split_and_rotate(x, table, g, p, d)
        gen = torch.Generator().manual_seed(7)
        grads = [torch.randn(o.shape, generator=gen).to(device, dtype) for o in outs]
        grads[1] = grads[1].permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
        grads[2] = grads[2].permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
        torch.autograd.backward(outs, grads)
        runs.append([o.detach() for o in outs] + [x.grad])
    return runs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,step", [(torch.float32, 0.0), (torch.float16, 2.0 ** -10)])
def test_kernels_match_the_operators(interpret, monkeypatch, shape, dtype, step):
    kernel, ops = _both_ways(monkeypatch, shape, dtype)
    for got, want in zip(kernel, ops):
        assert got.shape == want.shape and got.dtype == dtype
        tol = step * want.float().abs() + 1e-6
        assert ((got.float() - want.float()).abs() <= tol).all()


def test_bad_shapes_name_the_mismatch():
    qkv, table = _inputs(4, 2, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="not groups 3"):
        fr.split_and_rotate(qkv, table, 3, 4, 16)
    with pytest.raises(ValueError, match="rotary table"):
        fr.split_and_rotate(qkv, table[:, :2], 2, 4, 16)  # shorter than the sequence


def test_operator_registration():
    qkv, table = _inputs(4, 2, 2, 2, 8, 8)
    torch.library.opcheck(torch.ops.megatron.rope_split.default,
                          (qkv.requires_grad_(True), table, 2, 2, 8))
    dq, dk, dv = (torch.randn(4, 2, n, 8) for n in (4, 2, 2))
    torch.library.opcheck(torch.ops.megatron.rope_split_backward.default,
                          (dq, dk, dv, table, 2, 2))


def test_compiled_equals_eager():
    qkv, table = _inputs(6, 2, 2, 2, 8, 8)
    fn = lambda x: [t.permute(1, 2, 0, 3) * 2 for t in fr.split_and_rotate(x, table, 2, 2, 8)]
    eager, compiled = fn(qkv), torch.compile(fn, dynamic=False)(qkv)
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES + [(64, 4, 8, 4, 64, 64)])
def test_cuda_kernels_match_the_operators(monkeypatch, shape):
    kernel, ops = _both_ways(monkeypatch, shape, torch.bfloat16, device="cuda")
    for got, want in zip(kernel, ops):
        tol = 2.0 ** -7 * want.float().abs() + 1e-6
        assert ((got.float() - want.float()).abs() <= tol).all()
