"""End a hung run with a message that names the collective and the ranks that never came.

A collective waits for every member of its group. When one rank is stuck (a deadlock, a
slow file system, a dead GPU), every other rank waits inside the collective until the
process-group timeout, then dies with an error that names neither the operation nor the
culprit. `CollectiveWatchdog` makes that message useful:

    wd = build_watchdog(timeout_s=config.parallel.distributed_timeout_minutes * 60)
    with wd.watch("all-reduce of gradients (dp group)", ranks=ps.ranks("dp")):
        model.finish_grad_sync()

On entering `watch(name, ranks)` a rank checks in: it writes how many times it has reached
`name` under its own key of the job's TCPStore (one key per rank and name, overwritten, so
the store does not grow with the steps). A daemon thread notices when the block runs past
`timeout_s`, reads the check-ins of the group's `ranks` and prints, on this rank's stderr,

    [watchdog rank 0] collective all-reduce of gradients (dp group) did not complete within
    120 s; ranks that did not arrive: [1]

followed by the last point each missing rank did reach, what the run was doing
(`describe`, e.g. "at iteration 12") and where this rank's main thread waits, then ends
the process with `os._exit(EXIT_CODE)` (a hung collective cannot be unwound). An empty
list means every rank arrived and the collective itself is stuck (network, NCCL, or ranks
that issued collectives in different orders) -- or a rank is stuck inside a watched block
before its collective: its own report says where.

Only the first rank whose deadline passes (FIRED_KEY, an atomic count in the store) prints
that report, with where its main thread waits; the others waiting for the same ranks print
its first line only. The first one also leaves that line under ABORT_KEY in the store.
Every other rank's watchdog looks for it every `poll_s` seconds and exits with the same
status: a rank waiting inside a watched block says so in one line; a rank in no watched
block -- the one that never arrived: stuck in data loading, in a file system call, in
another collective -- also prints where its main thread is, instead of waiting for the
launcher's SIGTERM (which, on another node, never comes). A rank whose store stops
answering (the process hosting it has ended, and with it the job) exits the same way
STORE_GRACE_S later, unless it closed its watchdog meanwhile (its run ended normally).

`watching(name, group)` watches a block with the watchdog `build_watchdog` started in this
process (a hung collective ends the whole process, so there is one per process, like a
signal handler), and does nothing when there is none: the ranks' agreements
(megatron/agreed_exit.py), the checkpoint barriers and the evaluation's reduction use it.

Works with gloo and NCCL: the check-ins go through the store, not the backend. With NCCL
the collectives are asynchronous, so watch a point that waits for them (e.g. the gradient
sync's wait, or the host read of the loss), not the kernel launch. Every member of a group
must pass through the same watched names in the same order.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, List, Optional, Sequence, TextIO, Tuple

EXIT_CODE = 124  # as coreutils `timeout`
KEY_PREFIX = "collective-watchdog"
ABORT_KEY = f"{KEY_PREFIX}/abort"  # the first line of the report of the rank that fired
FIRED_KEY = f"{KEY_PREFIX}/fired"  # how many ranks' deadlines passed: the first reports
POLL_S = 5.0  # how often each rank looks for ABORT_KEY
STORE_GRACE_S = 60.0  # after the store failed: time to close the watchdog normally
STACK_FRAMES = 4  # innermost frames of the main thread a report shows


class CollectiveWatchdog:
    """Watches blocks of code that run collectives; see the module docstring.

    Args:
        store: a torch.distributed Store every rank shares (e.g. the default group's
            TCPStore, see `build_watchdog`); only set/check/get/add are used.
        rank, world_size: this process's global rank and the world size.
        timeout_s: how long one watched block may run.
        on_timeout: called with the message instead of printing it and ending the process
            (for tests and embedding); default: print to `stream`, flush, os._exit(EXIT_CODE).
            Also called with the message of a stop another rank's watchdog asked for.
        stream: where the default handler prints (default sys.stderr).
        poll_s: how often to look for another rank's ABORT_KEY.
        describe: returns what the run is doing ("at iteration 12"), for the messages.
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *,
                 on_timeout: Optional[Callable[[str], None]] = None,
                 stream: Optional[TextIO] = None, poll_s: float = POLL_S,
                 describe: Optional[Callable[[], str]] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)
        self.describe = describe
        self._on_timeout = on_timeout or self._print_and_exit
        self._stream = stream
        self._counts: dict = {}
        self._active: List[tuple] = []  # (deadline, name, count, ranks), innermost last
        self._cond = threading.Condition()
        self._closed = False
        self._store_lost: Optional[tuple] = None  # (since, error) while the store fails
        self._fired = False  # this rank's own deadline passed
        self._thread = threading.Thread(target=self._monitor, name="collective-watchdog",
                                        daemon=True)
        self._thread.start()

    # --- the API training uses --------------------------------------------------------
    @contextlib.contextmanager
    def watch(self, name: str, ranks: Optional[Sequence[int]] = None) -> Iterator[None]:
        """Run the block under the watchdog. `name` says what the block waits for (it
        appears in the message); `ranks` are the global ranks of the group that must all
        reach it (default: the whole world)."""
        count = self._counts.get(name, 0) + 1
        self._counts[name] = count
        self.store.set(self._key(name, self.rank), str(count))
        members = list(range(self.world_size)) if ranks is None else list(ranks)
        entry = (time.monotonic() + self.timeout_s, name, count, members)
        with self._cond:
            self._active.append(entry)
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._active.remove(entry)
                self._cond.notify()

    def missing_ranks(self, name: str, count: int, ranks: Sequence[int]) -> List[int]:
        """Members of `ranks` that have reached `name` fewer than `count` times."""
        return [r for r in ranks if self._reached(name, r) < count]

    def close(self) -> None:
        """Stop the monitor thread (the watchdog does nothing afterwards); `watching` no
        longer uses it."""
        global _current
        if _current is self:
            _current = None
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self) -> "CollectiveWatchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------
    @staticmethod
    def _key(name: str, rank: int) -> str:
        return f"{KEY_PREFIX}/{name}/rank{rank}"

    def _reached(self, name: str, rank: int) -> int:
        key = self._key(name, rank)
        if not self.store.check([key]):  # never reached: get() would block
            return 0
        return int(self.store.get(key))

    def _monitor(self) -> None:
        """Wait for the earliest deadline of the active blocks, looking for another
        rank's ABORT_KEY every `poll_s` seconds (outside the lock: the main thread must
        never wait for a store call to enter or leave a block); report either once."""
        next_poll = time.monotonic() + self.poll_s
        while True:
            expired = self._wait_for_event(next_poll)
            if self._closed:
                return
            if expired is not None:
                _, name, count, ranks = expired
                message = self.timeout_message(name, count, ranks)
                self._fired, first = True, self._first_to_fire()
                if first:
                    self._leave_abort(message.splitlines()[0])
                    message += "\n" + self.main_thread_stack()
                else:  # the same hang: the first rank's report has the details
                    message = (message.splitlines()[0] +
                               " (another rank's watchdog reported it first)")
                break
            abort, wait_s = self._poll()
            next_poll = time.monotonic() + wait_s
            if abort is not None:
                with self._cond:
                    inside = self._active[-1][1] if self._active else None
                message = self.abort_message(abort, inside)
                if inside is None:  # not waiting for the others: maybe the one stuck
                    message += "\n" + self.main_thread_stack()
                break
        self._on_timeout(message)

    def _first_to_fire(self) -> bool:
        """Whether no other rank's deadline passed before this one's (an atomic count in
        the store; True when the store cannot be read)."""
        try:
            return int(self.store.add(FIRED_KEY, 1)) == 1
        except Exception:
            return True

    def _wait_for_event(self, next_poll: float) -> Optional[tuple]:
        """Sleep until the watchdog closes (None), a block's deadline passes (its entry)
        or `next_poll` comes (None)."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                entry = min(self._active, key=lambda e: e[0]) if self._active else None
                if entry is not None and entry[0] <= now:
                    return entry
                if now >= next_poll:
                    return None
                self._cond.wait((next_poll if entry is None else min(entry[0], next_poll))
                                - now)
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

    def _leave_abort(self, line: str) -> None:
        """Ask every other rank's watchdog to stop (best effort: the store may be gone)."""
        try:
            self.store.set(ABORT_KEY, line)
        except Exception:
            pass

    def _doing(self) -> str:
        if self.describe is None:
            return ""
        try:
            return self.describe()
        except Exception:  # the report matters more than this detail
            return ""

    def abort_message(self, abort: str, inside: Optional[str]) -> str:
        """The message of a stop `_poll` found a reason for (`abort`: another rank's
        watchdog line, or the lost store's)."""
        where = (f"waiting in '{inside}' (arrived there)" if inside is not None else
                 "in no watched collective")
        doing = self._doing()
        why = ("another rank's watchdog fired" if abort.startswith("[watchdog rank")
               else "the job has ended elsewhere")
        return (f"[watchdog rank {self.rank}] stopping{' ' + doing if doing else ''}, "
                f"{where}, because {why}:\n  {abort}")

    def main_thread_stack(self) -> str:
        """Where the main thread is: its innermost STACK_FRAMES frames, innermost last."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None:
            return f"  rank {self.rank}'s main thread: unknown"
        frames = traceback.extract_stack(frame)[-STACK_FRAMES:]
        lines = [f"  rank {self.rank}'s main thread is here (innermost last):"]
        for f in frames:
            lines.append(f"    {f.filename}:{f.lineno} in {f.name}" +
                         (f": {f.line.strip()}" if f.line else ""))
        return "\n".join(lines)

    def timeout_message(self, name: str, count: int, ranks: Sequence[int]) -> str:
        """The message for `name` (reached `count` times here) not completing in time."""
        try:
            missing = self.missing_ranks(name, count, ranks)
        except Exception as exc:  # the store itself is gone (rank 0 died)
            return (f"[watchdog rank {self.rank}] collective {name} did not complete within "
                    f"{self.timeout_s:g} s; the rendezvous store cannot be read ({exc}), so the "
                    "ranks that did not arrive are unknown (rank 0, which hosts it, may be dead)")
        doing = self._doing()
        lines = [f"[watchdog rank {self.rank}] collective {name} did not complete within "
                 f"{self.timeout_s:g} s{' ' + doing if doing else ''}; ranks that did not "
                 f"arrive: {missing}"]
        for r in missing:
            lines.append(f"  rank {r} reached '{name}' {self._reached(name, r)} times; "
                         f"this rank is at its call number {count}")
        if not missing:
            lines.append("  every rank arrived: the collective itself is stuck (network or NCCL "
                         "trouble, or ranks issuing collectives in different orders), or a "
                         "rank is stuck inside the block before its collective (its own "
                         "report says where)")
        return "\n".join(lines)

    def _print_and_exit(self, message: str) -> None:
        """Print the report and end the process with EXIT_CODE. A rank whose own deadline
        passed first waits `poll_s` + 1 s, so that every other rank sees its ABORT_KEY
        while the store is up (it may live in this node's launcher, which ends with this
        process). Meanwhile the ranks that see it exit, and this rank's main thread fails
        in its collective: its output is silenced (the report is this rank's last word)
        and an interpreter exit still ends with EXIT_CODE."""
        stream = self._stream or sys.stderr
        print(message, file=stream, flush=True)
        sys.stdout.flush()
        if self._fired:
            atexit.register(os._exit, EXIT_CODE)
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                os.dup2(devnull, fd)
            time.sleep(self.poll_s + 1)
        os._exit(EXIT_CODE)


class NullWatchdog:
    """Same API, does nothing (a single process has no one to wait for)."""

    describe = None

    @contextlib.contextmanager
    def watch(self, name: str, ranks: Optional[Sequence[int]] = None) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


_current: Optional[CollectiveWatchdog] = None  # build_watchdog's, until closed


def watching(name: str, group=None):
    """`watch(name, ranks of group)` on the watchdog `build_watchdog` started in this
    process (`group`: a torch.distributed group, None for the world), else a block that
    does nothing. Every member of `group` must pass through the same names in the same
    order (as through its collectives)."""
    wd = _current
    if wd is None:
        return contextlib.nullcontext()
    ranks = None
    if group is not None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group)
    return wd.watch(name, ranks=ranks)


def close_current() -> None:
    """Close the watchdog `build_watchdog` started in this process, if any."""
    if _current is not None:
        _current.close()


def build_watchdog(timeout_s: float, store=None):
    """A `CollectiveWatchdog` on the default process group's store (torch.distributed must
    be initialised), or a `NullWatchdog` when it is not or the world has one rank.

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
    _current = CollectiveWatchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s)
    return _current


__all__ = ["ABORT_KEY", "CollectiveWatchdog", "NullWatchdog", "build_watchdog", "close_current",
           "EXIT_CODE", "watching"]
