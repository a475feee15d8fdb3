"""Cross entropy over vocabulary-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the vocabulary, [..., V/tp]. The
loss needs three numbers per token that involve the whole vocabulary; each is reduced
over the TP group with one all-reduce:
  1. the max logit (all-reduce MAX), subtracted for numerical stability;
  2. the target's logit (all-reduce SUM; only the rank owning the target contributes);
  3. sum(exp(logit - max)) (all-reduce SUM).
loss = log(sum_exp) - target_logit. Backward needs no communication: the grad of the
local logits is softmax - one_hot(target) restricted to the local slice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import group_rank, group_size
from .utils import vocab_range_from_per_partition_vocab_size


def _all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: 3 all-reduces (max, target logit, sum-exp) over `group`.
    Backward: none (local softmax - one_hot)."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, group, label_smoothing):
        logits = vocab_parallel_logits.float()  # fp32 copy (or the fp32 input itself)
        logits_max = logits.max(dim=-1)[0]
        _all_reduce_(logits_max, group, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)  # new tensor: the input is not modified

        partition_vocab_size = logits.size(-1)
        vocab_start, vocab_end = vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, group_rank(group)
        )
        target_outside = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(target_outside, 0)
        predicted_logits = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted_logits = predicted_logits.masked_fill(target_outside, 0.0)
        _all_reduce_(predicted_logits, group)

        # Label smoothing needs sum_v (logit_v - max), taken before exp_ reuses the storage.
        sum_shifted = logits.sum(dim=-1) if label_smoothing > 0.0 else None
        exp_logits = logits.exp_()  # reuse the shifted logits' storage
        sum_exp_logits = exp_logits.sum(dim=-1)
        _all_reduce_(sum_exp_logits, group)
        loss = torch.log(sum_exp_logits) - predicted_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))

        vocab_size = partition_vocab_size * group_size(group)
        if label_smoothing > 0.0:
            # torch's convention: target distribution (1 - eps) * one_hot + eps / V.
            # -mean_v log p_v = log(sum_exp) - mean_v (logit_v - max) over the full vocab.
            _all_reduce_(sum_shifted, group)
            smooth_loss = torch.log(sum_exp_logits) - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth_loss

        ctx.save_for_backward(softmax, target_outside, local_target)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.input_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_outside, local_target = ctx.saved_tensors
        grad = softmax  # saved for this single use: modify in place
        on_rank = (~target_outside).to(grad.dtype)
        eps = ctx.label_smoothing
        grad.scatter_add_(
            -1, local_target.unsqueeze(-1), -(1.0 - eps) * on_rank.unsqueeze(-1)
        )
        if eps > 0.0:
            grad.sub_(eps / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, group=None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary over `group`.

    vocab_parallel_logits: [..., V/tp], any float dtype (computed in fp32); rank r holds
    vocabulary ids [r*V/tp, (r+1)*V/tp). target: [...] int64 global ids. Returns the
    per-token loss [...] in fp32 (no reduction), equal to
    torch.nn.functional.cross_entropy(full_logits, target, reduction="none",
    label_smoothing=label_smoothing). The logits grad comes back in the logits' dtype.
    Collectives: forward 3 all-reduces (4 with label smoothing); backward none.
    The full vocabulary is never gathered.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
            f"{tuple(target.shape)}; logits must be [..., V/tp] for target [...]"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group,
                                            label_smoothing)
