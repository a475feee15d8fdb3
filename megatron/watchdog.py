"""End a hung run with a message that names the collective and the ranks that never came.

A collective waits for every member of its group. When one rank is stuck (a deadlock, a
slow file system, a dead GPU), every other rank waits inside the collective until the
process-group timeout, then dies with an error that names neither the operation nor the
culprit. `CollectiveWatchdog` makes that message useful:

    wd = build_watchdog(timeout_s=config.parallel.distributed_timeout_minutes * 60)
    with wd.watch("all-reduce of gradients (dp group)", ranks=ps.ranks("dp")):
        model.finish_grad_sync()

On entering `watch(name, ranks)` a rank checks in: it counts, in memory, how many times it
has reached `name` (a dictionary write: the hot path never calls the store). Its monitor
thread -- a daemon thread, which runs while the main thread waits in a collective (the
backends release the GIL there) or sleeps -- publishes them every `publish_s` seconds
(min(poll_s, timeout_s / 4)), only when they changed: one `multi_set` of one key per group
of ranks this rank checked in with (the counts of that group's names), overwritten, so the
store does not grow with the steps and a rank writes to it O(1) times per interval however
many blocks it runs. The monitor notices when a block runs past `timeout_s`, publishes
this rank's check-ins, gives the others' monitors `publish_s` + SETTLE_S to publish
theirs, reads those of the group's `ranks` and prints, on this rank's stderr,

    [watchdog rank 0] collective all-reduce of gradients (dp group) did not complete within
    120 s; ranks that did not arrive: [1]

followed by the last point each missing rank did reach (as it last published: a rank
stopped since may have got further), what the run was doing
(`describe`, e.g. "at iteration 12") and where this rank's main thread waits, then ends
the process with `os._exit(EXIT_CODE)` (a hung collective cannot be unwound). An empty
list means every rank arrived and the collective itself is stuck (network, NCCL, or ranks
that issued collectives in different orders) -- or a rank is stuck inside a watched block
before its collective: its own report says where.

Inside a block that holds several collectives (a micro-batch's forward with its
tensor-parallel all-reduces) every rank arrives, and a rank stuck between two of them
looks like the ones waiting for it. A block given `progress` (`issued_collectives(group)`:
how many collectives this rank has issued on the group, as the backend counts them) tells
them apart when it overruns: each member leaves its count in the store, and those the
reporting member finds behind the others are the ranks that did not arrive (the rank behind prints where its main
thread is). When every member has issued as many, none is reported: they are all
computing (the first micro-batch compiles the layers, which can outlast the timeout), and
the block gets another `timeout_s` -- or they all wait in one collective that is itself
stuck, which the process group's own timeout ends. A block whose collectives run on
several groups counts per group (`issued_collectives_on`: the distributed optimizer's
step reduces over all ranks, then all-gathers over the data-parallel group), and a rank
behind the other members of any of them is named -- unless it waits in a watched block
nested in this one (at tp > 1, the forward's wait for --overlap-param-gather's
all-gather, over the data-parallel group): this block gets another `timeout_s`, and the
nested block's overrun, which comes due meanwhile (it began later), names the rank it
waits for (watched blocks wrap the wait for their collective, so such a rank is not the
one stuck computing). While it reports, the monitor goes on
publishing this rank's check-ins, and gives up when the block ends meanwhile (it was
slow, not stuck). A block's check-ins may also be several `points` with their own ranks: the
pipeline schedule's wait for a batch of transfers checks in once per transfer, with the
rank at its other end (megatron/train_step.py puts the schedule's actions under the
watchdog through the executor's hook). `phase(name)` records what this rank is doing
without a check-in (nothing to publish): a rank stopped in no watched block says it was
there.

The ranks waiting in one collective over the whole world overrun together: were each to
read every member's check-ins, the store would answer N^2 requests and, at thousands of
ranks, the report would come after the backend's own timeout. So one member per overrun
reads them -- the first to count itself in the overrun's key (an atomic count in the
store, per block, call and deadline) -- and leaves its verdict there: the report's first
line, or that every member computes (the block gets another `timeout_s`); the other
members wait for it, a few store requests each, and report alone if none comes (the
reporting rank died) within EXCHANGE_S + VERDICT_WAIT_S. Only the first rank whose report
comes (FIRED_KEY, an atomic count in the store) prints that report, with where its main
thread waits; the others print its first line only. The first one also leaves that line under ABORT_KEY in the store.
Every other rank's watchdog looks for it every `poll_s` seconds (also while it examines an
overrun of its own: a rank stuck in a block the others have left learns at its next look
that their report names it) and exits with the same status: a rank waiting inside a watched
block says so in one line; a rank in no watched block -- the one that never arrived: stuck
in data loading, in a file system call, in another collective -- also prints where its main
thread is, instead of waiting for the launcher's SIGTERM (which, on another node, never
comes). Those one-line echoes of the first report are the same on every rank: a watchdog
built with `announces=False` (the training run gives it to every process but global rank 0
and each node's first) leaves them out and exits in silence; what only this rank can say
(where a rank named as missing, or one in no watched block, is stuck) it always prints. A
rank whose store stops answering (the process hosting it has ended, and with it the job)
exits the same way STORE_GRACE_S later, unless it closed its watchdog meanwhile (its run
ended normally), and at once: no rank could read a report there any more.

`watching(name, group)` watches a block with the watchdog `build_watchdog` started in this
process (a hung collective ends the whole process, so there is one per process, like a
signal handler), and does nothing when there is none: the ranks' agreements
(megatron/agreed_exit.py), the checkpoint barriers and a save's gathers, the timers'
barriers and the gather of their readings, and the evaluation's reduction use it.

The overrun's reading and writing of the store and the report's text live in
megatron/watchdog_report.py (`OverrunReports`, which `CollectiveWatchdog` extends); its
names are importable from here as before.

Works with gloo and NCCL: the check-ins go through the store, not the backend. With NCCL
the collectives are asynchronous, so watch a point that waits for them (e.g. the gradient
sync's wait, or the host read of the loss), not the kernel launch. Every member of a group
must pass through the same watched names in the same order.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from megatron.watchdog_report import (  # noqa: F401 -- re-exported: the watchdog's API
    ABORT_KEY,
    AGAIN,
    EXCHANGE_S,
    FIRED_KEY,
    KEY_PREFIX,
    SEEN_KEY,
    SETTLE_S,
    STACK_FRAMES,
    VERDICT_WAIT_S,
    OverrunReports,
    Progress,
    _Block,
    _checkin_key,
    _group_id,
    _named_in,
    issued_collectives,
    issued_collectives_on,
    published_checkins,
)

EXIT_CODE = 124  # as coreutils `timeout`
POLL_S = 5.0  # how often each rank looks for ABORT_KEY, at most (see CollectiveWatchdog)
STORE_GRACE_S = 60.0  # after the store failed: time to close the watchdog normally
EXIT_LOOK_S = 0.1  # a rank waiting to exit looks at SEEN_KEY this often (the first
MAX_EXIT_LOOK_S = 0.5  # reporter); the others twice as long each time, up to this


class CollectiveWatchdog(OverrunReports):
    """Watches blocks of code that run collectives; see the module docstring.

    Args:
        store: a torch.distributed Store every rank shares (e.g. the default group's
            TCPStore, see `build_watchdog`); set/check/get/add are used, and
            multi_set/multi_get where the store has them.
        rank, world_size: this process's global rank and the world size.
        timeout_s: how long one watched block may run.
        on_timeout: called with the message instead of printing it and ending the process
            (for tests and embedding); default: print to `stream`, flush, os._exit(EXIT_CODE).
            Also called with the message of a stop another rank's watchdog asked for.
        stream: where the default handler prints (default sys.stderr).
        poll_s: how often to look for another rank's ABORT_KEY (default
            min(POLL_S, timeout_s / 4): with a timeout of seconds, the other ranks stop
            within a fraction of it after a report, not POLL_S later).
        describe: returns what the run is doing ("at iteration 12"), for the messages.
        publish_s: how often the monitor publishes this rank's new check-ins (default
            min(poll_s, timeout_s / 4): every rank's are in the store soon enough for a
            report, and the store gets one write per rank and interval).
        announces: whether this rank prints the lines every rank would print alike
            (another rank's report came first; this rank waited in a watched block);
            without, `on_timeout` gets "" for them.
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *,
                 on_timeout: Optional[Callable[[str], None]] = None,
                 stream: Optional[TextIO] = None, poll_s: Optional[float] = None,
                 describe: Optional[Callable[[], str]] = None,
                 publish_s: Optional[float] = None, announces: bool = True) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.poll_s = min(POLL_S, self.timeout_s / 4) if poll_s is None else float(poll_s)
        self.publish_s = min(self.poll_s, self.timeout_s / 4) if publish_s is None \
            else float(publish_s)
        self.describe = describe
        self.announces = announces
        self._on_timeout = on_timeout or self._print_and_exit
        self._stream = stream
        self._counts: dict = {}  # point -> how many times this rank reached it
        self._world = tuple(range(world_size))
        self._checkins: Dict[str, Dict[str, int]] = {}  # group key -> {point: count}
        self._changed: set = set()  # group keys with check-ins not yet published
        self._active: List[_Block] = []  # innermost last
        self._phases: List[str] = []  # `phase` blocks, innermost last
        self._cond = threading.Condition()
        self._wake_at = -math.inf  # when the monitor, asleep, wakes up (-inf: it is awake)
        self._closed = False
        self._store_lost: Optional[tuple] = None  # (since, error) while the store fails
        self._fired = False  # this rank's own deadline passed
        self._reported_first = False  # and its report came first: it left ABORT_KEY
        self._stopping: Optional[str] = None  # why to stop, as `_poll` found it
        self._left_overruns: list = []  # overruns whose keys may outlive them, see sweep
        self._lingers = False  # stopping for a report in the store (naming this rank or others)
        self._next_publish = time.monotonic() + self.publish_s  # the monitor's next publish
        self._next_poll = time.monotonic() + self.poll_s  # and its next look for a stop
        self._thread = threading.Thread(target=self._monitor, name="collective-watchdog",
                                        daemon=True)
        self._thread.start()

    # --- the API training uses --------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, name: str, ranks: Optional[Sequence[int]] = None, *,
              points: Optional[Sequence[Tuple[str, Optional[Sequence[int]]]]] = None,
              progress: Optional[Progress] = None) -> Iterator[None]:
        """Run the block under the watchdog. `name` says what the block waits for (it
        appears in the message); `ranks` are the global ranks of the group that must all
        reach it (default: the whole world).

        `points`: where the block's check-ins go when they are not (`name`, `ranks`):
        (point, ranks that must reach it) pairs, one check-in each -- e.g. the transfers
        of one batch of pipeline sends and receives, each with the rank at its other end
        (the two ends' batches differ; each transfer has one name at both). A rank is
        missing when it has reached one of them fewer times than this rank.
        `progress`: how many collectives this rank has issued on the block's group so far
        (`issued_collectives`), or on each of the groups the block issues collectives on
        (`issued_collectives_on`); read only when the block overruns with every rank
        arrived, and compared with what the other members, in the same block, leave in
        the store: those behind on a group did not reach the collective the others wait
        in (a rank stuck in the computation between two collectives of the block)."""
        checked = []
        for point, members in points or ((name, ranks),):
            count = self._counts.get(point, 0) + 1
            self._counts[point] = count
            checked.append((point, count, self._world if members is None else tuple(members)))
        entry = _Block(time.monotonic() + self.timeout_s, name, tuple(checked), progress)
        # No store call here: the monitor publishes the check-ins (see `publish`). It is
        # woken only when this deadline comes before its own wake-up (the first block
        # after a quiet spell, with a timeout shorter than `publish_s`): a wake-up per
        # block would cost a thread switch each, and leaving a block never needs one.
        with self._cond:
            for point, count, members in checked:
                group = _checkin_key(_group_id(members), self.rank)
                self._checkins.setdefault(group, {})[point] = count
                self._changed.add(group)
            self._active.append(entry)
            if entry.deadline < self._wake_at:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._active.remove(entry)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record `name` as what this rank is doing during the block, with no check-in
        and no deadline (nothing in the store): a stop message that finds this rank in no
        watched block says it was there ('in micro-batch 3 forward (pipeline stage 1)')."""
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    def publish(self) -> None:
        """Write this rank's check-ins of the groups it checked in with since the last
        call to the store: one `multi_set`, of one key per such group, holding the counts
        of the group's names; nothing when no check-in came. The monitor calls it every
        `publish_s` seconds and when a block overruns. After a store failure it does
        nothing (`_poll` then ends the rank, see there)."""
        if self._store_lost is not None:
            return
        with self._cond:
            changed = {key: dict(self._checkins[key]) for key in self._changed}
            self._changed.clear()
        if not changed:
            return
        keys, values = list(changed), [json.dumps(c) for c in changed.values()]
        try:
            if hasattr(self.store, "multi_set"):
                self.store.multi_set(keys, values)
            else:
                for key, value in zip(keys, values):
                    self.store.set(key, value)
        except Exception as exc:
            self._store_lost = (time.monotonic(), exc)

    def close(self) -> None:
        """Stop the monitor thread (the watchdog does nothing afterwards) and publish the
        check-ins it had not published yet; `watching` no longer uses it. Without that
        last publication a peer still inside a block this rank went through (a
        broadcast's receiver after its source finished, a collective that is itself
        stuck) would read this rank's count from before it and name it as not arrived."""
        global _current
        if _current is self:
            _current = None
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self.publish()  # nothing when no check-in is new or the store failed

    def __enter__(self) -> "CollectiveWatchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------
    def _monitor(self) -> None:
        """Wait for the earliest deadline of the active blocks, publishing this rank's
        check-ins every `publish_s` seconds and looking for a reason to stop (another
        rank's ABORT_KEY, or the store gone) every `poll_s` seconds, also while it
        examines an overrun (outside the lock: the main thread must never wait for a
        store call to enter or leave a block); report an overrun or a stop."""
        while True:
            expired = self._wait_for_event(min(self._next_poll, self._next_publish))
            if self._closed:
                return
            if expired is not None:
                message = self._overrun_message(expired)
                if message is not None:
                    break
            else:
                self._publish_if_due()
                self._poll_if_due()
            if self._stopping is not None:
                message = self._stop_message(self._stopping)
                # the rank the report names prints its stack once it sees it (within
                # poll_s): leaving now would have the launcher end that rank first; and
                # the named rank itself waits too: its exit would break the collective
                # another rank still waits in, which would fail there (status 1, a
                # "connection closed" line) before its own look at the store found the
                # report. No one would see anything when the store is gone.
                self._lingers = self._store_lost is None
                break
        self._on_timeout(message)

    def _poll_if_due(self) -> None:
        """`_poll` when `poll_s` has passed since the monitor last did (sooner after
        the store failed: when its grace period ends); its reason to stop, if any, goes
        to `_stopping`. Then removes the overrun keys no member needs any more."""
        if time.monotonic() < self._next_poll:
            return
        self._stopping, wait_s = self._poll()
        self._next_poll = time.monotonic() + wait_s
        if self._stopping is None and self._store_lost is None:
            self.sweep_overruns()

    def _stop_message(self, abort: str) -> str:
        """The message of a stop `_poll` found a reason for, with where the main thread
        is when it waits in no watched block or the report names this rank."""
        with self._cond:
            inside = self._active[-1].name if self._active else None
        named = self.rank in _named_in(abort)
        if inside is not None and not named and not self.announces:  # waited, as the others
            return ""
        phases = self._phases[-1:]  # one read: the main thread may leave its phase meanwhile
        message = self.abort_message(abort, inside, phases[0] if phases else None)
        if named:  # the others wait for this rank (maybe from another block)
            message += "\n  it names this rank: the others wait for it"
        if inside is None or named:  # maybe the one stuck
            message += "\n" + self.main_thread_stack()
        return message

    def _wait_for_event(self, next_poll: float) -> Optional[_Block]:
        """Sleep until the watchdog closes (None), a block's deadline passes (its entry)
        or `next_poll` comes (None)."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                entry = min(self._active, key=lambda e: e.deadline) if self._active else None
                if entry is not None and entry.deadline <= now:
                    return entry
                if now >= next_poll:
                    return None
                self._wake_at = next_poll if entry is None else min(entry.deadline, next_poll)
                self._cond.wait(self._wake_at - now)
                self._wake_at = -math.inf  # awake: reads `_active` before it sleeps again
        return None

    def _poll(self) -> Tuple[Optional[str], float]:
        """(why to stop, or None; seconds to the next poll). Why: another rank's
        ABORT_KEY line, or that the store failed (its connection closed: the process
        hosting it -- torchrun's agent on the first node, or rank 0 -- has ended, so the
        job is over) and this watchdog was not closed within the grace period after
        (min(STORE_GRACE_S, timeout_s): a rank ending normally closes it at once). A rank
        stuck outside any collective would otherwise wait for ever on a node whose
        launcher sees nothing wrong. The store is not asked again once it failed: a
        client whose server has gone may wait for its own timeout on the next call."""
        if self._store_lost is None:
            try:
                found = self.store.check([ABORT_KEY])
                line = self.store.get(ABORT_KEY).decode(errors="replace") if found else None
                return line, self.poll_s
            except Exception as exc:
                self._store_lost = (time.monotonic(), exc)
        since, first = self._store_lost
        left = since + min(STORE_GRACE_S, self.timeout_s) - time.monotonic()
        if left > 0:
            return None, left
        return (f"the job's rendezvous store stopped answering "
                f"({str(first).splitlines()[0] if str(first) else type(first).__name__}): "
                "the process that hosts it (torchrun's agent on the first node, or rank 0) "
                "has ended, so the rest of the job is gone"), self.poll_s

    def abort_message(self, abort: str, inside: Optional[str],
                      phase: Optional[str] = None) -> str:
        """The message of a stop `_poll` found a reason for (`abort`: another rank's
        watchdog line, or the lost store's); `inside`: the innermost watched block,
        `phase`: the innermost `phase` block."""
        where = (f"waiting in '{inside}' (arrived there)" if inside is not None else
                 f"{'in ' + phase + ', ' if phase else ''}in no watched collective")
        doing = self._doing()
        why = ("another rank's watchdog fired" if abort.startswith("[watchdog rank")
               else "the job has ended elsewhere")
        return (f"[watchdog rank {self.rank}] stopping{' ' + doing if doing else ''}, "
                f"{where}, because {why}:\n  {abort}")

    def _still_in(self, block: _Block, seconds: float) -> bool:
        """Wait `seconds` (publishing this rank's check-ins every `publish_s`: another
        rank's report may read them meanwhile, and looking for a reason to stop every
        `poll_s`: the first report may come meanwhile, and name this rank); whether
        `block` is still running, the watchdog open and no reason to stop found. Used by
        the monitor while it reports an overrun."""
        end = time.monotonic() + seconds
        while True:
            with self._cond:
                now = time.monotonic()
                left = end - now
                if left > 0:
                    self._cond.wait_for(lambda: self._closed, max(0.0, min(
                        left, self._next_publish - now, self._next_poll - now)))
                if self._closed or block not in self._active:
                    return False
            self._publish_if_due()
            self._poll_if_due()
            if self._stopping is not None:
                return False
            if time.monotonic() >= end:
                return True

    def _publish_if_due(self) -> None:
        """`publish` when `publish_s` has passed since the monitor last did."""
        now = time.monotonic()
        if now >= self._next_publish:
            self.publish()
            self._next_publish = now + self.publish_s

    def _print_and_exit(self, message: str) -> None:
        """Print the report and end the process with EXIT_CODE. A rank whose own deadline
        passed waits until every rank has printed its stop message (counted in SEEN_KEY,
        see `_last_word`), at most max(POLL_S, `poll_s`) + 1 s (a rank that died never
        counts), so that every other rank sees its ABORT_KEY while the store is up (it
        may live in this node's launcher, which ends with this process), also one whose
        monitor is busy with its own overrun meanwhile; so does a rank stopping for a
        report that names others, so that the named ranks print where they are before
        the launcher, seeing this one exit, ends them (a launcher ends this rank sooner
        once the others have exited), and a rank the report names, so that its exit does
        not fail a rank still in a collective with it before that rank has seen the
        report; not a rank stopping because the store is gone (no rank can read a report
        there), and none once the store fails. Meanwhile the main
        thread fails in its collective: its output is silenced (the report is this rank's
        last word) and an interpreter exit still ends with EXIT_CODE."""
        stream = self._stream or sys.stderr
        if message:  # "": a rank that does not announce what the others say
            print(message, file=stream, flush=True)
        sys.stdout.flush()
        waits = self._fired or self._lingers
        if waits:
            atexit.register(os._exit, EXIT_CODE)
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                os.dup2(devnull, fd)
        if self._store_lost is None:
            said = threading.Event()
            threading.Thread(target=self._last_word, args=(waits, said), daemon=True,
                             name="collective-watchdog-exit").start()
            said.wait(max(POLL_S, self.poll_s) + 1)
        os._exit(EXIT_CODE)

    def _last_word(self, waits: bool, said: threading.Event) -> None:
        """Count this rank in SEEN_KEY (its stop message is printed: a rank the report
        names has shown where it is); with `waits`, then look at the count until every
        rank is in (every other rank has seen the report), every EXIT_LOOK_S for the rank
        that reported first, less and less often for the others (a few store requests
        each, however many ranks wait). Sets `said` when done, or at once when the store
        fails; `_print_and_exit` waits for it at most its old fixed wait (a store that
        stops answering cannot hold the exit longer)."""
        try:
            seen = int(self.store.add(SEEN_KEY, 1))
            pause = EXIT_LOOK_S
            while waits and seen < self.world_size:
                time.sleep(pause)
                seen = int(self.store.add(SEEN_KEY, 0))
                if not self._reported_first:
                    pause = min(2 * pause, MAX_EXIT_LOOK_S)
        except Exception:  # the store is gone: no one can read the report there any more
            pass
        said.set()


class NullWatchdog:
    """Same API, does nothing (a single process has no one to wait for)."""

    describe = None

    @contextlib.contextmanager
    def watch(self, name: str, ranks: Optional[Sequence[int]] = None, **kwargs) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


_current: Optional[CollectiveWatchdog] = None  # build_watchdog's, until closed


def watching(name: str, group=None):
    """`watch(name, ranks of group)` on the watchdog `build_watchdog` started in this
    process (`group`: a torch.distributed group, None for the world), else a block that
    does nothing. Every member of `group` must pass through the same names in the same
    order (as through its collectives). Nothing either when `group` is this rank alone
    (its collectives wait for no one)."""
    wd = _current
    if wd is None:
        return contextlib.nullcontext()
    ranks = None
    if group is not None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:
            return contextlib.nullcontext()
    return wd.watch(name, ranks=ranks)


def close_current() -> None:
    """Close the watchdog `build_watchdog` started in this process, if any."""
    if _current is not None:
        _current.close()


def build_watchdog(timeout_s: float, store=None, announces: bool = True):
    """A `CollectiveWatchdog` on the default process group's store (torch.distributed must
    be initialised), or a `NullWatchdog` when it is not or the world has one rank.
    `announces`: see `CollectiveWatchdog`.

    Give the process group a slightly longer timeout than `timeout_s` (e.g. + 60 s), so
    the watchdog's message comes before the backend's own timeout error. The watchdog
    becomes the one `watching` uses, until it is closed.
    """
    import torch.distributed as dist

    global _current
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return NullWatchdog()
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    _current = CollectiveWatchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s,
                                  announces=announces)
    return _current


__all__ = ["ABORT_KEY", "CollectiveWatchdog", "NullWatchdog", "build_watchdog", "close_current",
           "EXIT_CODE", "issued_collectives", "issued_collectives_on", "published_checkins",
           "watching"]
