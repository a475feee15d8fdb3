"""Errors every rank agrees on, printed once: the checkpoint load's failures.

A check that can fail on some ranks only (their view of the files, their shard) must not
raise where it fails: the ranks that passed would wait in their next collective until the
timeout. Every rank calls `agree` at the same point with its own message or None; when any
rank has one, every rank raises the same `AgreedExit` (status 1). Its message names which
ranks met each distinct error unless all did:

    ranks 2-3 (of 4): error: cannot read checkpoint file .../mp_rank_01/model_optim_rng.pt ...

Python prints an uncaught SystemExit's `code` when it is not a number: an `AgreedExit`
carries the message as its code on rank 0 and status 1 on the other ranks, so the message
appears once per launch. A failure that every rank reaches with the same message from
collective results it already has (a flag all-reduce) needs no further collective:
`exit_on_every_rank`. In a single process (no process group) both raise
`SystemExit(message)`, as a plain raise would.

Entry points run under `silent_ranks_wait`: a rank that does not print waits under a
launcher before it exits, as for an argument error (megatron/arguments.py), so that the
failure the launcher reports first is rank 0's, which printed.

The agreements and the training loop's per-step exit checks run over the world on a gloo
group (the run's CPU control group), whose all-reduce and all-gather are rings: 2(N-1)
messages one after another even for one number, a second or so at thousands of ranks.
`max_over_ranks` reduces over a binomial tree instead (about 2 log2(N) messages in a row,
at most about that many sent or received by a rank), and `agree` gathers the messages only
when some rank has one.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron.watchdog import watching


class AgreedExit(SystemExit):
    """A failure every rank raises together, with one report (`str(exc)`, `exc.report`).

    Exit status 1. `code` is the report on the rank that prints it (`prints`: rank 0) and
    1 elsewhere, so that the interpreter prints it once when nothing catches it."""

    def __init__(self, report: str, rank: int, world_size: int):
        super().__init__(report)
        self.report = report
        self.rank = rank
        self.world_size = world_size
        self.prints = rank == 0
        if not self.prints:
            self.code = 1


def _world(group) -> Optional[tuple]:
    """(rank, world size) in `group` when a process group of several ranks exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world_size = dist.get_world_size(group)
    return (dist.get_rank(group), world_size) if world_size > 1 else None


def exit_on_every_rank(message: str, group=None) -> SystemExit:
    """The exception to raise for a failure every rank of `group` (default: the world)
    meets with the same `message`, known from a collective already made: an `AgreedExit`
    that rank 0 prints; `SystemExit(message)` in a single process. No collective."""
    where = _world(group)
    if where is None:
        return SystemExit(message)
    return AgreedExit(message, *where)


def rank_ranges(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 2-3', 'ranks 0, 2, 5-7' for sorted rank numbers."""
    runs: List[List[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


# A rank's error: its message, or (the message when every rank has an error, the message
# when some ranks passed) -- e.g. "run with other flags" against "this rank's file is bad".
RankError = Union[str, Tuple[str, str]]


def _told(error: Optional[RankError], every: bool) -> Optional[str]:
    if isinstance(error, tuple):
        return error[0] if every else error[1]
    return error


def agreed_report(errors: Sequence[Optional[RankError]]) -> Optional[str]:
    """Each distinct message of `errors` (one entry per rank, None: no error) once, in the
    order of the first rank that met it, prefixed with its ranks unless every rank met it.
    An entry that is a pair of messages gives its first when every rank has an error, else
    its second. None when no rank has an error."""
    every = all(e is not None for e in errors)
    ranks_of: Dict[str, List[int]] = {}
    for rank, error in enumerate(errors):
        message = _told(error, every)
        if message is not None:
            ranks_of.setdefault(message, []).append(rank)
    lines = [m if len(r) == len(errors) else f"{rank_ranges(r)} (of {len(errors)}): {m}"
             for m, r in ranks_of.items()]
    return "\n".join(lines) if lines else None


def max_over_ranks(values: Sequence[float], group=None) -> List[float]:
    """Element-wise MAX of `values` (numbers a float64 holds exactly: flags, counts,
    minutes) over the ranks of `group` (None: the default group); `values` in a single
    process. Every rank of `group` must call it at the same point with as many values.

    Collective, O(log N) messages and latency per rank: on gloo a binomial-tree reduce to
    the group's first rank (point-to-point) and a broadcast (gloo's is a binomial tree
    too), where gloo's all-reduce is a ring of 2(N-1) messages in a row; on NCCL one
    all-reduce."""
    where = _world(group)
    if where is None:
        return [float(v) for v in values]
    me, size = where
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if nccl:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        return mine.tolist()
    ranks = dist.get_process_group_ranks(group) if group is not None else range(size)
    theirs = torch.empty_like(mine)
    step = 1
    while step < size:  # children at me + 1, + 2, + 4, ... below the step I send at
        if me % (2 * step):
            dist.send(mine, dst=ranks[me - step], group=group)
            break
        if me + step < size:
            dist.recv(theirs, src=ranks[me + step], group=group)
            torch.maximum(mine, theirs, out=mine)
        step *= 2
    dist.broadcast(mine, src=ranks[0], group=group)
    return mine.tolist()


def from_rank_0(value: Any, group=None) -> Any:
    """Rank 0's `value` (a picklable object; the others pass anything, e.g. None) on every
    rank of `group` (None: the default group); `value` in a single process. Collective:
    a broadcast_object_list (gloo's broadcast is a binomial tree: O(log N) latency)."""
    if _world(group) is None:
        return value
    box = [value]
    src = dist.get_process_group_ranks(group)[0] if group is not None else 0
    with watching("object from rank 0", group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(error: Optional[RankError], group=None, value: Any = None) -> List[Any]:
    """Every rank's `value` (a list indexed by rank) when no rank of `group` has an error;
    else every rank raises the same `AgreedExit` (see `agreed_report`), which rank 0
    prints. `error`: this rank's message (or pair, see `agreed_report`), or None. In a
    single process: [value], or SystemExit(error) (of a pair: the first).

    Collective over `group` (the run's CPU control group, or None for the default group),
    which every rank must call at the same point, whether its own check passed or not:
    `max_over_ranks` of two flags (an error, a value), then, only when some rank has
    either, an all_gather_object of (error, value). Watched (megatron/watchdog.py
    `watching`, under the caller's name): a rank that never comes is named after
    --distributed-timeout-minutes."""
    where = _world(group)
    if where is None:
        if error is not None:
            raise SystemExit(_told(error, True))
        return [value]
    gathered: List[Any] = [None] * where[1]
    caller = sys._getframe(1)
    name = (f"agreement of the ranks in {caller.f_globals.get('__name__', '?')}."
            f"{caller.f_code.co_name}")
    with watching(name, group):
        flags = max_over_ranks([error is not None, value is not None], group)
        if not any(flags):
            return gathered  # every rank's value is None
        dist.all_gather_object(gathered, (error, value), group=group)
    report = agreed_report([e for e, _ in gathered])
    if report is not None:
        raise AgreedExit(report, *where)
    return [v for _, v in gathered]


def exit_message(exc: SystemExit) -> str:
    """The text an uncaught `exc` would print (its code, or the status it exits with)."""
    if isinstance(exc, AgreedExit):
        return exc.report
    if exc.code is None or isinstance(exc.code, int):
        return f"exit status {exc.code or 0}"
    return str(exc.code)


@contextlib.contextmanager
def silent_ranks_wait(env: Mapping[str, str]) -> Iterator[None]:
    """Around an entry point's run: a rank that leaves an `AgreedExit` to rank 0's message
    waits before it exits when a launcher started it (`env`: the process environment), as
    for an argument error (`arguments.wait_for_printing_rank`): torchrun ends every worker
    at the first failure, and a silent rank failing first could end rank 0 unprinted."""
    try:
        yield
    except AgreedExit as exc:
        if not exc.prints:
            from megatron.arguments import wait_for_printing_rank

            wait_for_printing_rank(exc.world_size, env)
        raise


__all__ = ["AgreedExit", "agree", "agreed_report", "exit_message", "exit_on_every_rank",
           "from_rank_0", "max_over_ranks", "rank_ranges", "silent_ranks_wait"]
