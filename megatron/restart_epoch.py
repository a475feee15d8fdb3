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
  process is gone is harmless: nobody waits for it) until every rank has, then sets
  `formed/<epoch>`, which every rank waits for: a rank missing at rank 0's deadline is
  named by rank 0, before any other rank's wait ends.

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
FORMED_S = 60.0  # how much longer than rank 0 the others wait for every rank to join


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
    counted: set = set()  # ranks whose start counter exists (reading it does not block)
    while True:
        acked = {int(r) for r in store.get(acked_key).split()}
        pending = [r for r in range(1, world_size) if r not in acked]
        if not pending:
            store.set(f"{ROOT}formed/{epoch}", "")
            store.delete_key(acked_key)  # a job restarted often keeps one key per start
            return epoch
        for r in pending:  # a rank's first start: its counter is made at 0 (no start has 0)
            if r not in counted:
                store.add(f"{ROOT}incarnation/{r}", 0)
                counted.add(r)
        starts = store.multi_get([f"{ROOT}incarnation/{r}" for r in pending])
        new = [(r, int(n)) for r, n in zip(pending, starts)
               if int(n) > 0 and answered.get(r) != int(n)]
        if new:
            store.multi_set([f"{ROOT}answer/{r}/{n}" for r, n in new], [str(epoch)] * len(new))
            answered.update(new)
            answered_at = clock()
            wait = POLL_S[0]
        else:
            wait = min(wait * 2, POLL_S[1])
        # past the deadline, only acknowledgements of ranks answered just before may come
        if clock() > deadline and (any(r not in answered for r in pending)
                                   or clock() > answered_at + ACK_S):
            raise RuntimeError(_missing_message(pending, world_size, timeout))
        sleep(wait)


def _missing_message(pending: list, world_size: int, timeout: datetime.timedelta) -> str:
    shown = ", ".join(str(r) for r in pending[:16]) + (" ..." if len(pending) > 16 else "")
    return (f"rank 0 waited {timeout} for {len(pending)} of the {world_size} ranks to join "
            f"this start of the job (ranks {shown}); their processes did not start or "
            "stopped before joining. Check those ranks' nodes and their torchrun logs.")


def _other_rank(store, rank: int, timeout: datetime.timedelta) -> int:
    start = _started(store, rank)
    try:
        store.wait([f"{ROOT}answer/{rank}/{start}"], timeout)
    except Exception as exc:  # the store's wait timed out (DistStoreError) or it is gone
        raise RuntimeError(
            f"rank {rank} waited {timeout} for rank 0 to admit it to this start of the job "
            f"({_first_line(exc)}); rank 0's process did not start or stopped before. "
            "Check its node and its torchrun log.") from exc
    epoch = int(store.get(f"{ROOT}answer/{rank}/{start}"))
    store.delete_key(f"{ROOT}answer/{rank}/{start}")
    store.append(f"{ROOT}acked/{epoch}", f"{rank} ")
    # Rank 0 says when every rank has joined, or fails first, naming those that did not
    # (its wait began before this rank's answer): the launcher then ends this process.
    waited = timeout + datetime.timedelta(seconds=ACK_S + FORMED_S)
    try:
        store.wait([f"{ROOT}formed/{epoch}"], waited)
    except Exception as exc:
        raise RuntimeError(
            f"rank {rank} joined this start of the job and waited {waited} for rank 0 to "
            f"see every rank join ({_first_line(exc)}); rank 0 stopped meanwhile. Check "
            "its output and its torchrun log.") from exc
    return epoch


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def agree_on_epoch(store, rank: int, world_size: int, timeout: datetime.timedelta) -> int:
    """The epoch number every process of this start of the job gets (collective over the
    `world_size` ranks; `store`: torchrun's agent store, which outlives the processes).
    Rank 0 answers each rank as it comes and waits at most `timeout` for all of them (and
    ACK_S more for the acknowledgements of ranks it answered just before: they came in
    time), then raises naming those that never came. The others wait `timeout` for their
    answer, then until rank 0 has seen every rank join (a barrier: rank 0's error comes
    first); either raises naming who never came."""
    if rank == 0:
        return _rank_0(store, world_size, timeout)
    return _other_rank(store, rank, timeout)


def epoch_prefix(epoch: int) -> str:
    return f"megatron/epoch_{epoch}/"
