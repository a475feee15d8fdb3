"""Run one rank's schedule plan (see `schedules.py`): forwards, backwards and transfers.

The executor knows nothing about GPT. It is given the model chunks of this rank and a
`forward_step(chunk, microbatch, input_sbh)` callable that returns the chunk's output
activation, or, on the last virtual stage, the micro-batch's scalar loss. It keeps the
input and output of every forward until its backward (that is the activation memory a
schedule holds; `ScheduleResult.max_in_flight` counts it).

Gradients: on the last virtual stage the backward starts from
`scale_loss(loss / num_microbatches)`; elsewhere from the gradient received from the next
stage. The received input is a leaf with requires_grad, so its `.grad` after the backward
is what goes back to the previous stage. Every backward but the last of each chunk runs
inside the chunk's `no_sync()` (when it has one), so data-parallel gradient reduction
starts only once that chunk's gradients are complete; so does the forward of each of those
micro-batches, as in Megatron-LM: torch's DistributedDataParallel (`--DDP-impl torch`)
decides in the forward whether the backward after it all-reduces.

Watching: with a `watch` hook the executor runs every action inside the context manager
the hook returns for it (a wait is given with the transfers of its batch in `ops`), so a
driver can put each forward, backward and wait for transfers under its collective
watchdog. `action_phase` and `transfer_name` name them for its messages; a transfer has
the same name at both of its ends.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Dict, Optional, Sequence, Tuple

import torch

from megatron.core.timing import TimerHook, timer

from .p2p import P2PCommunicator, PendingBatch, timer_name
from .schedules import (
    BACKWARD,
    COMM,
    FORWARD,
    P2P,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    WAIT,
    Action,
)

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]
ActionWatch = Callable[[Action], ContextManager]


def _stage_label(stage: int, num_chunks: int) -> str:
    return f"{'virtual ' if num_chunks > 1 else ''}pipeline stage {stage}"


def transfer_name(op: P2P, pp_rank: int, pp_size: int, num_chunks: int = 1) -> str:
    """The transfer `op` of pipeline rank `pp_rank` takes part in, named the same at its
    two ends: 'micro-batch 2 activation from pipeline stage 0 to 1' (virtual stages when
    a rank holds several chunks)."""
    stage = op.chunk * pp_size + pp_rank
    if op.kind in (SEND_FORWARD, RECV_BACKWARD):
        src, dst = (stage, stage + 1) if op.kind == SEND_FORWARD else (stage + 1, stage)
    else:
        src, dst = (stage, stage - 1) if op.kind == SEND_BACKWARD else (stage - 1, stage)
    what = "activation" if op.kind in (SEND_FORWARD, RECV_FORWARD) else "gradient"
    return f"micro-batch {op.microbatch} {what} from {_stage_label(src, num_chunks)} to {dst}"


def action_phase(a: Action, pp_rank: int, pp_size: int, num_chunks: int = 1) -> str:
    """What action `a` of pipeline rank `pp_rank` does, for messages: 'micro-batch 3
    forward (pipeline stage 1)' (no stage when pp_size is 1), 'pipeline transfers
    (micro-batch 2 activation from pipeline stage 0 to 1, ...)' for a comm or a wait
    given with its batch's ops."""
    if a.kind in (FORWARD, BACKWARD):
        where = (f" ({_stage_label(a.chunk * pp_size + pp_rank, num_chunks)})"
                 if pp_size > 1 else "")
        return f"micro-batch {a.microbatch} {a.kind}{where}"
    names = ", ".join(transfer_name(op, pp_rank, pp_size, num_chunks) for op in a.ops)
    return f"pipeline transfers ({names})"


@dataclass
class ScheduleResult:
    """loss_sum: sum of the micro-batch losses (0-dim fp32) when this rank holds the last
    virtual stage, else None. max_in_flight: most micro-batches whose activations were
    held at once (forward done, backward not yet)."""

    loss_sum: Optional[torch.Tensor]
    max_in_flight: int


class ScheduleExecutor:
    """Executes a plan for the `chunks` of pipeline rank `pp_rank` of `pp_size`.

    Args:
        chunks: this rank's model chunks (chunk c is virtual stage c * pp_size + pp_rank);
            only their optional `no_sync()` context manager is used here.
        forward_step: see module doc.
        comm: the P2PCommunicator (None when pp_size == 1).
        num_microbatches: the divisor of every micro-batch loss.
        scale_loss: applied to the divided loss before backward (the loss scaler).
        forward_only: evaluation: no backward, nothing kept for one.
        timers: the timer hook (megatron/core/timing.py; None: untimed) for Megatron's
            level-2 timers: `forward-compute` and `backward-compute` around each forward
            and backward, and around the posting and the waiting of each batch of
            transfers the timer that `p2p.timer_name` names by its kinds
            (`forward-send-backward-recv`, ...).
        watch: see the module doc (None: no hook is called).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], forward_step: ForwardStep,
                 comm: Optional[P2PCommunicator], pp_rank: int, pp_size: int,
                 num_microbatches: int, scale_loss: Callable = lambda x: x,
                 forward_only: bool = False, device=None,
                 timers: Optional[TimerHook] = None,
                 watch: Optional[ActionWatch] = None) -> None:
        self.chunks = list(chunks)
        self.forward_step = forward_step
        self.comm = comm
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.num_stages = pp_size * len(self.chunks)
        self.num_microbatches = num_microbatches
        self.scale_loss = scale_loss
        self.forward_only = forward_only
        self.device = device
        self.timers = timers
        self.watch = watch

    def _timer(self, name: str):
        return timer(self.timers, name, 2)

    def _stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def run(self, plan: Sequence[Action]) -> ScheduleResult:
        """Execute `plan` (one rank's actions, in order)."""
        self._last_backward = {a.chunk: a.microbatch for a in plan if a.kind == BACKWARD}
        self._saved: Dict[tuple, tuple] = {}  # (chunk, mb) -> (input, output)
        self._to_send: Dict[tuple, torch.Tensor] = {}
        self._received: Dict[tuple, torch.Tensor] = {}
        # batch -> (its timer, its transfers in flight, its ops)
        self._pending: Dict[int, Tuple[str, PendingBatch, tuple]] = {}
        self._loss_sum = None
        if self.num_stages - 1 in [self._stage(c) for c in range(len(self.chunks))]:
            self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        in_flight = 0
        for a in plan:
            if self.watch is None:
                self._run_action(a)
            else:
                watched = replace(a, ops=self._pending[a.batch][2]) if a.kind == WAIT else a
                with self.watch(watched):
                    self._run_action(a)
            in_flight = max(in_flight, len(self._saved))
        leftovers = [k for k in (*self._saved, *self._to_send, *self._received, *self._pending)]
        assert not leftovers, f"plan left work undone: {leftovers}"
        return ScheduleResult(self._loss_sum, in_flight)

    def _run_action(self, a: Action) -> None:
        if a.kind == FORWARD:
            self._forward(a.microbatch, a.chunk)
        elif a.kind == BACKWARD:
            self._backward(a.microbatch, a.chunk)
        elif a.kind == COMM:
            self._post(a)
        elif a.kind == WAIT:
            name, batch, _ = self._pending.pop(a.batch)
            timer = self._timer(name)
            timer.start()
            self._received.update(batch.wait())
            timer.stop()
        else:
            raise ValueError(f"unknown action {a}")

    def _post(self, a: Action) -> None:
        """Post one batch of transfers. Its timer runs while posting and, later, while
        waiting for it (see `p2p.timer_name`), not during the computes in between."""
        name = timer_name(a.ops)
        timer = self._timer(name)
        timer.start()
        sends = {k: self._to_send.pop(k) for k in
                 [(op.kind, op.microbatch, op.chunk) for op in a.ops] if k in self._to_send}
        self._pending[a.batch] = (name, self.comm.post(a.ops, sends), a.ops)
        timer.stop()

    def _forward(self, mb: int, chunk: int) -> None:
        stage = self._stage(chunk)
        x = None
        if stage > 0:
            x = self._received.pop((RECV_FORWARD, mb, chunk))
            if not self.forward_only:
                x.requires_grad_(True)
        timer = self._timer("forward-compute")
        timer.start()
        with self._no_sync(chunk, mb):
            out = self.forward_step(chunk, mb, x)
        timer.stop()
        if stage == self.num_stages - 1:
            self._loss_sum += out.detach()
        else:
            self._to_send[(SEND_FORWARD, mb, chunk)] = out
        if not self.forward_only:
            self._saved[(chunk, mb)] = (x, out)

    def _no_sync(self, chunk: int, mb: int):
        """The chunk's `no_sync()` unless micro-batch `mb` has the chunk's last backward
        (or nothing follows: forward only, or the chunk has no `no_sync`)."""
        no_sync = getattr(self.chunks[chunk], "no_sync", None)
        last = self._last_backward.get(chunk, mb) == mb
        return contextlib.nullcontext() if last or no_sync is None else no_sync()

    def _backward(self, mb: int, chunk: int) -> None:
        stage = self._stage(chunk)
        x, out = self._saved.pop((chunk, mb))
        timer = self._timer("backward-compute")
        timer.start()
        with self._no_sync(chunk, mb):
            if stage == self.num_stages - 1:
                torch.autograd.backward(self.scale_loss(out / self.num_microbatches))
            else:
                grad = self._received.pop((RECV_BACKWARD, mb, chunk))
                torch.autograd.backward(out, grad_tensors=grad)
        timer.stop()
        if stage > 0:
            self._to_send[(SEND_BACKWARD, mb, chunk)] = x.grad
