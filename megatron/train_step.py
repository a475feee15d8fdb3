"""One training step, top to bottom: micro-batches -> pipeline schedule (forward/backward)
-> finish the data-parallel gradient reduction -> tied-embedding and sequence-parallel
grad all-reduces -> optimizer step (may skip) -> lr step.

`tr` is the `Trainer` of `megatron.training` (config, runtime, model, optimizer, scheduler).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed import allreduce_sequence_parallel_grads
from megatron.core.models.gpt.stages import allreduce_tied_embedding_grads
from megatron.core.pipeline_parallel import (
    P2PCommunicator,
    ScheduleExecutor,
    build_schedule,
    tensor_shape,
    unwrap,
)
from megatron.data_loading import get_batch


# --------------------------------------------------------------------------- one step
class _MicroBatchFeed:
    """Micro-batches for the chunk that needs data on this rank (the first and/or last
    pipeline stage), read from the iterator in order, one per micro-batch."""

    def __init__(self, data: Iterator[dict], device: torch.device, eod, flags) -> None:
        self.data, self.device, self.next = data, device, 0
        self.eod, self.flags = eod, flags

    def get(self, microbatch: int) -> dict:
        assert microbatch == self.next, f"micro-batch {microbatch} asked, {self.next} due"
        self.next += 1
        return get_batch(next(self.data), self.device, self.eod, self.flags)


def _forward_step(chunks, feed: _MicroBatchFeed):
    """forward_step(chunk, microbatch, input_sbh) for the executor: the chunk's output
    activation, or on the last stage the micro-batch loss (masked mean, fp32)."""
    modules = [unwrap(c) for c in chunks]

    def step(c: int, microbatch: int, input_sbh):
        model, module = chunks[c], modules[c]
        b = dict.fromkeys(("tokens", "labels", "loss_mask", "position_ids", "attention_mask"))
        if module.pre_process or module.post_process:
            b = feed.get(microbatch)
        module.set_input_tensor(input_sbh)
        out = model(b["tokens"], position_ids=b["position_ids"],
                    labels=b["labels"] if module.post_process else None,
                    attention_mask=b["attention_mask"])
        module.set_input_tensor(None)
        if not module.post_process:
            return out
        return (out.float() * b["loss_mask"]).sum() / b["loss_mask"].sum()

    return step


def _p2p_communicator(tr) -> Optional[P2PCommunicator]:
    ps, m = tr.rt.ps, tr.config.model
    if ps.pp_size == 1:
        return None
    shape = tensor_shape(tr.config.data.seq_length, tr.config.data.micro_batch_size,
                         m.hidden_size, ps.tp_size, m.sequence_parallel)
    dtype = torch.float32 if m.fp32_residual_connection else m.params_dtype
    return P2PCommunicator(ps.ranks("pp"), shape, dtype, tr.rt.device, ps.pp_group)


def model_chunks(tr) -> list:
    """This rank's model chunks (a list even when `tr.model` is a single wrapper)."""
    return list(tr.model) if isinstance(tr.model, torch.nn.ModuleList) else [tr.model]


def forward_backward(tr, data: Iterator[dict], num_micro: int,
                     forward_only: bool = False) -> torch.Tensor:
    """Run the micro-batches through this rank's pipeline schedule (plain gradient
    accumulation when pp == 1, 1F1B, or interleaved 1F1B with virtual stages); returns
    the mean loss over them (a 0-dim tensor, this DP replica). Each micro-batch loss is
    divided by num_micro before backward. With pp > 1 the loss, computed on the last
    stage, is broadcast over the pipeline group so that every rank returns it."""
    ps = tr.rt.ps
    chunks = model_chunks(tr)
    plan = build_schedule(ps.pp_size, num_micro, len(chunks), forward_only,
                          tr.config.parallel.overlap_p2p_comm)[ps.pp_rank]
    executor = ScheduleExecutor(
        chunks, _forward_step(chunks, _MicroBatchFeed(data, tr.rt.device, tr.eod, tr.config.data)),
        _p2p_communicator(tr), ps.pp_rank, ps.pp_size, num_micro,
        scale_loss=tr.optimizer.scale_loss, forward_only=forward_only, device=tr.rt.device)
    result = executor.run(plan)
    if result.loss_sum is None:
        loss = torch.zeros((), dtype=torch.float32, device=tr.rt.device)
    else:
        loss = result.loss_sum / num_micro
    if ps.pp_size > 1:
        dist.broadcast(loss, src=ps.ranks("pp")[-1], group=ps.pp_group)
    return loss


def _watch(tr, name: str, group_kind: str):
    """Name the ranks that never arrive if this collective hangs (see megatron/watchdog)."""
    wd = getattr(tr, "watchdog", None)
    if wd is None:
        return contextlib.nullcontext()
    return wd.watch(name, ranks=tr.rt.ps.ranks(group_kind))


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
    with _watch(tr, "gradient reduction (data-parallel group)", "dp"):
        tr.model.finish_grad_sync()
    allreduce_tied_embedding_grads(model_chunks(tr), tr.rt.ps)  # pp > 1: first + last stage
    if cfg.model.sequence_parallel:
        allreduce_sequence_parallel_grads(tr.model, tr.rt.ps.tp_group)
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


