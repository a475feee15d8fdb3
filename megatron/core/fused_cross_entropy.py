"""Output layer and cross entropy in one autograd node (`--cross-entropy-kernel triton`,
the default on CUDA when Triton is importable).

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

With fp16 activations c (which carries the loss scale) is applied to x as c / p, p the
power of two at or above max |c|, and the fp32 weight-grad product is multiplied by p:
c x alone could overflow fp16 where the gradient does not.

Memory is unchanged (the linear layer would keep the logits for the loss's backward too).
The weight gradient is added into `weight.main_grad` by the same fp32-accumulating GEMM
as the linear layers' when gradient-accumulation fusion is on.

With tensor parallelism each rank holds a slice of the vocabulary. Two kernels then run
per row: the first writes the slice's max, sum of exponentials and target logit (when the
slice holds the target); three all-reduces of one number per token make them the whole
vocabulary's (Megatron's vocab-parallel cross entropy reduces the same three); the second
overwrites the row with softmax - onehot. The backward sums the input grad over the group
as the column-parallel layer does, overlapped with the weight-grad GEMM. The tests run
the kernels through Triton's CPU interpreter (`INTERPRET_ON_CPU`, as in multi_tensor_adam),
under tensor parallelism with gloo processes.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.distributed import stale_grads
from megatron.core.tensor_parallel import gemm_algos
from megatron.core.tensor_parallel.layers import accumulate_weight_grad
from megatron.core.tensor_parallel.mappings import (
    all_gather_dim0,
    group_rank,
    group_size,
    reduce_scatter_dim0,
)
from megatron.core.triton_jit import import_triton, jitted, runs_on

triton, tl = import_triton()  # (None, None) without a working Triton: torch's ops

BLOCK = 2048  # vocabulary entries per loop iteration of one program
_NUM_WARPS = 8
INTERPRET_ON_CPU = False  # tests: run the kernel on CPU tensors in Triton's interpreter


def _rows_source(logits, labels, lse_in, out0, out1, out2, vocab, stride, vocab_start,
                 MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of [rows, vocab] logits (a slice starting at `vocab_start`).
    MODE 0 (the whole vocabulary): loss = logsumexp(row) - row[label] into out0, and the
    row <- softmax - onehot. MODE 1 (vocab-parallel pass 1): the slice's max, sum of
    exp(logit - max) and target logit (0 when another slice holds it) into out0..out2.
    MODE 2 (pass 2): the row <- softmax - onehot with the whole vocabulary's log-sum-exp
    from lse_in (the onehot only where this slice holds the label)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    local = tl.load(labels + row) - vocab_start
    lanes = tl.arange(0, BLOCK)
    if MODE == 2:
        lse = tl.load(lse_in + row)
    else:
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
        row_sum = tl.sum(run_sum * tl.exp(run_max - row_max), axis=0)
        inside = (local >= 0) & (local < vocab)
        target = tl.where(inside, tl.load(base + tl.where(inside, local, 0)).to(tl.float32), 0.0)
        lse = row_max + tl.log(row_sum)
        if MODE == 1:
            tl.store(out0 + row, row_max)
            tl.store(out1 + row, row_sum)
            tl.store(out2 + row, target)
        else:
            tl.store(out0 + row, lse - target)
    if MODE != 1:
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            valid = offs < vocab
            x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(offs == local, 1.0, 0.0)
            tl.store(base + offs, grad.to(logits.dtype.element_ty), mask=valid)


def _kernel():
    return jitted(_rows_source, INTERPRET_ON_CPU)


def available(device: torch.device) -> bool:
    """Whether the kernel can run on `device` (CUDA, or the CPU interpreter in tests)."""
    return runs_on(device, INTERPRET_ON_CPU)


def loss_and_grad_rows_(logits_2d: torch.Tensor, labels_1d: torch.Tensor) -> torch.Tensor:
    """Per-row fp32 loss of [rows, vocab] logits; the logits are overwritten with
    softmax - onehot(label) in their own dtype."""
    rows, vocab = logits_2d.shape
    if logits_2d.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    losses = torch.empty(rows, dtype=torch.float32, device=logits_2d.device)
    if rows:
        _kernel()[(rows,)](logits_2d, labels_1d.contiguous(), losses, losses, losses, losses,
                           vocab, logits_2d.stride(0), 0, MODE=0, BLOCK=BLOCK,
                           num_warps=_NUM_WARPS)
    return losses


def vocab_parallel_loss_and_grad_rows_(logits_2d: torch.Tensor, labels_1d: torch.Tensor,
                                       vocab_start: int, group) -> torch.Tensor:
    """`loss_and_grad_rows_` for this rank's vocabulary slice [rows, vocab/tp] starting at
    `vocab_start`: three all-reduces of one number per row (max, rescaled sum, target
    logit) over `group` between the two passes."""
    rows, vocab = logits_2d.shape
    if logits_2d.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    stats = torch.empty(3, rows, dtype=torch.float32, device=logits_2d.device)
    labels_1d = labels_1d.contiguous()
    kernel = _kernel()
    if rows:
        kernel[(rows,)](logits_2d, labels_1d, stats[0], stats[0], stats[1], stats[2], vocab,
                        logits_2d.stride(0), vocab_start, MODE=1, BLOCK=BLOCK,
                        num_warps=_NUM_WARPS)
    local_max = stats[0].clone()
    torch.distributed.all_reduce(stats[0], op=torch.distributed.ReduceOp.MAX, group=group)
    stats[1].mul_(torch.exp(local_max - stats[0]))  # every rank's sum at the global max
    torch.distributed.all_reduce(stats[1:], group=group)  # sums and target logits
    lse = stats[0] + torch.log(stats[1])
    if rows:
        kernel[(rows,)](logits_2d, labels_1d, lse, lse, lse, lse, vocab, logits_2d.stride(0),
                        vocab_start, MODE=2, BLOCK=BLOCK, num_warps=_NUM_WARPS)
    return lse - stats[2]


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [s, b] (fp32) of x [s, b, h] through weight [vocab/tp, h].

    With tensor parallelism each rank holds a slice of the vocabulary, like the column-
    parallel output layer: the input grad is summed over the group (all-reduce, or
    reduce-scatter along the sequence with sequence parallelism, whose [s/tp, b, h] input
    is all-gathered in the forward and again in the backward), and that collective is in
    flight while the weight-grad GEMM runs."""

    @staticmethod
    def forward(ctx, x_sbh, weight, labels_sb, gradient_accumulation_fusion: bool,
                sequence_parallel: bool = False, group=None):
        tp = group_size(group)
        ctx.sequence_parallel = sequence_parallel and tp > 1
        ctx.group, ctx.tp = group, tp
        total_x = all_gather_dim0(x_sbh, group) if ctx.sequence_parallel else x_sbh
        s, b, h = total_x.shape
        x_2d = total_x.reshape(s * b, h)
        logits = gemm_algos.linear_forward(x_2d, weight)
        labels = labels_sb.reshape(s * b)
        if tp > 1:
            vocab_start = group_rank(group) * weight.shape[0]
            losses = vocab_parallel_loss_and_grad_rows_(logits, labels, vocab_start, group)
        else:
            losses = loss_and_grad_rows_(logits, labels)
        ctx.save_for_backward(x_sbh if ctx.sequence_parallel else x_2d, weight, logits)
        ctx.fusion = gradient_accumulation_fusion
        ctx.shape = (s, b, h)
        return losses.view(s, b)

    @staticmethod
    def backward(ctx, grad_losses):
        x_saved, weight, grad_logits = ctx.saved_tensors  # grad_logits: softmax - onehot
        gather = None
        if ctx.sequence_parallel:
            total_x, gather = all_gather_dim0(x_saved, ctx.group, async_op=True)
        scale = grad_losses.reshape(-1, 1).float()
        grad_x, reduce = None, None
        if ctx.needs_input_grad[0]:
            grad_x = (gemm_algos.linear_dgrad(grad_logits, weight).float() * scale).to(x_saved.dtype)
            grad_x = grad_x.view(ctx.shape)
            if ctx.sequence_parallel:
                grad_x, reduce = reduce_scatter_dim0(grad_x, ctx.group, async_op=True)
            elif ctx.tp > 1:
                reduce = torch.distributed.all_reduce(grad_x, group=ctx.group, async_op=True)
        if gather is not None:
            gather.wait()
            x_saved = total_x.reshape(-1, ctx.shape[2])
        grad_weight = None
        if ctx.needs_input_grad[1] and x_saved.dtype == torch.float16:
            grad_weight = _fp16_weight_grad(grad_logits, x_saved, scale, weight, ctx.fusion)
        elif ctx.needs_input_grad[1]:  # runs while the input-grad collective is in flight
            x_scaled = (x_saved.float() * scale).to(x_saved.dtype)
            if ctx.fusion and hasattr(weight, "main_grad"):
                accumulate_weight_grad(weight.main_grad, grad_logits, x_scaled)
            else:
                grad_weight = grad_logits.t().matmul(x_scaled)
        if reduce is not None:
            reduce.wait()
        return grad_x, grad_weight, None, None, None, None


def _fp16_weight_grad(grad_logits: torch.Tensor, x_2d: torch.Tensor, scale: torch.Tensor,
                      weight: torch.Tensor, fusion: bool) -> Optional[torch.Tensor]:
    """G^T (c x) for fp16 activations: c (per token) carries the loss scale, which can
    push c x past fp16's range where the gradient itself is fine. So x is scaled by c / p,
    p the power of two at or above max |c| (exact, and |c / p| <= 1), the product is taken
    with fp32 output and multiplied by p, then added into `weight.main_grad` (written over
    it when the grad buffer left it stale) or returned. All on the device: no sync."""
    top = scale.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    p = torch.exp2(torch.ceil(torch.log2(top)))
    x_scaled = (x_2d.float() * (scale / p)).to(torch.float16)
    if grad_logits.is_cuda:
        product = torch.mm(grad_logits.t(), x_scaled, out_dtype=torch.float32)
    else:
        product = grad_logits.t().float() @ x_scaled.float()
    product.mul_(p)
    if not (fusion and hasattr(weight, "main_grad")):
        return product.to(weight.dtype)
    if stale_grads.take(weight.main_grad):
        weight.main_grad.copy_(product)
    else:
        weight.main_grad.add_(product)
    return None


def linear_cross_entropy(x_sbh: torch.Tensor, weight: torch.Tensor, labels_sb: torch.Tensor,
                         gradient_accumulation_fusion: bool = False,
                         sequence_parallel: bool = False, group=None) -> torch.Tensor:
    """Per-token loss [s, b] in fp32 of logits x W^T against labels; with a tensor-
    parallel `group`, W is this rank's vocabulary slice (see LinearCrossEntropy)."""
    return LinearCrossEntropy.apply(x_sbh, weight, labels_sb, gradient_accumulation_fusion,
                                    sequence_parallel, group)


def use_fused(kernel: str, device: torch.device, fp16_lm_cross_entropy: bool,
              dtype: torch.dtype = torch.bfloat16) -> Optional[str]:
    """None when `--cross-entropy-kernel KERNEL` runs this kernel here, else why not."""
    if kernel == "torch":
        return "--cross-entropy-kernel torch"
    if fp16_lm_cross_entropy:
        return "--fp16-lm-cross-entropy computes the loss in 16 bits"
    if not available(device):
        return "Triton cannot run on this device"
    return None
