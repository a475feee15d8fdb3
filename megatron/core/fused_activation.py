"""GeLU (erf form) forward and backward as Triton kernels, for measuring against the
compiled ones (benchmarks/act_probe.py).

erf(x / sqrt(2)) is computed with Abramowitz & Stegun 7.1.26 (absolute error below
1.5e-7, far under bf16's resolution): one exponential and one reciprocal, and the
backward's Gaussian density reuses the same exponential. `EXACT=True` uses the
libdevice erf instead.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 2048
INV_SQRT2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327


if triton is not None:
    @triton.jit
    def _phi_and_cdf(x, EXACT: tl.constexpr):
        """(standard normal density, cumulative distribution) at x, in fp32."""
        e = tl.exp(-0.5 * x * x)
        if EXACT:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        else:
            z = tl.abs(x) * 0.7071067811865476
            t = 1.0 / (1.0 + 0.3275911 * z)
            poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                        + t * (-1.453152027 + t * 1.061405429))))
            half_erfc = 0.5 * poly * e  # 0.5 * erfc(|x| / sqrt(2))
            cdf = tl.where(x >= 0, 1.0 - half_erfc, half_erfc)
        return e * 0.3989422804014327, cdf

    @triton.jit
    def _gelu_fwd_kernel(h_ptr, out_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _, cdf = _phi_and_cdf(x, EXACT)
        tl.store(out_ptr + offs, (x * cdf).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_bwd_kernel(g_ptr, h_ptr, out_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        pdf, cdf = _phi_and_cdf(x, EXACT)
        tl.store(out_ptr + offs, (g * (cdf + x * pdf)).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_forward(h: torch.Tensor, exact: bool = False) -> torch.Tensor:
    h = h.contiguous()
    out = torch.empty_like(h)
    n = h.numel()
    _gelu_fwd_kernel[(triton.cdiv(n, BLOCK),)](h, out, n, EXACT=exact, BLOCK=BLOCK,
                                               num_warps=8)
    return out


def gelu_backward(grad: torch.Tensor, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
    grad, h = grad.contiguous(), h.contiguous()
    out = torch.empty_like(h)
    n = h.numel()
    _gelu_bwd_kernel[(triton.cdiv(n, BLOCK),)](grad, h, out, n, EXACT=exact, BLOCK=BLOCK,
                                               num_warps=8)
    return out


def _pdf_cdf(x: torch.Tensor):
    """(standard normal density, cdf) of fp32 x by A&S 7.1.26, in torch ops."""
    e = torch.exp(-0.5 * x * x)
    z = x.abs() * INV_SQRT2
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741
                + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * e
    return e * INV_SQRT_2PI, torch.where(x >= 0, 1.0 - half_erfc, half_erfc)


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        x = h.float()
        return (x * _pdf_cdf(x)[1]).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        x = h.float()
        pdf, cdf = _pdf_cdf(x)
        return (grad.float() * (cdf + x * pdf)).to(h.dtype)


def gelu(h: torch.Tensor) -> torch.Tensor:
    return GeLUFunction.apply(h)
