"""Point-to-point transfers between neighbouring pipeline stages.

Every transfer between stages is a tensor of one shape known before the step starts:
[s, b, h] activations forward and their gradients backward ([s/tp, b, h] with sequence
parallelism), of the params dtype (fp32 with --fp32-residual-connection). So no shape is
exchanged per micro-batch: the receiver allocates the buffer and posts the receive.

All transfers posted together go through one `torch.distributed.batch_isend_irecv`
call (works on gloo and NCCL); the plan of `schedules.py` says which go together and when
to wait. Peers are pipeline ranks (0..pp-1); they are mapped to global ranks through the
pipeline group of this rank.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .schedules import P2P, RECV_BACKWARD, RECV_FORWARD, SEND_BACKWARD, SEND_FORWARD

# Megatron's level-2 timer of each combination of transfer kinds in one batch. A batch
# holding three or four kinds (or both sends, or both receives) is what Megatron's
# send_forward_backward_recv_forward_backward does.
_TIMER_NAMES = {
    frozenset({RECV_FORWARD}): "forward-recv",
    frozenset({SEND_FORWARD}): "forward-send",
    frozenset({RECV_BACKWARD}): "backward-recv",
    frozenset({SEND_BACKWARD}): "backward-send",
    frozenset({SEND_FORWARD, RECV_FORWARD}): "forward-send-forward-recv",
    frozenset({SEND_FORWARD, RECV_BACKWARD}): "forward-send-backward-recv",
    frozenset({SEND_BACKWARD, RECV_FORWARD}): "backward-send-forward-recv",
    frozenset({SEND_BACKWARD, RECV_BACKWARD}): "backward-send-backward-recv",
}
BOTH_WAYS_TIMER = "forward-backward-send-forward-backward-recv"


def timer_name(ops: Sequence[P2P]) -> str:
    """Megatron's timer for one batch of transfers, named by the kinds it holds: the
    name of Megatron's p2p function that does the same exchange (forward-send,
    forward-send-backward-recv, ...)."""
    return _TIMER_NAMES.get(frozenset(op.kind for op in ops), BOTH_WAYS_TIMER)


def tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int,
                 tp_size: int = 1, sequence_parallel: bool = False) -> Tuple[int, int, int]:
    """Shape of what flows between stages: [s, b, h], or [s/tp, b, h] under SP."""
    if sequence_parallel:
        if seq_length % tp_size:
            raise ValueError(f"sequence length {seq_length} is not divisible by the tensor-"
                             f"parallel size {tp_size} (needed by --sequence-parallel)")
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


class PendingBatch:
    """Transfers of one `batch_isend_irecv` call. `wait()` blocks until all are done and
    returns the received tensors by (recv kind, microbatch, chunk)."""

    def __init__(self, works: list, received: Dict[tuple, torch.Tensor],
                 keep_alive: List[torch.Tensor], sync_cuda: bool) -> None:
        self.works = works
        self.received = received
        self._keep_alive = keep_alive  # send buffers must live until the send is done
        self._sync_cuda = sync_cuda
        self.done = False

    def wait(self) -> Dict[tuple, torch.Tensor]:
        if not self.done:
            for work in self.works:
                work.wait()
            if self._sync_cuda:
                # As Megatron-LM does after batched p2p: guards against a race between
                # batch_isend_irecv on its own stream and the next kernels.
                torch.cuda.synchronize()
            self._keep_alive = []
            self.done = True
        return self.received


class P2PCommunicator:
    """Posts batches of sends/receives to the neighbouring pipeline stages.

    Args:
        pp_ranks: global ranks of this rank's pipeline group, in stage order.
        shape, dtype, device: of every transferred tensor.
        group: the pipeline process group (None only when pp_size == 1).
    """

    def __init__(self, pp_ranks: Sequence[int], shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, group=None) -> None:
        self.pp_ranks = list(pp_ranks)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = group

    def post(self, ops: Sequence[P2P], tensors: Dict[tuple, torch.Tensor]) -> PendingBatch:
        """Start the transfers `ops` in one batch_isend_irecv call.

        `tensors` maps (send kind, microbatch, chunk) to the tensor to send. Receive
        buffers are allocated here. Collective with the peers (each posts the matching
        operations in the same order; the schedule guarantees it)."""
        p2p_ops, received, keep = [], {}, []
        for op in ops:
            peer = self.pp_ranks[op.peer]
            key = (op.kind, op.microbatch, op.chunk)
            if op.kind in (SEND_FORWARD, SEND_BACKWARD):
                t = self._check(tensors[key], op)
                keep.append(t)
                p2p_ops.append(dist.P2POp(dist.isend, t, peer, self.group))
            elif op.kind in (RECV_FORWARD, RECV_BACKWARD):
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[key] = buf
                p2p_ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
            else:
                raise ValueError(f"not a point-to-point operation: {op}")
        works = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
        return PendingBatch(works, received, keep, self.device.type == "cuda")

    def _check(self, t: Optional[torch.Tensor], op: P2P) -> torch.Tensor:
        if t is None:
            raise RuntimeError(f"nothing to send for {op}")
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(
                f"{op.kind} of micro-batch {op.microbatch} has shape {tuple(t.shape)} and "
                f"dtype {t.dtype}, but stages exchange {self.shape} {self.dtype}; every "
                "micro-batch must have the configured --micro-batch-size and --seq-length")
        return t.detach().contiguous()
