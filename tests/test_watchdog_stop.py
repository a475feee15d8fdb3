"""megatron/watchdog.py: how a report stops the ranks. 2 real gloo processes where rank 1
sleeps past the timeout end with rank 1 named; a fired watchdog stops the other ranks, with
one full report, each saying which phase it was in and where its main thread is; a rank
whose store is gone ends at once."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron.watchdog import ABORT_KEY, EXIT_CODE, FIRED_KEY, CollectiveWatchdog
from tests.dist_utils import free_port
from tests.test_watchdog import _checked_in, _watchdog

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
