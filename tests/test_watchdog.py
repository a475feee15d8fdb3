"""megatron/watchdog.py: a watched block that overruns names the ranks that never arrived;
2 real gloo processes where rank 1 sleeps past the timeout end with rank 1 named; the
check-ins reach the store through the monitor thread, a few writes per interval."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel import build_schedule, transfer_name
from megatron.core.pipeline_parallel.schedules import COMM, WAIT
from megatron.train_step import _action_watch
from megatron.watchdog import (
    ABORT_KEY,
    EXIT_CODE,
    FIRED_KEY,
    CollectiveWatchdog,
    NullWatchdog,
    build_watchdog,
    published_checkins,
)
from tests.dist_utils import free_port, run_distributed


def _watchdog(store, rank=0, world=3, timeout=0.3):
    fired = []
    return CollectiveWatchdog(store, rank, world, timeout, on_timeout=fired.append), fired


def _checked_in(store, rank, world, name, times=1, **watch):
    """Another rank's watchdog enters and leaves `name` `times` times, and publishes."""
    wd = CollectiveWatchdog(store, rank, world, 60.0, on_timeout=print)
    for _ in range(times):
        with wd.watch(name, **watch):
            pass
    wd.publish()
    wd.close()


def test_a_missing_ranks_count_is_given_as_of_its_last_publication():
    """A rank stopped (SIGSTOP, a dead node) since it last published its check-ins may
    have reached the point more often: the report must not state the published count as
    where it is (after 2 quick iterations its count was still 0 in the store)."""
    store = dist.HashStore()
    _checked_in(store, 1, 2, "grads", times=1, ranks=[0, 1])  # its 2nd was never published
    wd, fired = _watchdog(store, rank=0, world=2)
    for _ in range(2):
        with wd.watch("grads", ranks=[0, 1]):
            pass
    with wd.watch("grads", ranks=[0, 1]):
        time.sleep(1.0)
    wd.close()
    assert len(fired) == 1
    assert ("  rank 1 reached 'grads' 1 times by its last published check-ins (published "
            "every 0.075 s, so it may have got further); this rank is at its call number 3"
            ) in fired[0], fired[0]


def test_overrun_names_the_ranks_that_did_not_arrive():
    store = dist.HashStore()
    _checked_in(store, 1, 3, "all-reduce")  # rank 1 arrived, rank 2 did not
    wd, fired = _watchdog(store)
    with wd.watch("all-reduce"):
        time.sleep(1.0)
    wd.close()
    assert len(fired) == 1
    assert ("[watchdog rank 0] collective all-reduce did not complete within 0.3 s; ranks that "
            "did not arrive: [2]") in fired[0]
    assert "rank 2 reached 'all-reduce' 0 times" in fired[0]


def test_counts_per_name_and_group_members():
    store = dist.HashStore()
    wd, fired = _watchdog(store, timeout=5)
    for _ in range(3):
        with wd.watch("grads", ranks=[0, 2]):
            pass
    _checked_in(store, 2, 3, "grads", times=2, ranks=[0, 2])
    assert wd.missing_ranks("grads", 3, [0, 2]) == [2]  # rank 2 is one call behind
    _checked_in(store, 2, 3, "grads", times=3, ranks=[0, 2])
    assert wd.missing_ranks("grads", 3, [0, 2]) == []
    msg = wd.timeout_message("grads", 3, [0, 2])
    assert "ranks that did not arrive: []" in msg and "every rank arrived" in msg
    wd.close()
    assert fired == []


def test_fast_blocks_never_fire():
    wd, fired = _watchdog(dist.HashStore(), timeout=0.5)
    for _ in range(20):
        with wd.watch("barrier"):
            time.sleep(0.05)
    time.sleep(0.7)  # past the deadline of every block, none active
    wd.close()
    assert fired == []


def test_single_process_gets_the_null_watchdog():
    assert not dist.is_initialized()
    wd = build_watchdog(1.0)
    assert isinstance(wd, NullWatchdog)
    with wd.watch("anything"):
        pass


def _all_reduces(rank, world_size):
    wd = build_watchdog(30.0)
    out = []
    for step in range(3):
        t = torch.tensor([float(rank + step)])
        with wd.watch("all-reduce (world)"):
            dist.all_reduce(t)
        out.append(t.item())
    wd.close()
    return type(wd).__name__, out


def test_real_collectives_on_the_default_store():
    for name, out in run_distributed(_all_reduces, 2):
        assert name == "CollectiveWatchdog" and out == [1.0, 3.0, 5.0]


# Two real processes (fresh interpreters, as under torchrun): rank 1 sleeps outside any
# watched block, rank 0 waits for it in a watched all-reduce with a 2-second timeout.
HANG_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from megatron.watchdog import CollectiveWatchdog
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
store = dist.distributed_c10d._get_default_store()
wd = CollectiveWatchdog(store, rank, 2, 2.0, poll_s=0.5, describe=lambda: "at iteration 7")
if rank == 1:
    time.sleep(60)  # stuck: in data loading, a file system call, ...
t = torch.ones(4)
with wd.watch("all-reduce of gradients (dp group)"):
    dist.all_reduce(t)
print("finished", flush=True)
"""


def test_sleeping_rank_is_named_and_every_rank_ends_saying_where_it_is(tmp_path):
    """Rank 0's watchdog names rank 1; rank 1, stuck outside any collective, sees rank
    0's report in the store and ends too, showing where its main thread is (before, it
    slept on: on another node, its launcher saw nothing wrong). Both exit with 124, and
    rank 0's collective failing as rank 1 leaves adds nothing to rank 0's output."""
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT.format(root=str(Path(__file__).resolve().parents[1])))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", OMP_NUM_THREADS="1")
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=40)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert time.monotonic() - started < 30
    assert [p.returncode for p in procs] == [EXIT_CODE, EXIT_CODE], outs
    assert ("[watchdog rank 0] collective all-reduce of gradients (dp group) did not complete "
            "within 2 s at iteration 7; ranks that did not arrive: [1]") in outs[0]
    assert "rank 0's main thread is here" in outs[0] and "dist.all_reduce(t)" in outs[0]
    assert "finished" not in outs[0] and "Traceback" not in outs[0], outs[0]
    assert ("[watchdog rank 1] stopping at iteration 7, in no watched collective, because "
            "another rank's watchdog fired:\n  [watchdog rank 0] collective all-reduce") \
        in outs[1], outs[1]
    assert "rank 1's main thread is here" in outs[1] and "time.sleep(60)" in outs[1], outs[1]


def test_a_fired_watchdog_stops_the_other_ranks():
    """Another rank's report in the store stops this rank within `poll_s`, in or out of a
    watched block, with its own place in the message."""
    store = dist.HashStore()
    first, fired_first = _watchdog(store, rank=0, timeout=0.3)
    fired = []
    other = CollectiveWatchdog(store, 2, 3, 30.0, on_timeout=fired.append, poll_s=0.1,
                               describe=lambda: "during the evaluation at iteration 5")
    with first.watch("barrier"):
        time.sleep(1.0)  # first's deadline passes; `other` is in no block
    first.close()
    other.close()
    assert len(fired_first) == 1 and len(fired) == 1
    assert fired[0].startswith(
        "[watchdog rank 2] stopping during the evaluation at iteration 5, in no watched "
        "collective, because another rank's watchdog fired:\n  [watchdog rank 0] collective "
        "barrier did not complete within 0.3 s; ranks that did not arrive: [1, 2]\n"
        "  it names this rank: the others wait for it\n"
        "  rank 2's main thread is here (innermost last):"), fired[0]
    assert "time.sleep(1.0)" in fired[0]  # this test's own line: where the main thread is


def test_a_short_timeout_stops_the_other_ranks_within_a_fraction_of_it():
    """The ranks look for another rank's report every min(POLL_S, timeout / 4) seconds:
    with a timeout of 2 s this rank stops within about 0.5 s of the report, no longer
    POLL_S (5 s) later; a minutes-long timeout keeps POLL_S."""
    store = dist.HashStore()
    assert CollectiveWatchdog(store, 0, 2, 600.0, on_timeout=print).poll_s == 5.0
    fired = []
    wd = CollectiveWatchdog(store, 1, 2, 2.0, on_timeout=fired.append)
    store.set(ABORT_KEY, "[watchdog rank 0] collective x did not complete within 2 s; "
                         "ranks that did not arrive: [1]")
    reported = time.monotonic()
    while not fired and time.monotonic() < reported + 2.0:
        time.sleep(0.02)
    wd.close()
    assert fired and fired[0].startswith("[watchdog rank 1] stopping, in no watched "
                                         "collective, because another rank's watchdog fired")


def test_one_full_report_for_one_hang():
    """Ranks 0 and 2 both wait for rank 1: the first whose deadline passes gives the whole
    report (rank 1's count, its own stack), the other its first line only; a third rank
    waiting in a watched block when the report comes says so in one line (no stack)."""
    store = dist.HashStore()
    fired = []
    wds = [CollectiveWatchdog(store, r, 4, t, on_timeout=fired.append, poll_s=poll)
           for r, t, poll in ((0, 0.3, 10.0), (2, 0.4, 10.0), (3, 30.0, 0.1))]
    with contextlib.ExitStack() as blocks:
        for wd in wds:
            blocks.enter_context(wd.watch("grads", ranks=[0, 1, 2, 3]))
        time.sleep(1.0)
    for wd in wds:
        wd.close()
    assert len(fired) == 3, fired
    full, short, follower = (next(m for m in fired if m.startswith(f"[watchdog rank {r}]"))
                             for r in (0, 2, 3))
    assert full.startswith("[watchdog rank 0] collective grads did not complete within 0.3 s; "
                           "ranks that did not arrive: [1]\n  rank 1 reached 'grads' 0 times")
    assert "rank 0's main thread is here" in full
    assert short == ("[watchdog rank 2] collective grads did not complete within 0.4 s; ranks "
                     "that did not arrive: [1] (another rank's watchdog reported it first)")
    assert follower == ("[watchdog rank 3] stopping, waiting in 'grads' (arrived there), "
                        "because another rank's watchdog fired:\n  [watchdog rank 0] "
                        "collective grads did not complete within 0.3 s; ranks that did not "
                        "arrive: [1]")


class _GoneStore:
    """A store whose host has ended: every call fails, as a TCPStore client's does."""

    def check(self, *args):
        raise RuntimeError("Connection closed by peer")

    set = get = check


def test_a_rank_outside_any_collective_ends_when_the_store_is_gone():
    """The job's store (torchrun's agent on the first node, or rank 0) gone ends a rank
    stuck outside any collective after the grace period (here the 0.4-s timeout); a
    watchdog closed within it (a rank ending normally) says nothing."""
    fired = []
    wd = CollectiveWatchdog(_GoneStore(), 1, 2, 0.4, on_timeout=fired.append, poll_s=0.1)
    time.sleep(0.2)
    wd.close()
    assert fired == []
    wd = CollectiveWatchdog(_GoneStore(), 1, 2, 0.4, on_timeout=fired.append, poll_s=0.1)
    time.sleep(1.0)
    wd.close()
    assert len(fired) == 1
    assert re.match(
        r"\[watchdog rank 1\] stopping, in no watched collective, because the job has ended "
        r"elsewhere:\n  the job's rendezvous store stopped answering \(Connection closed by "
        r"peer\): the process that hosts it \(torchrun's agent on the first node, or rank 0\) "
        r"has ended", fired[0]), fired[0]
    assert "rank 1's main thread is here" in fired[0]


GONE_STORE_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from megatron import watchdog
from megatron.watchdog import CollectiveWatchdog

watchdog.POLL_S = 40.0  # the exit's wait for the others would be 41 s

class GoneStore:
    def check(self, *args):
        raise RuntimeError("Connection closed by peer")

    set = get = check

    def add(self, *args):  # a client whose server is gone may wait for its own timeout
        time.sleep(60)

wd = CollectiveWatchdog(GoneStore(), 1, 2, 0.4, poll_s=0.1)
time.sleep(120)  # stuck outside any collective
"""


def test_a_rank_stopping_because_the_store_is_gone_exits_at_once(tmp_path):
    """A rank stopping for a report that names other ranks waits poll_s + 1 s so that the
    named ranks read it; a rank stopping because the store is gone waited as long (41 s
    here: POLL_S + 1, the store's calls hanging), for nothing: no rank can read anything
    there any more. Now it prints its message and exits with EXIT_CODE at once."""
    script = tmp_path / "gone.py"
    script.write_text(GONE_STORE_SCRIPT.format(root=str(Path(__file__).resolve().parents[1])))
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=90)
    took = time.monotonic() - started
    assert done.returncode == EXIT_CODE, done.stderr
    assert "because the job has ended elsewhere:\n  the job's rendezvous store stopped " \
        "answering" in done.stderr, done.stderr
    assert took < 20.0, took  # 0.4 s of grace, then at once (before: 41 s more)


def _watched_points(rank, world_size):
    from megatron.agreed_exit import agree
    from megatron.watchdog import watching

    store = dist.distributed_c10d._get_default_store()
    wd = build_watchdog(30.0)
    agree(None)  # the ranks' agreements are watched under their caller's name
    with watching("validation loss all-reduce", dist.new_group([0, 1])):
        pass
    wd.publish()
    names = [f"agreement of the ranks in {__name__}._watched_points",
             "validation loss all-reduce"]
    counts = tuple(published_checkins(store, rank, [0, 1]).get(n) for n in names)
    wd.close()
    dist.barrier()  # the other rank's close() publishes too: count after both have closed
    keys = store.num_keys()
    with watching("after close"):  # no watchdog: nothing is written
        pass
    after = store.num_keys() - keys
    dist.barrier()
    return counts, after


def test_agreements_and_named_points_use_the_process_watchdog():
    for counts, after_close in run_distributed(_watched_points, 2):
        assert counts == (1, 1) and after_close == 0


# --------------------------------------------------------------------------- inside a step
def test_a_block_of_several_transfers_names_the_peer_of_the_one_not_posted():
    """A wait for a batch of pipeline transfers checks in once per transfer, each with
    the rank at its other end: rank 2 posted its side of the activation, rank 1 never
    posted the gradient's."""
    store = dist.HashStore()
    _checked_in(store, 2, 3, "wait", points=[("mb 2 activation, 0 to 2", (2, 0))])
    wd, fired = _watchdog(store, rank=0, world=3)
    with wd.watch("pipeline transfers (mb 2 activation, mb 1 gradient)",
                  points=[("mb 2 activation, 0 to 2", (0, 2)), ("mb 1 gradient, 1 to 0", (0, 1))]):
        time.sleep(1.0)
    wd.close()
    assert len(fired) == 1
    assert fired[0].startswith(
        "[watchdog rank 0] collective pipeline transfers (mb 2 activation, mb 1 gradient) did "
        "not complete within 0.3 s; ranks that did not arrive: [1]\n"
        "  rank 1 reached 'mb 1 gradient, 1 to 0' 0 times by its last published check-ins "
        "(published every 0.075 s, so it may have got further); this rank is at its call "
        "number 1\n"
        "  rank 0's main thread is here"), fired[0]
    # this rank checked in at both (published when its block overran)
    assert published_checkins(store, 0, (0, 2)) == {"mb 2 activation, 0 to 2": 1}
    assert published_checkins(store, 0, (0, 1)) == {"mb 1 gradient, 1 to 0": 1}


def _both_overrun(issued, timeout=0.3, seconds=1.5, when=None):
    """Ranks 0 and 1 (of 2) both inside 'micro-batch 3 forward' for `seconds`; rank r has
    issued issued[r] collectives on the group (`when`: called halfway, may change them).
    Returns each rank's message."""
    store = dist.HashStore()
    fired = {}
    wds = [CollectiveWatchdog(store, r, 2, timeout, poll_s=10.0,
                              on_timeout=lambda m, r=r: fired.setdefault(r, m))
           for r in (0, 1)]
    with contextlib.ExitStack() as blocks:
        for r, wd in enumerate(wds):
            blocks.enter_context(wd.watch("micro-batch 3 forward", ranks=[0, 1],
                                          progress=lambda r=r: issued[r]))
        time.sleep(seconds / 2)
        if when is not None:
            when()
        time.sleep(seconds / 2)
    for wd in wds:
        wd.close()
    return fired


def test_a_rank_stuck_between_two_collectives_of_a_block_is_named():
    """Both ranks entered the forward; rank 0 waits in its 42nd collective of the group,
    rank 1 is stuck before it (41 issued). Both reports name rank 1; rank 1's says where
    its main thread is, whichever rank reported first."""
    fired = _both_overrun({0: 42, 1: 41})
    assert sorted(fired) == [0, 1]
    for r in (0, 1):
        assert fired[r].startswith(f"[watchdog rank {r}] collective micro-batch 3 forward did "
                                   "not complete within 0.3 s; ranks that did not arrive: [1]")
    full = next(m for m in fired.values() if "reported it first" not in m.splitlines()[0])
    assert ("  every rank entered it, but rank 1 has issued 41 collectives on its group and "
            "rank 0 42: rank 1 did not reach the collective the others wait in") in full
    assert "rank 1's main thread is here" in fired[1]


def test_a_rank_behind_because_it_waits_in_a_nested_watched_block_is_not_named():
    """tp2 dp2, --overlap-param-gather: rank 3 stops before it launches its parameter
    all-gather; its data-parallel partner, rank 1, waits for that all-gather in its next
    forward (a watched block over (1, 3) nested in the forward's, over the tensor-parallel
    group (0, 1)), so rank 1 has issued one tensor-parallel collective fewer than rank 0.
    The forward's overrun named rank 1, which was only waiting for rank 3. Now a member
    behind that waits in a nested watched block is left to that block's overrun: it names
    rank 3, and rank 0 stops on that report."""
    store = dist.HashStore()
    fired = {}
    wds = {r: CollectiveWatchdog(store, r, 4, 0.5, poll_s=0.2,
                                 on_timeout=lambda m, r=r: fired.setdefault(r, m))
           for r in (0, 1)}
    issued = {0: 42, 1: 41}
    with contextlib.ExitStack() as blocks:
        for r, wd in wds.items():
            blocks.enter_context(wd.watch("micro-batch 0 forward", ranks=[0, 1],
                                          progress=lambda r=r: issued[r]))
        time.sleep(0.3)  # rank 1's pre-hook waits for the all-gather rank 3 never launched
        blocks.enter_context(wds[1].watch("parameter all-gather wait", ranks=[1, 3]))
        time.sleep(2.0)
    for wd in wds.values():
        wd.close()
    assert sorted(fired) == [0, 1], fired
    assert fired[1].startswith("[watchdog rank 1] collective parameter all-gather wait did "
                               "not complete within 0.5 s; ranks that did not arrive: [3]"), \
        fired[1]
    assert "ranks that did not arrive: [3]" in fired[0], fired[0]
    assert "arrive: [1]" not in fired[0] + fired[1]


def test_a_block_where_every_rank_computes_is_given_more_time():
    """Equal counts past the deadline: both ranks are computing (compiling the layers on
    the first micro-batch can outlast the timeout), nothing fires; once rank 0 issues a
    collective rank 1 does not, a later deadline names rank 1."""
    issued = {0: 42, 1: 42}
    assert _both_overrun(issued) == {}
    fired = _both_overrun(issued, seconds=2.0, when=lambda: issued.update({0: 43}))
    assert sorted(fired) == [0, 1]
    for r in (0, 1):
        assert "ranks that did not arrive: [1]" in fired[r].splitlines()[0]


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


def _all_overrun(issued, world, timeout=0.3, seconds=1.5):
    """Every rank of `world` inside 'optimizer step' (ranks: all) for `seconds`; rank r's
    progress is issued[r] ([label, group, count] triples, as `issued_collectives_on`
    gives them). Returns each rank's message."""
    store = dist.HashStore()
    fired = {}
    wds = [CollectiveWatchdog(store, r, world, timeout, poll_s=10.0,
                              on_timeout=lambda m, r=r: fired.setdefault(r, m))
           for r in range(world)]
    with contextlib.ExitStack() as blocks:
        for r, wd in enumerate(wds):
            blocks.enter_context(wd.watch("optimizer step", progress=lambda r=r: issued[r]))
        time.sleep(seconds)
    for wd in wds:
        wd.close()
    return fired


def test_a_rank_level_on_one_group_and_behind_on_another_is_named():
    """The distributed optimizer's step: a grad-norm all-reduce over all ranks, then the
    parameter all-gather over the data-parallel group. Rank 1 is stuck between them: level
    with rank 0 on all ranks' group, one behind on the data-parallel group. Counted on one
    group only, both looked level and the block was given more time, until the process
    group's own timeout ended the run; counted per group, rank 1 is named."""
    fired = _all_overrun({0: [["all ranks", "w", 5], ["the data-parallel group", "d", 8]],
                          1: [["all ranks", "w", 5], ["the data-parallel group", "d", 7]]}, 2)
    assert sorted(fired) == [0, 1]
    full = next(m for m in fired.values() if "reported it first" not in m.splitlines()[0])
    assert "ranks that did not arrive: [1]" in full.splitlines()[0], full
    assert ("  every rank entered it, but rank 1 has issued 7 collectives on the data-parallel "
            "group and rank 0 8: rank 1 did not reach the collective the others wait in") in full


def test_counts_are_compared_only_within_each_group():
    """pp2 dp2: the two pipeline stages' data-parallel groups (0, 2) and (1, 3) issue
    different numbers of collectives (a stage's own buckets); every rank computing, level
    within its groups: no rank is named, the block gets more time."""
    dp = {0: ("d02", 10), 2: ("d02", 10), 1: ("d13", 7), 3: ("d13", 7)}
    issued = {r: [["all ranks", "w", 4], ["the data-parallel group", *dp[r]]] for r in range(4)}
    assert _all_overrun(issued, 4) == {}


def test_a_block_that_ends_while_its_overrun_is_examined_is_not_reported():
    """Rank 0 overruns a block it is slow in (not stuck); rank 1 already left it (with
    asynchronous collectives a rank goes on once it issued its own), so rank 0 waits up to
    the timeout for a count rank 1 never gives. Rank 0's block ends meanwhile. Before, the
    wait went on and then reported the block that had ended -- ending a healthy run --
    and rank 0's check-ins of the next block stayed unpublished throughout (another rank's
    report would have read them stale). Now the wait stops when the block ends, no report."""
    store = dist.HashStore()
    _checked_in(store, 1, 2, "micro-batch 1 forward", ranks=[0, 1])  # and left it
    wd0, fired = _watchdog(store, rank=0, world=2, timeout=1.0)
    with wd0.watch("micro-batch 1 forward", ranks=[0, 1], progress=lambda: 41):
        time.sleep(1.8)  # its deadline passed at 1.0 s, the counts' wait ends at 2.45 s
    with wd0.watch("micro-batch 1 backward", ranks=[0, 1]):
        time.sleep(1.2)
    wd0.close()
    assert fired == [], fired


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


def test_a_stopped_rank_says_which_phase_it_was_in():
    """`phase` writes nothing to the store; a rank that another's report stops while in
    one names it, and where its main thread is."""
    store = dist.HashStore()
    fired = []
    wd = CollectiveWatchdog(store, 1, 2, 30.0, on_timeout=fired.append, poll_s=0.1)
    with wd.phase("micro-batch 2 forward (pipeline stage 1)"):
        assert store.num_keys() == 0
        store.set(ABORT_KEY, "[watchdog rank 0] collective transfers did not complete")
        time.sleep(0.5)
    wd.close()
    assert len(fired) == 1
    assert fired[0].startswith(
        "[watchdog rank 1] stopping, in micro-batch 2 forward (pipeline stage 1), in no watched "
        "collective, because another rank's watchdog fired:\n  [watchdog rank 0] collective "
        "transfers did not complete\n  rank 1's main thread is here"), fired[0]


def test_a_rank_the_report_names_says_where_it_is_from_inside_a_watched_block():
    """Rank 1 is stuck inside the optimizer step's block (after its norm, before its
    parameter all-gather); rank 0's report, from the next forward's wait for that
    all-gather, names it. Rank 1's stop message said only that it waited inside its block;
    now it shows where its main thread is. A rank the report does not name still says
    only where it waits."""
    messages = {}
    for named in ("[1]", "[0]"):
        store = dist.HashStore()
        fired = []
        wd = CollectiveWatchdog(store, 1, 2, 30.0, on_timeout=fired.append, poll_s=0.1)
        with wd.watch("optimizer step", ranks=[0, 1]):
            store.set(ABORT_KEY, "[watchdog rank 0] collective parameter all-gather wait did "
                                 f"not complete within 3 s; ranks that did not arrive: {named}")
            time.sleep(0.5)
        wd.close()
        assert len(fired) == 1 and fired[0].startswith(
            "[watchdog rank 1] stopping, waiting in 'optimizer step' (arrived there), because "
            "another rank's watchdog fired:"), fired
        messages[named] = fired[0]
    assert "rank 1's main thread is here" in messages["[1]"]
    assert "\n  it names this rank: the others wait for it\n" in messages["[1]"]
    assert "main thread" not in messages["[0]"] and "names this rank" not in messages["[0]"]


def test_the_stuck_ranks_own_report_says_the_first_report_names_it():
    """Rank 1 is stuck inside the optimizer step; rank 0 left it (its all-gather is
    asynchronous) and rank 0's report, from where it waits next, came first and named
    rank 1. Rank 1's own overrun finds every member arrived and rank 0 silent: its report
    said 'ranks that did not arrive: []', as if no rank were to blame. Now it says that
    the first report names this rank, quotes it, and shows where its main thread is."""
    store = dist.HashStore()
    _checked_in(store, 0, 2, "optimizer step", ranks=[0, 1])  # and left it
    first = ("[watchdog rank 0] collective parameter all-gather wait did not complete "
             "within 0.3 s; ranks that did not arrive: [1]")
    store.add(FIRED_KEY, 1)
    store.set(ABORT_KEY, first)
    fired = []
    wd = CollectiveWatchdog(store, 1, 2, 0.3, poll_s=10.0, on_timeout=fired.append)
    with wd.watch("optimizer step", ranks=[0, 1], progress=lambda: 5):
        time.sleep(1.5)
    wd.close()
    assert len(fired) == 1, fired
    assert fired[0].startswith(
        "[watchdog rank 1] collective optimizer step did not complete within 0.3 s; the first "
        "report names this rank as the one the others wait for:\n  " + first + "\n"
        "  rank 1's main thread is here"), fired[0]


def test_a_rank_examining_its_own_overrun_stops_at_its_next_look_for_a_report():
    """Rank 1 is stuck inside the optimizer step, which rank 0 has left. Its deadline
    passes first and its monitor waits (up to the timeout) for rank 0's collective count,
    which never comes; meanwhile rank 0's report naming rank 1 arrives. Rank 1 looked for
    it only once that wait was over; now it stops at its next look (poll_s), saying the
    report names it and where its main thread is."""
    store = dist.HashStore()
    _checked_in(store, 0, 2, "optimizer step", ranks=[0, 1])  # and left it
    first = ("[watchdog rank 0] collective parameter all-gather wait did not complete "
             "within 2 s; ranks that did not arrive: [1]")
    fired = []
    wd = CollectiveWatchdog(store, 1, 2, 2.0, poll_s=0.1, on_timeout=fired.append)
    with wd.watch("optimizer step", ranks=[0, 1], progress=lambda: 5):
        time.sleep(2.6)  # deadline at 2 s; rank 0's count waited for from 2.3 s to 4.3 s
        store.add(FIRED_KEY, 1)
        store.set(ABORT_KEY, first)
        reported = time.monotonic()
        while not fired and time.monotonic() < reported + 3.0:
            time.sleep(0.02)
        stopped_after = time.monotonic() - reported
    wd.close()
    assert len(fired) == 1 and stopped_after < 1.0, (stopped_after, fired)
    assert fired[0].startswith(
        "[watchdog rank 1] stopping, waiting in 'optimizer step' (arrived there), because "
        "another rank's watchdog fired:\n  " + first + "\n  it names this rank: the others "
        "wait for it\n  rank 1's main thread is here"), fired[0]


class _LeftWhileLooked(list):
    """A phase stack whose last phase the main thread leaves right after the monitor saw
    it was not empty (the race between the check and the read, made certain)."""

    def __bool__(self):
        answer = len(self) > 0
        if answer:
            self.pop()
        return answer


def test_a_phase_left_while_the_stop_message_is_written_does_not_kill_the_monitor():
    """The monitor thread reads the main thread's phase stack without a lock: a check for
    a phase, then the read of the last one, which the main thread may have popped in
    between -- an IndexError in the monitor, which then ends without stopping the rank
    another rank's watchdog asked to stop."""
    wd, fired = _watchdog(dist.HashStore(), timeout=30.0)
    wd._phases = _LeftWhileLooked(["micro-batch 2 forward (pipeline stage 1)"])
    message = wd._stop_message("[watchdog rank 0] collective x did not complete")
    wd.close()
    assert message.startswith("[watchdog rank 0] stopping, in ") and \
        "in no watched collective, because another rank's watchdog fired" in message, message


def test_nested_blocks_still_report_the_one_that_overran():
    """Short action blocks inside a longer watched block (the way a step's blocks nest):
    none fires while each is short, even though together they outlast the timeout; once
    they are done, the outer block overrunning is reported with its own missing rank."""
    store = dist.HashStore()
    wd, fired = _watchdog(store, rank=0, world=2, timeout=0.5)
    for _ in range(8):  # 0.8 s of short blocks, none past 0.5 s
        with wd.phase("micro-batch 1 forward"), wd.watch("transfer", ranks=[0]):
            time.sleep(0.1)
    assert fired == []
    with wd.watch("gradient reduction", ranks=[0, 1]):  # rank 1 never comes
        _checked_in(store, 1, 2, "transfers", times=3,
                    points=[("micro-batch 0 activation", (1, 0))])
        for _ in range(3):
            with wd.watch("transfers", points=[("micro-batch 0 activation", (0, 1))]):
                pass
        time.sleep(1.0)
    wd.close()
    assert len(fired) == 1
    assert fired[0].startswith("[watchdog rank 0] collective gradient reduction did not "
                               "complete within 0.5 s; ranks that did not arrive: [1]\n  rank 1 "
                               "reached 'gradient reduction' 0 times"), fired[0]


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


def _late_timer_gather(rank, world_size):
    from megatron.logging_utils import Timers

    wd = build_watchdog(1.0)
    fired = []
    wd._on_timeout = fired.append  # report, do not end the process
    timers = Timers(1)
    timers("forward-backward", 1).start()
    if rank == 1:
        time.sleep(3.0)  # stuck before the log line
    timers("forward-backward", 1).stop()
    timers.max_times(["forward-backward"])
    wd.close()
    return fired


def test_the_gather_of_the_timers_readings_is_watched():
    """At a log interval the ranks all-gather their timer readings (and a save's timer,
    at every save). Rank 1 comes late: rank 0's watchdog names it and the phase (before,
    the gather was not watched: rank 0 waited for the process group's own timeout)."""
    fired = run_distributed(_late_timer_gather, 2)[0]
    assert fired and fired[0].startswith(
        "[watchdog rank 0] collective all-gather of the timers' readings (all ranks) did not "
        "complete within 1 s; ranks that did not arrive: [1]"), fired


def test_a_rank_whose_overrun_gets_no_verdict_reports_alone(monkeypatch):
    """One member per overrun reads the others' check-ins and leaves a verdict; the others
    wait for it. When it never comes (the reporting rank died meanwhile), a waiting rank
    reports on its own after a bounded wait instead of waiting for ever."""
    import megatron.watchdog_report as watchdog_report

    monkeypatch.setattr(watchdog_report, "VERDICT_WAIT_S", 0.3)
    store = dist.HashStore()
    _checked_in(store, 1, 3, "grads")  # rank 1 arrived, rank 2 did not
    wd, fired = _watchdog(store, rank=0, world=3, timeout=0.3)
    for rounds in range(1, 10):  # another rank reports on each of the block's deadlines
        store.add(f"{wd._overrun_key(_block_of('grads', 1, (0, 1, 2), rounds))}/reporter", 1)
    with wd.watch("grads"):
        time.sleep(1.8)
    wd.close()
    assert len(fired) == 1, fired
    assert fired[0].startswith("[watchdog rank 0] collective grads did not complete within "
                               "0.3 s; ranks that did not arrive: [2]\n"), fired[0]


def _block_of(name, count, ranks, rounds):
    """A watched block's record at its deadline number `rounds` (as `_overrun_key` sees
    it)."""
    from megatron.watchdog import _Block

    block = _Block(0.0, name, ((name, count, ranks),), None)
    block.rounds = rounds
    return block
