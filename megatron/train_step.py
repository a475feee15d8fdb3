"""One training step, top to bottom: micro-batches -> forward/backward -> finish the
data-parallel gradient reduction -> sequence-parallel grad all-reduce -> optimizer step
(may skip) -> lr step.

`tr` is the `Trainer` of `megatron.training` (config, runtime, model, optimizer, scheduler).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron.core.distributed import allreduce_sequence_parallel_grads


def get_batch(micro: dict, device: torch.device):
    """tokens, labels [b, s] and loss mask from a {'text': [b, s+1]} micro-batch."""
    text = micro["text"].to(device, non_blocking=True)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    return tokens, labels, loss_mask


# --------------------------------------------------------------------------- one step
def forward_backward(tr, data: Iterator[dict], num_micro: int,
                     forward_only: bool = False) -> torch.Tensor:
    """Run the micro-batches; returns the mean loss over them (a 0-dim tensor, this DP
    rank). Each micro-batch loss is divided by num_micro before backward."""
    model, device = tr.model, tr.rt.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for m in range(num_micro):
        tokens, labels, loss_mask = get_batch(next(data), device)
        last = forward_only or m == num_micro - 1
        with contextlib.nullcontext() if last else model.no_sync():
            losses_bs = model(tokens, labels=labels)
            loss = (losses_bs.float() * loss_mask).sum() / loss_mask.sum()
            if not forward_only:
                tr.optimizer.scale_loss(loss / num_micro).backward()
        total += loss.detach()
    return total / num_micro


def loss_is_finite_everywhere(loss: torch.Tensor) -> bool:
    """True when no rank saw a NaN/Inf loss. Collective (MAX over the world) and a host
    synchronisation: used only when the NaN policy must act before the optimizer step."""
    bad = (~torch.isfinite(loss)).to(torch.float32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def train_step(tr, data: Iterator[dict], skip_nonfinite: bool = False):
    """One optimizer step over a global batch. Returns (dp-averaged loss tensor,
    update_successful, grad_norm tensor or None, num_zeros). With `skip_nonfinite`, a
    NaN/Inf loss on any rank skips the optimizer step (all ranks agree)."""
    cfg = tr.config
    tr.optimizer.zero_grad()
    tr.model.zero_grad_buffer()
    loss = forward_backward(tr, data, cfg.data.num_micro_batches)
    tr.model.finish_grad_sync()
    if cfg.model.sequence_parallel:
        allreduce_sequence_parallel_grads(tr.model.module, tr.rt.ps.tp_group)
    tr.last_local_loss = loss.detach().clone()  # this rank's own loss, to name a NaN's origin
    if tr.rt.ps.dp_group is not None:
        dist.all_reduce(loss, group=tr.rt.ps.dp_group)
        loss /= tr.rt.ps.dp_size
    if skip_nonfinite and not loss_is_finite_everywhere(loss):
        return loss, False, None, None
    ok, grad_norm, num_zeros = tr.optimizer.step()
    if ok:
        tr.scheduler.step(increment=cfg.data.global_batch_size)
    return loss, ok, grad_norm, num_zeros


