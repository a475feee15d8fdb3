"""megatron/watchdog.py: a watched block that overruns names the ranks that never arrived,
within each group, inside a step's blocks and nested ones; the agreements, named points and
the timers' gather are watched. How a report stops the ranks: tests/test_watchdog_stop.py;
the check-ins' store traffic: tests/test_watchdog_store.py."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron.watchdog import CollectiveWatchdog, NullWatchdog, build_watchdog, published_checkins
from tests.dist_utils import run_distributed


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
