"""megatron/watchdog.py: the check-ins reach the store through the monitor thread, a few
writes per interval whatever the number of watched blocks; the keys of an overrun are
removed once it is settled."""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel import build_schedule, transfer_name
from megatron.core.pipeline_parallel.schedules import COMM, WAIT
from megatron.train_step import _action_watch
from megatron.watchdog import CollectiveWatchdog, published_checkins
from tests.dist_utils import run_distributed
from tests.test_watchdog import _checked_in, _watchdog


class _KeyLog:
    """A HashStore that remembers every key written to it (set, add, multi_set)."""

    def __init__(self):
        self._store, self.written = dist.HashStore(), set()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def set(self, key, value):
        self.written.add(key)
        self._store.set(key, value)

    def multi_set(self, keys, values):
        self.written.update(keys)
        self._store.multi_set(keys, values)

    def add(self, key, value):
        self.written.add(key)
        return self._store.add(key, value)

    def left(self, part):
        """The keys written that contain `part` and are still in the store."""
        return sorted(k for k in self.written if part in k and self._store.check([k]))


def test_the_keys_of_an_overrun_that_recovers_are_removed():
    """Three ranks compute past the deadline in three calls of a block (equal collective
    counts: every overrun ends with more time, none fires). Each overrun left its election
    count and its verdict in the store for good: a long run with many slow blocks that
    recover filled the job's store. Now the last member done with an overrun's verdict
    removes its keys."""
    store, world = _KeyLog(), 3
    fired = []
    wds = [CollectiveWatchdog(store, r, world, 0.3, poll_s=10.0, on_timeout=fired.append)
           for r in range(world)]
    for _ in range(3):
        with contextlib.ExitStack() as blocks:
            for wd in wds:
                blocks.enter_context(wd.watch("micro-batch 0 forward", progress=lambda: 7))
            time.sleep(1.0)
    for wd in wds:
        wd.close()
    assert fired == []
    overruns = {k.rsplit("/", 1)[0] for k in store.written if "/overrun/" in k}
    assert len(overruns) >= 3, sorted(store.written)  # at least one per call
    assert store.left("/overrun/") == []


def test_the_keys_of_an_overrun_some_members_never_reached_are_removed():
    """Rank 0's deadline passes in a block rank 1, with a longer timeout, is in too; rank
    0 counts itself in as the reporter and the block ends while it waits for rank 1's
    count. Rank 1 never overran, never counted itself done: the overrun's keys stayed for
    good. Now rank 0 removes them once both ranks have gone on to the next call."""
    store, fired = _KeyLog(), []
    wd0 = CollectiveWatchdog(store, 0, 2, 0.3, poll_s=0.1, on_timeout=fired.append)
    wd1 = CollectiveWatchdog(store, 1, 2, 60.0, publish_s=0.1, on_timeout=fired.append)
    with wd0.watch("grads", progress=lambda: 3), wd1.watch("grads", progress=lambda: 3):
        time.sleep(0.8)  # deadline 0.3 s, counted in at ~0.6 s, waits for rank 1's count
    assert store.left("/overrun/"), sorted(store.written)  # rank 1 may still need them
    for wd in (wd0, wd1):
        with wd.watch("grads"):
            pass
    time.sleep(0.6)  # both publish the next call; rank 0 looks again
    assert store.left("/overrun/") == []
    wd0.close()
    wd1.close()
    assert fired == []


class _CheckCount(_KeyLog):
    """A _KeyLog that counts `check` calls on overrun keys (the sweep's first request per
    look; the monitor's look for a report checks another key)."""

    def __init__(self):
        super().__init__()
        self.checks = 0

    def check(self, keys):
        self.checks += any("/overrun/" in k for k in keys)
        return self._store.check(keys)


def test_the_sweep_gives_up_on_an_overrun_a_member_never_goes_on_from(monkeypatch):
    """As above, but rank 1 never enters the block again (a block that runs once): rank
    0's sweep read both ranks' check-ins every poll_s for the rest of the run. Now it
    looks SWEEP_LOOKS times (5 here), then leaves the few keys be and stops looking."""
    import megatron.watchdog_report as report

    monkeypatch.setattr(report, "SWEEP_LOOKS", 5)
    store, fired = _CheckCount(), []
    wd0 = CollectiveWatchdog(store, 0, 2, 0.3, poll_s=0.05, on_timeout=fired.append)
    wd1 = CollectiveWatchdog(store, 1, 2, 60.0, publish_s=0.1, on_timeout=fired.append)
    with wd0.watch("grads", progress=lambda: 3), wd1.watch("grads", progress=lambda: 3):
        time.sleep(0.8)  # as above: rank 0 counted in, the block ends before rank 1's count
    time.sleep(0.05 * 5 + 1.0)  # every look rank 0's sweep makes, and more
    checks = store.checks
    time.sleep(0.5)
    assert 0 < checks and store.checks == checks, (checks, store.checks)  # it stopped
    assert store.left("/overrun/")  # rank 1 may still need them: left in place
    wd0.close()
    wd1.close()
    assert fired == []


def test_check_ins_are_published_while_an_overrun_is_examined():
    """Rank 0's block overruns and its monitor waits (up to the timeout) for rank 1's
    count, which never comes; meanwhile rank 0's main thread enters a block nested in it.
    That check-in is published within the interval (before, only once the monitor had
    finished examining the overrun: a peer's report could read the older count and name
    rank 0 as not arrived)."""
    store = dist.HashStore()
    _checked_in(store, 1, 2, "optimizer step", ranks=[0, 1])  # and left it
    wd0, fired = _watchdog(store, rank=0, world=2, timeout=2.0)
    with wd0.watch("optimizer step", ranks=[0, 1], progress=lambda: 5):
        time.sleep(3.0)  # deadline at 2 s, counts read at 2.7 s, waited for until 4.7 s
        with wd0.watch("parameter all-gather wait", ranks=[0, 1]):
            time.sleep(1.0)
            seen = published_checkins(store, 0, [0, 1])
        time.sleep(1.5)
    wd0.close()
    assert seen.get("parameter all-gather wait") == 1, seen
    assert len(fired) == 1 and "ranks that did not arrive: []" in fired[0], fired


# --------------------------------------------------------------------------- store traffic
class _CountingStore:
    """A HashStore that counts the calls that write to it."""

    def __init__(self):
        self._store, self.writes = dist.HashStore(), 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def set(self, key, value):
        self.writes += 1
        self._store.set(key, value)

    def multi_set(self, keys, values):
        self.writes += 1
        self._store.multi_set(keys, values)

    def add(self, key, value):
        self.writes += 1
        return self._store.add(key, value)


def _watched_step(wd, hook, plan, ps) -> int:
    """One training step's watched blocks on this rank, as train_step enters them: the
    schedule's actions through the executor's hook (a wait with its batch's transfers),
    the loss broadcast, the gradient reduction. Returns how many blocks checked in."""
    pending, blocks = {}, 0
    for a in plan:
        if a.kind == COMM:
            pending[a.batch] = a.ops
        with hook(replace(a, ops=pending.pop(a.batch)) if a.kind == WAIT else a):
            blocks += a.kind != COMM
    for name, kind in (("loss broadcast (pipeline group)", "pp"),
                       ("gradient reduction (data-parallel group)", "dp")):
        with wd.watch(name, ranks=ps.ranks(kind)):
            blocks += 1
    return blocks


def test_store_writes_follow_the_publications_not_the_blocks():
    """Rank 0 of a pp2 tp2 layout with 32 micro-batches enters 99 watched blocks a step
    (each forward and backward over the tensor-parallel group, each wait for transfers,
    the loss broadcast, the gradient reduction). Each wrote its check-ins to the store
    (one per transfer): 130 writes a step from every rank, all to the job's one store
    server. Now
    the monitor publishes what changed once per `publish_s`: the writes are bounded by
    the intervals elapsed, whatever the number of blocks, and what it published is
    current."""
    store = _CountingStore()
    wd = CollectiveWatchdog(store, 0, 4, 30.0, poll_s=0.1, on_timeout=print)
    ps = ParallelState.build(world_size=4, rank=0, tp_size=2, pp_size=2, create_groups=False)
    hook = _action_watch(SimpleNamespace(watchdog=wd, rt=SimpleNamespace(ps=ps)), 1)
    plan = build_schedule(2, 32, 1, False, False)[0]
    started, blocks = time.monotonic(), 0
    for _ in range(20):
        blocks += _watched_step(wd, hook, plan, ps)
        time.sleep(0.03)
    intervals = (time.monotonic() - started) / wd.publish_s
    writes = store.writes
    wd.close()  # publishes the check-ins of the last interval
    assert wd.publish_s == 0.1 and blocks == 20 * 99
    assert 1 <= writes <= intervals + 2, (writes, intervals, blocks)
    send = next(op for a in plan for op in a.ops if op.microbatch == 31)
    assert published_checkins(store, 0, ps.ranks("pp"))[transfer_name(send, 0, 2)] == 20
    assert published_checkins(store, 0, ps.ranks("tp"))[
        "micro-batch 31 backward (pipeline stage 0)"] == 20


def _published_while_waiting(rank, world_size):
    """Rank 1 checks in and waits in a gloo all-reduce, which rank 0 joins only once it
    has read rank 1's check-in from the store: published by rank 1's monitor thread while
    its main thread waited in the collective."""
    store = dist.distributed_c10d._get_default_store()
    wd = CollectiveWatchdog(store, rank, world_size, 30.0, poll_s=0.2)
    seen = None
    if rank == 0:
        give_up = time.monotonic() + 20
        while not published_checkins(store, 1, [0, 1]) and time.monotonic() < give_up:
            time.sleep(0.05)
        seen = published_checkins(store, 1, [0, 1])
    t = torch.ones(1)
    with wd.watch("all-reduce", ranks=[0, 1]):
        dist.all_reduce(t)
    wd.close()
    return seen, t.item()


def test_a_rank_waiting_in_a_collective_still_publishes_its_check_in():
    seen, total = run_distributed(_published_while_waiting, 2)[0]
    assert seen == {"all-reduce": 1} and total == 2.0


def test_a_check_in_just_before_the_deadline_counts_as_arrived():
    """Rank 1 enters the block shortly before rank 0's deadline, after its monitor's last
    publication, and stays inside. Rank 0 reads the check-ins only once every monitor
    has had time to publish (`publish_s` + SETTLE_S after the deadline): rank 1 arrived,
    no rank is named (read at the deadline, rank 1 looked missing)."""
    store = dist.HashStore()
    fired = []
    wd1 = CollectiveWatchdog(store, 1, 2, 2.0, poll_s=10.0, on_timeout=fired.append)
    time.sleep(0.25)  # rank 1 publishes at 0.5, 1.0, ... s; rank 0's deadline is at 2.25 s
    wd0 = CollectiveWatchdog(store, 0, 2, 2.0, poll_s=10.0, on_timeout=fired.append)
    with wd0.watch("grads", ranks=[0, 1]):
        time.sleep(1.85)
        with wd1.watch("grads", ranks=[0, 1]):  # at 2.1 s, published at 2.5 s
            time.sleep(1.0)
    wd0.close()
    wd1.close()
    assert wd0.publish_s == 0.5 and len(fired) == 1, fired
    assert fired[0].startswith("[watchdog rank 0] collective grads did not complete within "
                               "2 s; ranks that did not arrive: []\n  every rank arrived"), fired[0]


def test_a_rank_that_closes_its_watchdog_has_published_its_last_check_ins():
    """Rank 1 goes through its last block (the source of a broadcast leaves it before the
    receivers have the data) and its run ends: it closes its watchdog within its publish
    interval. Rank 0 stays inside that block past its deadline (its receive is stuck).
    Rank 1 arrived: no rank is named. Before, close() published nothing: rank 0 read
    rank 1's count from its monitor's last publication and named it as not arrived."""
    store = dist.HashStore()
    fired = []
    wd1 = CollectiveWatchdog(store, 1, 2, 30.0, poll_s=0.2, on_timeout=fired.append)
    wd0 = CollectiveWatchdog(store, 0, 2, 0.5, poll_s=10.0, on_timeout=fired.append)
    for wd in (wd0, wd1):  # earlier steps
        for _ in range(3):
            with wd.watch("loss broadcast", ranks=[0, 1]):
                pass
    time.sleep(0.5)  # rank 1's monitor published them
    assert published_checkins(store, 1, [0, 1]) == {"loss broadcast": 3}
    with wd1.watch("loss broadcast", ranks=[0, 1]):
        pass
    wd1.close()  # the run ended on rank 1, within its publish interval
    with wd0.watch("loss broadcast", ranks=[0, 1]):
        time.sleep(1.5)
    wd0.close()
    assert len(fired) == 1, fired
    assert fired[0].startswith("[watchdog rank 0] collective loss broadcast did not complete "
                               "within 0.5 s; ranks that did not arrive: []\n  every rank "
                               "arrived"), fired[0]
    assert published_checkins(store, 1, [0, 1]) == {"loss broadcast": 4}
