"""Gradient-accumulation fusion: gradients written straight into `param.main_grad`.

`accumulate_weight_grad`: the linear layers' weight-grad product into the grad buffer
(the operator `megatron::accumulate_weight_grad`). `grad_into_main_grad`: the gradient of
any other parameter (biases, norm weights) added into its buffer.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.distributed import stale_grads

from . import gemm_algos


def _accumulate_weight_grad_impl(main_grad: torch.Tensor, grad_output_2d: torch.Tensor,
                                 x_2d: torch.Tensor) -> None:
    overwrite = stale_grads.take(main_grad)  # the step's first write: no zeroed buffer
    if gemm_algos.wgrad_into(main_grad, grad_output_2d, x_2d, accumulate=not overwrite):
        return  # --gemm-algorithms chose a cuBLASLt algorithm for this shape
    if (main_grad.is_cuda and main_grad.dtype == torch.float32
            and x_2d.dtype in (torch.bfloat16, torch.float16)):
        if overwrite:
            torch.mm(grad_output_2d.t(), x_2d, out_dtype=torch.float32, out=main_grad)
        else:
            torch.addmm(main_grad, grad_output_2d.t(), x_2d, out_dtype=torch.float32,
                        out=main_grad)
    elif main_grad.is_cuda and main_grad.dtype == x_2d.dtype:  # fp16's 16-bit grad buffer
        # into the buffer itself (no product tensor, no copy or add pass); accumulating, the
        # product is added to the old value before it is rounded to 16 bits (beta = 1)
        if overwrite:
            torch.mm(grad_output_2d.t(), x_2d, out=main_grad)
        else:
            torch.addmm(main_grad, grad_output_2d.t(), x_2d, out=main_grad)
    elif overwrite:
        main_grad.copy_(grad_output_2d.t().matmul(x_2d))
    else:
        main_grad.add_(grad_output_2d.t().matmul(x_2d).to(main_grad.dtype))


# An operator of our own (declared to mutate main_grad), so torch.compile keeps it as one
# in-place call in the compiled backward. Registered through torch.library.Library rather
# than the custom_op decorator: fewer Python layers per call (it runs once per linear
# layer and micro-batch, on the host's critical path for small models).
_LIB = torch.library.Library("megatron", "DEF")
_LIB.define("accumulate_weight_grad(Tensor(a!) main_grad, Tensor grad_output_2d, "
            "Tensor x_2d) -> ()")
for _key in ("CPU", "CUDA"):
    _LIB.impl("accumulate_weight_grad", _accumulate_weight_grad_impl, _key)


@torch.library.register_fake("megatron::accumulate_weight_grad", lib=_LIB)
def _accumulate_weight_grad_fake(main_grad, grad_output_2d, x_2d) -> None:
    return None


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output_2d: torch.Tensor,
                           x_2d: torch.Tensor) -> None:
    """main_grad += grad_output^T x (weight-grad accumulation fusion).

    On CUDA with 16-bit operands and an fp32 main_grad the GEMM accumulates into main_grad
    itself in fp32 (cuBLAS beta = 1): no 16-bit weight-grad tensor is written and read back,
    and the product is not rounded to 16 bits before the sum. A main_grad of the operands'
    dtype (fp16 runs) is likewise the GEMM's output. Elsewhere: a matmul and add_.
    When the grad buffer left main_grad stale at the start of the step (stale_grads.py),
    the first call writes the product instead (beta = 0): the same values as adding it to
    zeros.
    """
    torch.ops.megatron.accumulate_weight_grad(main_grad, grad_output_2d, x_2d)


class _GradIntoMainGrad(torch.autograd.Function):
    """Identity on a parameter; backward adds the gradient into `param.main_grad` and
    hands autograd None (its grad hook still fires, with `.grad` None, as for the fused
    linears). Inside a compiled graph the add fuses with the kernel that reduces the
    gradient, in fp32, instead of a bf16 gradient output plus a separate add per
    parameter."""

    @staticmethod
    def forward(ctx, param):
        ctx.save_for_backward(param)
        ctx.main_grad = param.main_grad
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        (param,) = ctx.saved_tensors
        main_grad = getattr(param, "main_grad", None)
        if main_grad is None:
            # Under full activation recompute (torch's non-reentrant checkpoint) the saved
            # parameter comes back as a recomputed alias without `main_grad`: the buffer
            # recorded at forward time is the same memory.
            main_grad = ctx.main_grad
        main_grad.add_(grad)
        return None


def grad_into_main_grad(param: Optional[torch.Tensor], enabled: bool) -> Optional[torch.Tensor]:
    """`param` for use in the forward, its gradient routed straight into `param.main_grad`
    when `enabled` (gradient-accumulation fusion) and a grad buffer exists; else `param`."""
    if (enabled and param is not None and param.requires_grad and torch.is_grad_enabled()
            and getattr(param, "main_grad", None) is not None):
        if getattr(param, "grad_overwrites_stale", False):
            raise ValueError("grad_into_main_grad adds into main_grad, but this parameter's "
                             "main_grad is left stale for its weight-grad product to "
                             "overwrite (grad_overwrites_stale); route it one way only")
        return _GradIntoMainGrad.apply(param)
    return param
