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

from typing import Optional

import torch
import torch.distributed as dist

from .mappings import TP_GROUP_OF_STATE, group_rank, group_size, resolve_tp_group
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
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, group=TP_GROUP_OF_STATE,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross entropy of logits split along the vocabulary over `group`.

    vocab_parallel_logits: [..., V/tp], any float dtype (computed in fp32); rank r holds
    vocabulary ids [r*V/tp, (r+1)*V/tp). target: [...] int64 global ids. Returns the
    per-token loss [...] in fp32 (no reduction), equal to
    torch.nn.functional.cross_entropy(full_logits, target, reduction="none",
    label_smoothing=label_smoothing). The logits grad comes back in the logits' dtype.
    Collectives: forward 3 all-reduces (4 with label smoothing); backward none.
    The full vocabulary is never gathered. Without `group`: the tensor-parallel group of
    `initialize_model_parallel`, as in Megatron-LM (`mappings.resolve_tp_group`); None is
    one process.
    """
    if isinstance(group, (int, float)):  # Megatron's third positional is label_smoothing
        raise TypeError(
            f"vocab_parallel_cross_entropy(logits, target, {group!r}): the third argument is "
            "the tensor-parallel group here (Megatron-LM's is label_smoothing): pass "
            f"label_smoothing={group!r} by name, and group=get_tensor_model_parallel_group() "
            "when the logits are split over tensor-parallel ranks")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
            f"{tuple(target.shape)}; logits must be [..., V/tp] for target [...]"
        )
    group = resolve_tp_group(group, "vocab_parallel_cross_entropy(group=...)")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group,
                                            label_smoothing)



def mask_vocab_padding(vocab_parallel_logits: torch.Tensor, group=None,
                       vocab_limit: Optional[int] = None) -> torch.Tensor:
    """fp32 logits [..., V/tp] with the ids at or above `vocab_limit` (the padding rows of
    a padded vocabulary) set to -inf, so that neither a softmax nor an argmax sees them;
    the input itself when nothing is padded (None: nothing). No communication."""
    logits = vocab_parallel_logits.float()
    start, end = vocab_range_from_per_partition_vocab_size(logits.size(-1), group_rank(group))
    if vocab_limit is None or vocab_limit >= end:
        return logits
    if logits is vocab_parallel_logits:
        logits = logits.clone()
    logits[..., max(vocab_limit - start, 0):] = float("-inf")
    return logits


@torch.no_grad()
def vocab_parallel_argmax(vocab_parallel_logits: torch.Tensor, group=None,
                          vocab_limit: Optional[int] = None) -> torch.Tensor:
    """Global id of the largest logit per token, for logits split along the vocabulary.

    vocab_parallel_logits: [..., V/tp] (rank r holds ids [r*V/tp, (r+1)*V/tp)). Only ids
    below `vocab_limit` (the tokenizer's vocabulary; None: all) can win, so the padding rows
    of a padded vocabulary never do. Ties go to the lowest id, as torch.argmax over the
    gathered logits would. Returns [...] int64, the same on every rank of `group`.
    Collectives: 2 all-reduces over `group` (MAX of the values, MIN of the winning ids);
    no autograd. The full vocabulary is never gathered.
    """
    logits = mask_vocab_padding(vocab_parallel_logits, group, vocab_limit)
    start = logits.size(-1) * group_rank(group)
    local_max, local_arg = logits.max(dim=-1)
    global_max = _all_reduce_(local_max.clone(), group, dist.ReduceOp.MAX)
    # a rank whose best is not the global best offers an id larger than any real one
    none = torch.iinfo(torch.int64).max
    ids = torch.where(local_max == global_max, local_arg + start,
                      torch.full_like(local_arg, none))
    return _all_reduce_(ids, group, dist.ReduceOp.MIN)
