"""megatron/watchdog.py's exit after a report: the ranks that wait before they exit (the
ones whose deadline passed, and those stopping for a report, the ranks it names too) leave as
soon as every rank has printed its stop message, at most max(POLL_S, poll_s) + 1 s, and
at once when the store fails. In one process: os._exit, the silencing of the output and
atexit are stood in for, and each rank's exit is timed."""
from __future__ import annotations

import contextlib
import io
import os
import threading
import time

import torch.distributed as dist

import megatron.watchdog as watchdog
from megatron.watchdog import ABORT_KEY, EXIT_CODE, SEEN_KEY, CollectiveWatchdog

REPORT = ("[watchdog rank 0] collective grads did not complete within 0.3 s; ranks that did "
          "not arrive: [1]")


class _Exits:
    """Stands in for `os` and `atexit` in megatron.watchdog: records when each monitor
    thread calls os._exit, and with which status."""

    devnull, O_WRONLY = os.devnull, os.O_WRONLY

    def __init__(self) -> None:
        self.at: dict = {}  # monitor thread -> (time, status)

    def _exit(self, status: int) -> None:
        self.at[threading.current_thread()] = (time.monotonic(), status)

    def open(self, *args) -> int:
        return -1

    def dup2(self, *args) -> None:
        pass

    def register(self, *args) -> None:
        pass

    def when(self, wd: CollectiveWatchdog, within: float = 10.0) -> float:
        """When `wd`'s monitor exited (waits for it up to `within` seconds)."""
        end = time.monotonic() + within
        while wd._thread not in self.at and time.monotonic() < end:
            time.sleep(0.02)
        assert wd._thread in self.at, "the rank did not exit"
        at, status = self.at[wd._thread]
        assert status == EXIT_CODE
        return at


@contextlib.contextmanager
def _exits(monkeypatch):
    exits = _Exits()
    monkeypatch.setattr(watchdog, "os", exits)
    monkeypatch.setattr(watchdog, "atexit", exits)
    yield exits


def _rank(store, rank, timeout=30.0, poll_s=0.1):
    """A watchdog of rank `rank` of 3 with the default handler, printing into its own
    buffer (`out`), looking for a report every `poll_s` (it waits at most
    max(POLL_S, poll_s) + 1 s to exit: 6 s)."""
    out = io.StringIO()
    wd = CollectiveWatchdog(store, rank, 3, timeout, stream=out, poll_s=poll_s)
    wd.out = out
    return wd


def test_the_reporter_exits_once_every_rank_has_printed(monkeypatch):
    """Ranks 0 and 2 wait for rank 1 in a watched block: rank 0 reports first, rank 2
    second (it looks for reports only every 10 s), rank 1 (in no block) prints where it
    is. Before, ranks 0 and 2 then slept max(POLL_S, poll_s) + 1 = 6 and 11 s; now they exit once all three have printed (about
    a second after the block began), rank 0 after rank 1. What each prints is unchanged."""
    store = dist.HashStore()
    with _exits(monkeypatch) as exits:
        started = time.monotonic()
        reporter, second, stuck = _rank(store, 0, 0.3), _rank(store, 2, 0.4, 10.0), _rank(store, 1)
        with reporter.watch("grads", ranks=[0, 1, 2]), second.watch("grads", ranks=[0, 1, 2]):
            ended = {wd.rank: exits.when(wd) - started for wd in (reporter, second, stuck)}
        for wd in (reporter, second, stuck):
            wd.close()
    assert ended[0] < 2.5 and ended[2] < 2.5, ended  # before: at 6.6 and 11.7 s
    # the reporter and the rank it names both wait for every stop message, then leave
    # within a look (MAX_EXIT_LOOK_S) of each other
    assert abs(ended[0] - ended[1]) < 1.0, ended
    assert store.add(SEEN_KEY, 0) == 3
    assert reporter.out.getvalue().startswith(REPORT + "\n  rank 1 reached 'grads' 0 times")
    assert "rank 0's main thread is here" in reporter.out.getvalue()
    assert second.out.getvalue() == (
        "[watchdog rank 2] collective grads did not complete within 0.4 s; ranks that did "
        "not arrive: [1] (another rank's watchdog reported it first)\n")
    assert stuck.out.getvalue().startswith(
        "[watchdog rank 1] stopping, in no watched collective, because another rank's "
        "watchdog fired:\n  " + REPORT + "\n  it names this rank: the others wait for it\n"
        "  rank 1's main thread is here")


def test_a_rank_stopping_for_a_report_on_others_exits_once_the_named_rank_printed(
        monkeypatch):
    """Rank 0 reported rank 1 (and counted itself as printed). Rank 2, named by no one,
    stops and waits; rank 1 sees the report a second later and prints where it is. Before,
    rank 2 slept 6 s whatever happened; now it leaves within a second of rank 1."""
    store = dist.HashStore()
    store.set(ABORT_KEY, REPORT)
    store.add(SEEN_KEY, 1)
    with _exits(monkeypatch) as exits:
        started = time.monotonic()
        other = _rank(store, 2)
        time.sleep(1.0)
        named = _rank(store, 1)
        ended = {wd.rank: exits.when(wd) - started for wd in (other, named)}
        other.close()
        named.close()
    assert ended[1] <= ended[2] < ended[1] + 1.0, ended  # before: at 6.1 s
    assert other.out.getvalue().startswith("[watchdog rank 2] stopping, in no watched "
                                           "collective, because another rank's watchdog fired")
    assert "rank 1's main thread is here" in named.out.getvalue()


def test_the_named_rank_exits_only_once_every_rank_has_printed(monkeypatch):
    """Rank 0 reported rank 1; rank 1 sees the report at once, rank 2 a second later.
    Rank 1 exited as soon as it had printed where it is: under tp2 dp2 its exit broke the
    collective a rank still waited in, which then failed there (status 1) before its own
    look at the store found the report. Now the named rank waits like the others."""
    store = dist.HashStore()
    store.set(ABORT_KEY, REPORT)
    store.add(SEEN_KEY, 1)
    with _exits(monkeypatch) as exits:
        started = time.monotonic()
        named, late = _rank(store, 1), _rank(store, 2, poll_s=1.0)
        ended = {wd.rank: exits.when(wd) - started for wd in (named, late)}
        named.close()
        late.close()
    assert ended[2] <= ended[1] < ended[2] + 1.5, ended  # before: rank 1 at ~0.1 s
    assert store.add(SEEN_KEY, 0) == 3
    assert "rank 1's main thread is here" in named.out.getvalue()


def test_a_rank_whose_named_rank_never_prints_waits_as_long_as_before(monkeypatch):
    """A rank that never prints (it died) never counts: the waiting rank exits after
    max(POLL_S, poll_s) + 1 s, as before (POLL_S shortened to 0.5 s here)."""
    store = dist.HashStore()
    store.set(ABORT_KEY, REPORT)
    store.add(SEEN_KEY, 1)
    monkeypatch.setattr(watchdog, "POLL_S", 0.5)
    with _exits(monkeypatch) as exits:
        started = time.monotonic()
        other = _rank(store, 2)
        ended = exits.when(other) - started
        other.close()
    assert 1.5 <= ended < 3.0, ended


class _FailingAdds:
    """A store that answers, except `add` (as a store whose host ends meanwhile)."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def add(self, *args):
        raise RuntimeError("Connection closed by peer")


def test_a_waiting_rank_exits_at_once_when_the_store_fails(monkeypatch):
    """Before, a rank stopping for a report on others slept 6 s even when the store was
    gone meanwhile (no rank can read the report there any more); now it exits at once."""
    store = dist.HashStore()
    store.set(ABORT_KEY, REPORT)
    with _exits(monkeypatch) as exits:
        started = time.monotonic()
        other = _rank(_FailingAdds(store), 2)
        ended = exits.when(other) - started
        other.close()
    assert ended < 1.0, ended
    assert other.out.getvalue().startswith("[watchdog rank 2] stopping, in no watched ")
