"""GeLU (erf form) as two operators of our own, Triton kernels on CUDA
(`--gelu-kernel polynomial`, auto's choice there); and SwiGLU's silu(a) * b likewise
(`--swiglu`, always; see its section below).

Why not torch's: erf costs ~20 instructions per element, and on a power-capped H200 that
makes the activation instruction-bound (benchmarks/act_probe.py: compiled forward 2.8
TB/s, a plain copy 4.2). Here erf(x / sqrt(2)) comes from Abramowitz & Stegun 7.1.26
(absolute error below 1.5e-7, far under bf16's resolution): one exponential and one
reciprocal, and the backward's Gaussian density reuses that exponential.

Why operators: torch.compile cannot look inside them, so the compiled backward keeps the
activation saved in the forward instead of recomputing it next to the gradient (one
write less per layer, for the activation's memory). On the CPU the operators compute
the same polynomial in torch ops; the tests run the Triton kernels on the CPU through
Triton's interpreter (`INTERPRET_ON_CPU`).
"""
from __future__ import annotations

import torch

from megatron.core.triton_jit import import_triton, jitted, runs_on

triton, tl = import_triton()  # (None, None) without a working Triton: torch's ops

BLOCK = 2048  # elements per program (benchmarks/act_probe.py)
INTERPRET_ON_CPU = False  # tests: run the kernels on CPU tensors through the interpreter
_NUM_WARPS = 8
INV_SQRT2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
_P, _A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _pdf_cdf(x: torch.Tensor):
    """(standard normal density, cdf) at fp32 x: the kernels' arithmetic in torch ops."""
    e = torch.exp(-0.5 * x * x)
    t = 1.0 / (1.0 + _P * (x.abs() * INV_SQRT2))
    poly = t * (_A[0] + t * (_A[1] + t * (_A[2] + t * (_A[3] + t * _A[4]))))
    half_erfc = 0.5 * poly * e
    return e * INV_SQRT_2PI, torch.where(x >= 0, 1.0 - half_erfc, half_erfc)


def _gelu_source(g_ptr, h_ptr, out_ptr, n, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """out = GeLU(h), or with BACKWARD out = g * GeLU'(h), over BLOCK elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-0.5 * x * x)
    t = 1.0 / (1.0 + 0.3275911 * (tl.abs(x) * 0.7071067811865476))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * e  # 0.5 * erfc(|x| / sqrt(2))
    cdf = tl.where(x >= 0, 1.0 - half_erfc, half_erfc)
    if BACKWARD:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = g * (cdf + x * (e * 0.3989422804014327))
    else:
        out = x * cdf
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _kernel():
    return jitted(_gelu_source, INTERPRET_ON_CPU)


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA, or the CPU interpreter in tests)."""
    return runs_on(device, INTERPRET_ON_CPU)


def gelu_forward(h: torch.Tensor) -> torch.Tensor:
    """GeLU of a contiguous tensor by the Triton kernel (fp32 arithmetic, h's dtype out)."""
    out = torch.empty_like(h)
    n = h.numel()
    _kernel()[(triton.cdiv(n, BLOCK),)](h, h, out, n, BACKWARD=False, BLOCK=BLOCK,
                                        num_warps=_NUM_WARPS)
    return out


def gelu_backward(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """grad * GeLU'(h) by the Triton kernel."""
    out = torch.empty_like(h)
    n = h.numel()
    _kernel()[(triton.cdiv(n, BLOCK),)](grad, h, out, n, BACKWARD=True, BLOCK=BLOCK,
                                        num_warps=_NUM_WARPS)
    return out


@torch.library.custom_op("megatron::gelu", mutates_args=())
def _gelu_op(h: torch.Tensor) -> torch.Tensor:
    h = h.contiguous()
    if available(h.device):
        return gelu_forward(h)
    x = h.float()
    return (x * _pdf_cdf(x)[1]).to(h.dtype)


@torch.library.custom_op("megatron::gelu_backward", mutates_args=())
def _gelu_backward_op(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    grad, h = grad.contiguous(), h.contiguous()
    if available(h.device):
        return gelu_backward(grad, h)
    x = h.float()
    pdf, cdf = _pdf_cdf(x)
    return (grad.float() * (cdf + x * pdf)).to(h.dtype)


@_gelu_op.register_fake
def _(h):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@_gelu_backward_op.register_fake
def _(grad, h):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (h,) = ctx.saved_tensors
    return _gelu_backward_op(grad, h)


_gelu_op.register_autograd(_backward, setup_context=_setup_context)


def gelu(h: torch.Tensor) -> torch.Tensor:
    """GeLU (erf form) through the operators: Triton on CUDA, torch ops on the CPU."""
    return _gelu_op(h)


# ---------------------------------------------------------------------------------- SwiGLU
# silu(a) * b over the two halves [a | b] of fc1's output (`--swiglu`), as an operator
# pair with one Triton kernel each way. torch.compile's backward for this read and wrote
# at about half the memory bandwidth (0.65 ms per llama-1b layer for 1.34 GB; the
# forward, 0.18 ms, was at bandwidth and is the same here). fp32 arithmetic, one
# rounding at the end, as the compiled code does.
SWIGLU_BLOCK = 2048  # columns per program


def _swiglu_source(h_ptr, g_ptr, out_ptr, cols, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """One row, BLOCK columns: out = silu(a) * b from h = [a | b]; with BACKWARD,
    out = [g * b * silu'(a) | g * silu(a)] (the gradient of h, out as wide as h)."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    a = tl.load(h_ptr + row * 2 * cols + col, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h_ptr + row * 2 * cols + cols + col, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    if BACKWARD:
        g = tl.load(g_ptr + row * cols + col, mask=mask, other=0.0).to(tl.float32)
        da = g * b * (sig * (1.0 + a * (1.0 - sig)))
        db = g * (a * sig)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * 2 * cols + col, da.to(dtype), mask=mask)
        tl.store(out_ptr + row * 2 * cols + cols + col, db.to(dtype), mask=mask)
    else:
        tl.store(out_ptr + row * cols + col, (a * sig * b).to(out_ptr.dtype.element_ty),
                 mask=mask)


def _swiglu_launch(h: torch.Tensor, g, out: torch.Tensor, backward: bool) -> torch.Tensor:
    cols = h.shape[-1] // 2
    rows = h.numel() // (2 * cols)
    jitted(_swiglu_source, INTERPRET_ON_CPU)[(rows, triton.cdiv(cols, SWIGLU_BLOCK))](
        h, h if g is None else g, out, cols, BACKWARD=backward, BLOCK=SWIGLU_BLOCK,
        num_warps=_NUM_WARPS)
    return out


def _swiglu_torch(h: torch.Tensor, g=None) -> torch.Tensor:
    """The kernels' arithmetic in torch ops (the CPU's path)."""
    wide = torch.promote_types(h.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    a, b = (x.to(wide) for x in torch.chunk(h, 2, dim=-1))
    sig = torch.sigmoid(a)
    if g is None:
        return (a * sig * b).to(h.dtype)
    g = g.to(wide)
    return torch.cat((g * b * (sig * (1.0 + a * (1.0 - sig))), g * (a * sig)), -1).to(h.dtype)


@torch.library.custom_op("megatron::swiglu", mutates_args=())
def _swiglu_op(h: torch.Tensor) -> torch.Tensor:
    h = h.contiguous()
    if not available(h.device):
        return _swiglu_torch(h)
    out = h.new_empty(*h.shape[:-1], h.shape[-1] // 2)
    return _swiglu_launch(h, None, out, backward=False)


@torch.library.custom_op("megatron::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    grad, h = grad.contiguous(), h.contiguous()
    if not available(h.device):
        return _swiglu_torch(h, grad)
    return _swiglu_launch(h, grad, torch.empty_like(h), backward=True)


@_swiglu_op.register_fake
def _(h):
    return h.new_empty(*h.shape[:-1], h.shape[-1] // 2)


@_swiglu_backward_op.register_fake
def _(grad, h):
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def _swiglu_grad(ctx, grad):
    (h,) = ctx.saved_tensors
    return _swiglu_backward_op(grad, h)


_swiglu_op.register_autograd(_swiglu_grad, setup_context=_setup_context)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for h = [a | b] along the last dim (even width): Triton on CUDA, torch
    ops on the CPU."""
    if h.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dimension, got {h.shape[-1]}")
    return _swiglu_op(h)
