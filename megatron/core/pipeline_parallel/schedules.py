"""Pipeline schedules as data: for every pipeline rank, the list of actions it runs.

A schedule is built in two steps, both pure functions (no processes, no tensors):

1. the compute order of each rank: which (micro-batch, model chunk) it runs forward or
   backward, in what order (no pipelining, 1F1B, interleaved 1F1B);
2. the communication derived from it: before a compute that needs an activation (or a
   gradient) from a neighbour, a `comm` action posts the receive; after a compute whose
   result a neighbour needs, the next `comm` posts the send. Each `comm` is one
   `batch_isend_irecv` call; a `wait` action waits for one posted batch.

Virtual stages: chunk `c` of pipeline rank `r` is virtual stage `c * pp + r` of the model
(`pp * vpp` stages in all). Activations flow from virtual stage s to s + 1, gradients from
s + 1 back to s; so the last rank's chunk c sends to the first rank's chunk c + 1.

`simulate(plans)` runs the plans of all ranks against each other under a conservative
model of the transport (a send completes only when its receive is posted; each rank's
batches complete in the order they were posted, as on one NCCL stream) and checks that
every forward has its backward, every send meets the receive that expects exactly that
message, and nobody waits forever. The unit tests run it for many layouts; the executor
(`executor.py`) runs one rank's plan for real.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.core.megatron_names import core_getattr

FORWARD, BACKWARD, COMM, WAIT = "forward", "backward", "comm", "wait"
SEND_FORWARD, RECV_FORWARD = "send_forward", "recv_forward"
SEND_BACKWARD, RECV_BACKWARD = "send_backward", "recv_backward"


@dataclass(frozen=True)
class P2P:
    """One transfer seen from this rank: `kind` of (micro-batch, own chunk) with `peer`
    (a pipeline rank, never this rank)."""

    kind: str
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class Action:
    """forward/backward(microbatch, chunk) | comm(ops, batch) | wait(batch)."""

    kind: str
    microbatch: int = -1
    chunk: int = 0
    ops: Tuple[P2P, ...] = ()
    batch: int = -1


# --------------------------------------------------------------------------- compute order
def _one_f_one_b(forwards: Sequence[tuple], backwards: Sequence[tuple], warmup: int,
                 forward_only: bool, pair_steady: bool) -> List[List[Action]]:
    """`warmup` forwards, then alternate one forward / one backward, then the remaining
    backwards; forward-only: the forwards in order. Returned as slots (computes with no
    communication between them): one compute each, or with `pair_steady` each steady
    forward+backward pair in one slot."""
    if forward_only:
        return [[Action(FORWARD, m, c)] for m, c in forwards]
    slots = [[Action(FORWARD, m, c)] for m, c in forwards[:warmup]]
    steady = len(forwards) - warmup
    for i in range(steady):
        pair = [Action(FORWARD, *forwards[warmup + i]), Action(BACKWARD, *backwards[i])]
        slots.extend([pair] if pair_steady else [[a] for a in pair])
    slots.extend([Action(BACKWARD, m, c)] for m, c in backwards[steady:])
    return slots


def interleaved_chunk(step: int, pp_size: int, vpp_size: int, forward: bool) -> int:
    """Model chunk of micro-step `step` in the interleaved schedule (Megatron's rule):
    groups of pp micro-batches go through chunk 0, 1, ... (backward: ..., 1, 0)."""
    chunk = (step % (pp_size * vpp_size)) // pp_size
    return chunk if forward else vpp_size - 1 - chunk


def interleaved_microbatch(step: int, pp_size: int, vpp_size: int) -> int:
    """Micro-batch of micro-step `step` in the interleaved schedule."""
    return (step // (pp_size * vpp_size)) * pp_size + step % pp_size


def compute_slots(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                  forward_only: bool = False) -> List[List[Action]]:
    """The forward/backward actions of one rank, in order, grouped in slots (no
    communication inside a slot).

    pp = 1: no pipelining (F0 B0 F1 B1 ...). vpp = 1: 1F1B with pp - rank - 1 warm-up
    forwards (so at most pp micro-batches of activations are held), one compute per slot.
    vpp > 1: interleaved 1F1B over vpp chunks (needs num_microbatches % pp == 0); its
    steady state runs a forward and a backward per slot and exchanges both directions in
    one batch afterwards, as Megatron does: communicating between the two would make
    both neighbours send to each other at once, which deadlocks when a send waits for
    its receive (NCCL)."""
    _check_sizes(pp_size, pp_rank, num_microbatches, vpp_size)
    m = num_microbatches
    if vpp_size == 1:
        steps = [(i, 0) for i in range(m)]
        return _one_f_one_b(steps, steps, min(pp_size - pp_rank - 1, m), forward_only, False)
    total = m * vpp_size
    fwd = [(interleaved_microbatch(k, pp_size, vpp_size),
            interleaved_chunk(k, pp_size, vpp_size, True)) for k in range(total)]
    bwd = [(interleaved_microbatch(k, pp_size, vpp_size),
            interleaved_chunk(k, pp_size, vpp_size, False)) for k in range(total)]
    if m == pp_size:
        warmup = total
    else:
        warmup = min((pp_size - pp_rank - 1) * 2 + (vpp_size - 1) * pp_size, total)
    return _one_f_one_b(fwd, bwd, warmup, forward_only, True)


def compute_order(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                  forward_only: bool = False) -> List[Action]:
    """The forward/backward actions of one rank, in order (`compute_slots` flattened)."""
    slots = compute_slots(pp_size, pp_rank, num_microbatches, vpp_size, forward_only)
    return [a for slot in slots for a in slot]


def _check_sizes(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int) -> None:
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} outside pipeline of size {pp_size}")
    if num_microbatches < 1 or vpp_size < 1:
        raise ValueError(f"need >= 1 micro-batches and virtual stages, got {num_microbatches} "
                         f"and {vpp_size}")
    if vpp_size > 1 and pp_size == 1:
        raise ValueError(f"{vpp_size} virtual pipeline stages need a pipeline-model-parallel "
                         "size >= 2")
    if vpp_size > 1 and num_microbatches % pp_size:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) "
            f"to be a multiple of the pipeline-model-parallel size ({pp_size}); change "
            "--global-batch-size or --micro-batch-size")


# --------------------------------------------------------------------------- communication
def _transfers(a: Action, pp_size: int, pp_rank: int, vpp_size: int) -> tuple:
    """(receives needed before `a`, sends produced after `a`) as P2P tuples."""
    stage = a.chunk * pp_size + pp_rank
    last = pp_size * vpp_size - 1
    nxt, prev = (pp_rank + 1) % pp_size, (pp_rank - 1) % pp_size
    if a.kind == FORWARD:
        recv = (P2P(RECV_FORWARD, a.microbatch, a.chunk, prev),) if stage > 0 else ()
        send = (P2P(SEND_FORWARD, a.microbatch, a.chunk, nxt),) if stage < last else ()
    else:
        recv = (P2P(RECV_BACKWARD, a.microbatch, a.chunk, nxt),) if stage < last else ()
        send = (P2P(SEND_BACKWARD, a.microbatch, a.chunk, prev),) if stage > 0 else ()
    return recv, send


def add_communication(slots: Sequence[Sequence[Action]], pp_size: int, pp_rank: int,
                      vpp_size: int = 1, overlap: bool = False) -> List[Action]:
    """Insert `comm`/`wait` actions between one rank's compute slots.

    Between two slots one batch carries the sends of the first and the receives of the
    second (Megatron's combined send_forward_recv_backward etc.). Without `overlap`
    every batch is waited for at once. With `overlap` a batch that only sends is not
    waited for until a later wait (batches complete in order) or the end of the
    schedule, so the transfer runs while the next slot computes."""
    plan: List[Action] = []
    pending_sends: Tuple[P2P, ...] = ()
    unwaited: List[int] = []
    batch = 0
    for slot in slots:
        recvs: Tuple[P2P, ...] = ()
        sends: Tuple[P2P, ...] = ()
        for a in slot:
            recv, send = _transfers(a, pp_size, pp_rank, vpp_size)
            recvs, sends = recvs + recv, sends + send
        ops = pending_sends + recvs
        if ops:
            plan.append(Action(COMM, ops=ops, batch=batch))
            unwaited.append(batch)
            if recvs or not overlap:
                plan.extend(Action(WAIT, batch=b) for b in unwaited)
                unwaited.clear()
            batch += 1
        plan.extend(slot)
        pending_sends = sends
    if pending_sends:
        plan.append(Action(COMM, ops=pending_sends, batch=batch))
        unwaited.append(batch)
    plan.extend(Action(WAIT, batch=b) for b in unwaited)
    return plan


@functools.lru_cache(maxsize=64)
def build_schedule(pp_size: int, num_microbatches: int, vpp_size: int = 1,
                   forward_only: bool = False, overlap: bool = False
                   ) -> Tuple[Tuple[Action, ...], ...]:
    """The plan of every pipeline rank (index = pipeline rank). Cached: it is data."""
    vpp_size = vpp_size or 1
    if pp_size < 1:  # no rank would check it: an empty plan would train nothing
        raise ValueError(f"pipeline-model-parallel size {pp_size} must be >= 1 "
                         "(1: no pipelining)")
    return tuple(
        tuple(add_communication(
            compute_slots(pp_size, r, num_microbatches, vpp_size, forward_only),
            pp_size, r, vpp_size, overlap))
        for r in range(pp_size)
    )


def schedule_name(pp_size: int, vpp_size: int = 1) -> str:
    """'no pipelining', '1F1B' or 'interleaved 1F1B'."""
    if pp_size == 1:
        return "no pipelining"
    return "interleaved 1F1B" if (vpp_size or 1) > 1 else "1F1B"


def max_in_flight(plan: Sequence[Action]) -> int:
    """Most micro-batches (per chunk) whose forward ran and whose backward has not: the
    number of activation sets a rank holds at once."""
    live = best = 0
    for a in plan:
        live += {FORWARD: 1, BACKWARD: -1}.get(a.kind, 0)
        best = max(best, live)
    return best


# --------------------------------------------------------------------------- simulation
class ScheduleError(AssertionError):
    """A plan that would deadlock, mismatch messages or skip work."""


@dataclass
class _Posted:
    """One posted transfer in the simulation."""

    rank: int
    batch: int
    op: P2P
    message: tuple
    matched: bool = False


@dataclass
class _Rank:
    plan: Sequence[Action]
    pc: int = 0
    posted: List[int] = field(default_factory=list)  # batch ids in posting order
    open_ops: Dict[int, int] = field(default_factory=dict)  # batch -> unmatched op count
    done_compute: set = field(default_factory=set)
    arrived: set = field(default_factory=set)  # (recv kind, microbatch, chunk)

    def active(self, batch: int) -> bool:
        """Batches complete in posting order: only the oldest open one makes progress."""
        for b in self.posted:
            if self.open_ops[b]:
                return b == batch
        return False


def _message(op: P2P, rank: int, pp_size: int) -> tuple:
    """What a transfer carries, named by the receiving virtual stage."""
    stage = op.chunk * pp_size + rank
    if op.kind == SEND_FORWARD:
        return ("activation", op.microbatch, stage + 1)
    if op.kind == SEND_BACKWARD:
        return ("gradient", op.microbatch, stage - 1)
    return ("activation" if op.kind == RECV_FORWARD else "gradient", op.microbatch, stage)


def simulate(plans: Sequence[Sequence[Action]], vpp_size: int = 1,
             num_microbatches: Optional[int] = None, forward_only: bool = False) -> int:
    """Run the plans of all pipeline ranks together. Raises ScheduleError on a deadlock,
    a message received as something else than was sent, a rank talking to itself, a
    compute before its input arrived, a backward before its forward, or (when
    `num_microbatches` is given) a missing forward/backward. Returns the number of
    rounds, a rough length of the critical path."""
    pp = len(plans)
    ranks = [_Rank(p) for p in plans]
    channels: Dict[tuple, Dict[str, List[_Posted]]] = defaultdict(
        lambda: {"send": [], "recv": []})
    rounds = 0
    while True:
        progressed = False
        for r, st in enumerate(ranks):
            progressed |= _advance(r, st, channels, pp, vpp_size)
        progressed |= _match(channels, ranks)
        rounds += 1
        if all(st.pc == len(st.plan) for st in ranks) and not any(
                n for st in ranks for n in st.open_ops.values()):
            break
        if not progressed:
            stuck = {r: st.plan[st.pc] if st.pc < len(st.plan) else "end"
                     for r, st in enumerate(ranks)}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}")
    _check_complete(ranks, channels, vpp_size, num_microbatches, forward_only)
    return rounds


def _advance(r: int, st: _Rank, channels, pp: int, vpp_size: int) -> bool:
    """Run rank r until it must wait; True if it moved."""
    moved = False
    while st.pc < len(st.plan):
        a = st.plan[st.pc]
        if a.kind == COMM:
            st.posted.append(a.batch)
            st.open_ops[a.batch] = len(a.ops)
            for op in a.ops:
                if op.peer == r:
                    raise ScheduleError(f"rank {r} would talk to itself: {op}")
                side = "send" if op.kind in (SEND_FORWARD, SEND_BACKWARD) else "recv"
                key = (r, op.peer) if side == "send" else (op.peer, r)
                channels[key][side].append(_Posted(r, a.batch, op, _message(op, r, pp)))
        elif a.kind == WAIT:
            if any(st.open_ops[b] for b in st.posted if b <= a.batch):
                return moved
        else:
            _check_compute(r, st, a, pp, vpp_size)
        st.pc += 1
        moved = True
    return moved


def _check_compute(r: int, st: _Rank, a: Action, pp: int, vpp_size: int) -> None:
    key = (a.kind, a.microbatch, a.chunk)
    if key in st.done_compute:
        raise ScheduleError(f"rank {r} runs {a} twice")
    if a.kind == BACKWARD and (FORWARD, a.microbatch, a.chunk) not in st.done_compute:
        raise ScheduleError(f"rank {r} runs {a} before its forward")
    stage, last = a.chunk * pp + r, pp * vpp_size - 1
    if a.kind == FORWARD and stage > 0:
        need = (RECV_FORWARD, a.microbatch, a.chunk)
    elif a.kind == BACKWARD and stage < last:
        need = (RECV_BACKWARD, a.microbatch, a.chunk)
    else:
        need = None
    if need is not None and need not in st.arrived:
        raise ScheduleError(f"rank {r} runs {a} before its input arrived")
    st.done_compute.add(key)


def _match(channels, ranks) -> bool:
    """Pair the i-th send and i-th receive of every channel once both batches are active
    (a send completes only when its receive is posted, and vice versa)."""
    moved = False
    for (src, dst), ch in channels.items():
        for i in range(min(len(ch["send"]), len(ch["recv"]))):
            snd, rcv = ch["send"][i], ch["recv"][i]
            if snd.matched:
                continue
            if snd.message != rcv.message:
                raise ScheduleError(f"channel {src}->{dst}: message {i} sent as "
                                    f"{snd.message} but received as {rcv.message}")
            if ranks[src].active(snd.batch) and ranks[dst].active(rcv.batch):
                snd.matched = rcv.matched = True
                ranks[src].open_ops[snd.batch] -= 1
                ranks[dst].open_ops[rcv.batch] -= 1
                ranks[dst].arrived.add((rcv.op.kind, rcv.op.microbatch, rcv.op.chunk))
                moved = True
    return moved


def _check_complete(ranks, channels, vpp_size, num_microbatches, forward_only) -> None:
    for (src, dst), ch in channels.items():
        if len(ch["send"]) != len(ch["recv"]):
            raise ScheduleError(f"channel {src}->{dst}: {len(ch['send'])} sends but "
                                f"{len(ch['recv'])} receives")
    if num_microbatches is None:
        return
    for r, st in enumerate(ranks):
        want = {(FORWARD, m, c) for m in range(num_microbatches) for c in range(vpp_size)}
        if not forward_only:
            want |= {(BACKWARD, m, c) for m, c in ((m, c) for _, m, c in want)}
        if want - st.done_compute:
            raise ScheduleError(f"rank {r} never runs {sorted(want - st.done_compute)}")


# Megatron-LM 23.05's get_forward_backward_func and forward_backward_*: one clear ImportError
__getattr__ = core_getattr("megatron.core.pipeline_parallel.schedules")
