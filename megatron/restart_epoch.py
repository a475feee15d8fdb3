"""One key namespace per start of a job under torchrun, agreed through its agent store.

torchrun's agent hosts one TCPStore for the whole job and tells its workers to share it
(TORCHELASTIC_USE_AGENT_STORE=True): the static rendezvous (`--master-addr`) always, the
c10d rendezvous by default. After a restart the keys of the previous start are still
there -- gloo peer addresses, NCCL ids, barrier counters of processes that are gone -- and
a new process reading them dials dead ports. Each start therefore needs a namespace of its
own that every process of it agrees on. TORCHELASTIC_RESTART_COUNT is not one: each node's
agent counts only its own restarts, and with the c10d rendezvous a node whose workers are
restarted because another node's failed (a membership change) keeps its count, so after
one failure the nodes disagree on every later start and the job cannot form again.

The agreement here uses nothing but keys a dead process cannot have left behind:

- Every process counts its start in a per-rank counter (`incarnation/<rank>`): the value
  is its own, never seen by an earlier process of that rank.
- Global rank 0 takes a fresh epoch number from a job-wide counter and answers each rank's
  latest start under `answer/<rank>/<start>`. A rank waits for the answer to its own
  start, so it can only be given an epoch by a rank 0 that saw that start.
- A rank acknowledges by appending its rank to `acked/<epoch>`; rank 0 keeps re-reading
  the starts of the ranks that have not acknowledged yet (an answer to a start whose
  process is gone is harmless: nobody waits for it) until every rank has.

Then every key of the start lives under `megatron/epoch_<n>/`. Processes of earlier starts
never write there: they ended before this start began (torchrun stops every worker of the
job before it rendezvouses again), or, under the static rendezvous, they are past their
own agreement on another node -- and one still inside it may give a restarted rank its
epoch, which lets the restarted rank join the group the others are forming.

Nothing here reads os.environ; the entry point passes the store in.
"""
from __future__ import annotations

import datetime
import time

ROOT = "megatron/handshake/"
POLL_S = (0.02, 0.5)  # rank 0's first and longest wait between looks at the starts
ACK_S = 30.0  # rank 0's wait past its deadline for the ranks it answered just before


def _started(store, rank: int) -> int:
    return store.add(f"{ROOT}incarnation/{rank}", 1)


def _rank_0(store, world_size: int, timeout: datetime.timedelta, clock=time.monotonic,
            sleep=time.sleep) -> int:
    epoch = store.add(f"{ROOT}epoch", 1)
    acked_key = f"{ROOT}acked/{epoch}"
    store.set(acked_key, "")
    answered: dict = {}
    answered_at = -float("inf")  # when rank 0 last answered (a late rank's ack may follow)
    deadline = clock() + timeout.total_seconds()
    wait = POLL_S[0]
    while True:
        acked = {int(r) for r in store.get(acked_key).split()}
        pending = [r for r in range(1, world_size) if r not in acked]
        if not pending:
            return epoch
        if clock() > deadline and clock() > answered_at + ACK_S:
            raise RuntimeError(_missing_message(pending, world_size, timeout))
        keys = [f"{ROOT}incarnation/{r}" for r in pending]
        try:  # a rank's first start: its counter does not exist yet, the read waits for it
            starts = [int(v) for v in store.multi_get(keys)]
        except Exception as exc:  # the store's own timeout
            missing = [r for r, key in zip(pending, keys) if not store.check([key])]
            raise RuntimeError(_missing_message(missing or pending, world_size, timeout)) \
                from exc
        new = [(r, n) for r, n in zip(pending, starts) if answered.get(r) != n]
        if new:
            store.multi_set([f"{ROOT}answer/{r}/{n}" for r, n in new], [str(epoch)] * len(new))
            answered.update(new)
            answered_at = clock()
            wait = POLL_S[0]
        else:
            wait = min(wait * 2, POLL_S[1])
        sleep(wait)


def _missing_message(pending: list, world_size: int, timeout: datetime.timedelta) -> str:
    shown = ", ".join(str(r) for r in pending[:16]) + (" ..." if len(pending) > 16 else "")
    return (f"rank 0 waited {timeout} for {len(pending)} of the {world_size} ranks to join "
            f"this start of the job (ranks {shown}); their processes did not start or "
            "stopped before joining. Check those ranks' nodes and their torchrun logs.")


def _other_rank(store, rank: int, timeout: datetime.timedelta) -> int:
    epochs = int(store.add(f"{ROOT}epoch", 0))  # rank 0s that took an epoch before this start
    key = f"{ROOT}answer/{rank}/{_started(store, rank)}"
    try:
        store.wait([key], timeout)
    except Exception as exc:  # the store's wait timed out (DistStoreError) or it is gone
        if not _rank_0_came_since(store, epochs):
            raise RuntimeError(_no_answer_message(rank, timeout, exc, False)) from exc
        # A rank 0 that came after this rank answers once every rank has counted its start
        # (it may wait for a late one) and gives up `timeout` after it came, naming the
        # late ranks: within one more `timeout`. Leaving sooner would end the job (the
        # launcher stops every rank once one fails) with this rank blaming rank 0.
        try:
            store.wait([key], timeout)
        except Exception as again:
            raise RuntimeError(_no_answer_message(rank, 2 * timeout, again, True)) from again
    epoch = int(store.get(key))
    store.append(f"{ROOT}acked/{epoch}", f"{rank} ")
    return epoch


def _rank_0_came_since(store, epochs: int) -> bool:
    """Whether a rank 0 took an epoch since the job-wide counter read `epochs`."""
    try:
        return int(store.add(f"{ROOT}epoch", 0)) > epochs
    except Exception:  # the store is gone
        return False


def _no_answer_message(rank: int, waited: datetime.timedelta, exc: Exception,
                       rank_0_came: bool) -> str:
    head = (f"rank {rank} waited {waited} for rank 0 to admit it to this start of the job "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); ")
    if not rank_0_came:
        return head + ("rank 0's process did not start or stopped before. Check its node "
                       "and its torchrun log.")
    return head + ("rank 0 started meanwhile but did not answer: it waits for ranks that "
                   "did not join (its error names them), or it stopped. Check rank 0's "
                   "output and its torchrun log.")


def agree_on_epoch(store, rank: int, world_size: int, timeout: datetime.timedelta) -> int:
    """The epoch number every process of this start of the job gets (collective over the
    `world_size` ranks; `store`: torchrun's agent store, which outlives the processes).
    Rank 0 waits at most `timeout` for the others (and ACK_S more for the acknowledgements
    of ranks it answered just before: they came in time); they wait `timeout` for rank 0, or
    twice that when rank 0 came after them (it answers once every rank has come, and its
    error names the ranks that did not); either raises naming who never came."""
    if rank == 0:
        return _rank_0(store, world_size, timeout)
    return _other_rank(store, rank, timeout)


def epoch_prefix(epoch: int) -> str:
    return f"megatron/epoch_{epoch}/"
