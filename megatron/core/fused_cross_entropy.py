"""Output layer and cross entropy in one autograd node (`--cross-entropy-kernel triton`,
the default on CUDA with one tensor-parallel rank, bf16 or fp32 weights, when Triton is
importable).

The [tokens, vocab] logits are the step's largest tensor (16384 x 50304 bf16 = 1.6 GB for
a GPT-2 batch). Computed as a linear layer followed by a separate cross entropy they are
written by the GEMM, read once or twice by the loss, read again by the loss's backward,
which writes their gradient, read by the two backward GEMMs. Here one Triton program per
token reads its row of logits, computes the loss (log-sum-exp minus the target logit, in
fp32) and overwrites the row, in place, with the gradient of the loss with respect to the
logits before scaling: softmax - onehot(label), rounded to the logits' dtype. The
backward never touches the logits again except as GEMM operands: the per-token upstream
gradient c (the loss mask over the token count) scales the small side instead --
grad_x = c * (G W) and grad_W = G^T (c * x) -- so the two GEMMs read G as they would have
read the scaled gradient, and no pass over [tokens, vocab] is left in the backward.

Memory is unchanged (the linear layer would keep the logits for the loss's backward too).
The weight gradient is added into `weight.main_grad` by the same fp32-accumulating GEMM
as the linear layers' when gradient-accumulation fusion is on. The tests run the kernel
through Triton's CPU interpreter (`INTERPRET_ON_CPU`, as in multi_tensor_adam).
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 2048  # vocabulary entries per loop iteration of one program
_NUM_WARPS = 8
INTERPRET_ON_CPU = False  # tests: run the kernel on CPU tensors in Triton's interpreter


def _loss_and_grad_rows_source(logits, labels, losses, vocab, stride, BLOCK: tl.constexpr):
    """One program per row: loss = logsumexp(row) - row[label]; row <- softmax - onehot."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    label = tl.load(labels + row)
    lanes = tl.arange(0, BLOCK)
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
    target = tl.load(base + label).to(tl.float32)
    tl.store(losses + row, lse - target)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        valid = offs < vocab
        x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)
        tl.store(base + offs, grad.to(logits.dtype.element_ty), mask=valid)


_KERNELS = {}


def _kernel():
    """The jitted kernel for the current INTERPRET_ON_CPU setting."""
    if INTERPRET_ON_CPU not in _KERNELS:
        _KERNELS[INTERPRET_ON_CPU] = triton.jit(_loss_and_grad_rows_source)
    return _KERNELS[INTERPRET_ON_CPU]


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device` (CUDA, or the CPU interpreter in tests)."""
    return triton is not None and (device.type == "cuda" or INTERPRET_ON_CPU)


def loss_and_grad_rows_(logits_2d: torch.Tensor, labels_1d: torch.Tensor) -> torch.Tensor:
    """Per-row fp32 loss of [rows, vocab] logits; the logits are overwritten with
    softmax - onehot(label) in their own dtype."""
    rows, vocab = logits_2d.shape
    if logits_2d.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    losses = torch.empty(rows, dtype=torch.float32, device=logits_2d.device)
    if rows:
        _kernel()[(rows,)](logits_2d, labels_1d.contiguous(), losses, vocab,
                           logits_2d.stride(0), BLOCK=BLOCK, num_warps=_NUM_WARPS)
    return losses


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [s, b] (fp32) of x [s, b, h] through weight [vocab, h]."""

    @staticmethod
    def forward(ctx, x_sbh, weight, labels_sb, gradient_accumulation_fusion: bool):
        s, b, h = x_sbh.shape
        x_2d = x_sbh.reshape(s * b, h)
        logits = torch.matmul(x_2d, weight.t())
        losses = loss_and_grad_rows_(logits, labels_sb.reshape(s * b))
        ctx.save_for_backward(x_2d, weight, logits)
        ctx.fusion = gradient_accumulation_fusion
        ctx.shape = (s, b, h)
        return losses.view(s, b)

    @staticmethod
    def backward(ctx, grad_losses):
        x_2d, weight, grad_logits = ctx.saved_tensors  # grad_logits: softmax - onehot
        scale = grad_losses.reshape(-1, 1).float()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_logits.matmul(weight).float() * scale).to(x_2d.dtype).view(ctx.shape)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            x_scaled = (x_2d.float() * scale).to(x_2d.dtype)
            if ctx.fusion and hasattr(weight, "main_grad"):
                from megatron.core.tensor_parallel.layers import accumulate_weight_grad

                accumulate_weight_grad(weight.main_grad, grad_logits, x_scaled)
            else:
                grad_weight = grad_logits.t().matmul(x_scaled)
        return grad_x, grad_weight, None, None


def linear_cross_entropy(x_sbh: torch.Tensor, weight: torch.Tensor, labels_sb: torch.Tensor,
                         gradient_accumulation_fusion: bool = False) -> torch.Tensor:
    """Per-token loss [s, b] in fp32 of logits x W^T against labels (tensor-parallel 1)."""
    return LinearCrossEntropy.apply(x_sbh, weight, labels_sb, gradient_accumulation_fusion)


def use_fused(kernel: str, device: torch.device, tp_size: int, fp16_lm_cross_entropy: bool,
              dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """None when `--cross-entropy-kernel KERNEL` runs this kernel here, else why not."""
    if kernel == "torch":
        return "--cross-entropy-kernel torch"
    if dtype == torch.float16:
        # The backward scales the activations by the per-token gradient, which carries the
        # loss scale: in fp16 that product overflows long before the logits' gradient would.
        return "fp16 activations would overflow when scaled by the loss-scaled gradient"
    if tp_size > 1:
        return "tensor parallelism splits the vocabulary (vocab-parallel cross entropy)"
    if fp16_lm_cross_entropy:
        return "--fp16-lm-cross-entropy computes the loss in 16 bits"
    if not available(device):
        return "Triton cannot run on this device"
    return None
