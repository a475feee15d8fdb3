"""Asynchronous checkpoint writing (`--async-save`): training blocks only for a CPU copy.

One save, seen from every rank (`checkpointing.save_checkpoint_async` drives it):

    blocking, on the training thread   wait for this rank's previous save; global rank 0
                                       makes `iter_XXXXXXX.tmp/` (world barrier); each
                                       writer (data-parallel rank 0 of a (tp, pp) pair)
                                       copies its state to CPU (pinned memory from CUDA)
    background thread, every writer    write the files, fsync them, then create the marker
                                       `.done.<mp_rank dir>` in the temporary directory
                                       (a writer that fails leaves `.failed.<mp_rank dir>`
                                       holding its error instead)
    background thread, global rank 0   wait until the marker of every (tp, pp) pair exists,
                                       remove the markers, rename the directory into place,
                                       write `latest_checkpointed_iteration.txt` last; on a
                                       failure marker stop at once, publishing nothing

Finishing needs no collective: the markers live in the checkpoint directory that all ranks
share (rank 0 renaming a directory that every rank wrote into already assumes a shared file
system), so nothing has to be agreed at a later iteration or at exit, and a rank that runs
ahead or exits first cannot deadlock anyone. A process waits for its own thread at its next
save and at exit (`AsyncSaver.wait`; the thread is not a daemon, so the interpreter waits
for it as well). A process killed while writing leaves the `.tmp` directory behind and the
tracker untouched: the previous checkpoint stays the one that is loaded (the next run on
that --save removes the directory: checkpoint_dirs.unfinished_saves_report).

A failure is reported once: the wait at the next save or at the end of the run exits
every rank with it (`agreed_wait`); while training goes on before that, the training
thread prints it on global rank 0 as soon as it is known (`report_failure`, called before
each step). Never the writer thread: it cannot know whether the run ends after its save
(the ranks agree on a signal or a duration exit only after the save began).
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Callable, Iterable, List, Optional

import torch

from megatron.agreed_exit import agree, agreed_report, exit_on_every_rank

MARKER_PREFIX = ".done."
FAILED_PREFIX = ".failed."

# How long a rank told to stop (SIGTERM, an error ending the process) waits for its save in
# flight to finish (`AsyncSaver.finish`): torchrun (torch 2.x) sends SIGKILL 30 s after its
# SIGTERM (its --shutdown-timeout, default 30; after a worker's failure the agent always
# waits 30 s), and the process still has to exit after the save.
STOP_FINISH_S = 20.0


# --------------------------------------------------------------------------- CPU snapshot
class _PinnedBuffers:
    """Pinned host buffers of the previous snapshot, reused in traversal order when shape
    and dtype match (page-locking gigabytes anew at every save would be slow)."""

    def __init__(self) -> None:
        self.buffers: List[torch.Tensor] = []
        self._next: List[torch.Tensor] = []

    def take(self, like: torch.Tensor) -> torch.Tensor:
        i = len(self._next)
        old = self.buffers[i] if i < len(self.buffers) else None
        if old is None or old.shape != like.shape or old.dtype != like.dtype:
            old = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
        self._next.append(old)
        return old

    def finish(self) -> None:
        self.buffers, self._next = self._next, []


def snapshot_to_cpu(obj, pinned: Optional[_PinnedBuffers] = None):
    """A copy of `obj` (nested dicts, lists, tuples, tensors, plain values) whose tensors
    are CPU copies that later training steps cannot change.

    CUDA tensors are copied asynchronously into pinned buffers, then the device is
    synchronised once; CPU tensors are cloned. A tensor reached twice is copied once (the
    copies stay shared, as torch.save would keep them)."""
    memo = {}
    saw_cuda = [False]

    def copy(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                t = x.detach()
                if t.is_cuda:
                    saw_cuda[0] = True
                    buf = pinned.take(t) if pinned is not None else torch.empty(
                        t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    memo[id(x)] = buf.copy_(t, non_blocking=True)
                else:
                    memo[id(x)] = t.clone()
            return memo[id(x)]
        if isinstance(x, dict):
            items = [(k, copy(v)) for k, v in x.items()]
            try:
                out = type(x)(items)
            except TypeError:  # e.g. a defaultdict: keep the data, drop the factory
                out = dict(items)
            if hasattr(x, "_metadata"):  # module state_dict versions, kept by torch.save
                out._metadata = x._metadata
            return out
        if isinstance(x, list):
            return [copy(v) for v in x]
        if isinstance(x, tuple):
            items = [copy(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x  # ints, floats, strings, None, dtypes: immutable

    out = copy(obj)
    if saw_cuda[0]:
        torch.cuda.synchronize()  # the background writer reads the pinned buffers
    if pinned is not None:
        pinned.finish()
    return out


# --------------------------------------------------------------------------- marker files
def marker_path(tmp_dir: str, rank_dir: str) -> str:
    """`<tmp_dir>/.done.<rank_dir>`: the writer of `rank_dir` finished and synced."""
    return os.path.join(tmp_dir, MARKER_PREFIX + rank_dir)


def mark_done(tmp_dir: str, rank_dir: str) -> None:
    """Create the marker of `rank_dir` (after its files were fsynced), durably."""
    path = marker_path(tmp_dir, rank_dir)
    with open(path, "w") as f:
        f.flush()
        os.fsync(f.fileno())


def failed_marker_path(tmp_dir: str, rank_dir: str) -> str:
    """`<tmp_dir>/.failed.<rank_dir>`: the writer of `rank_dir` failed; holds its error."""
    return os.path.join(tmp_dir, FAILED_PREFIX + rank_dir)


def mark_failed(tmp_dir: str, rank_dir: str, message: str) -> None:
    """Leave the failure marker of `rank_dir` with `message`, so that global rank 0 stops
    waiting for it at once. Best effort: the file system may be what failed."""
    try:
        with open(failed_marker_path(tmp_dir, rank_dir), "w") as f:
            f.write(message)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        pass


def _failure(tmp_dir: str, rank_dir: str) -> Optional[str]:
    """The message of `rank_dir`'s failure marker, or None when there is none."""
    try:
        with open(failed_marker_path(tmp_dir, rank_dir)) as f:
            return f.read().strip() or "(no message)"
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"(its failure message could not be read: {exc})"


# The longest pause between two looks at the markers: a look stats two files per writer
# still writing (tensor x pipeline writers) on the shared file system, and a save can run
# for minutes; every 20 ms that was thousands of metadata requests a second from rank 0.
MAX_POLL_S = 0.5


def wait_for_markers(tmp_dir: str, rank_dirs: Iterable[str], timeout_s: float,
                     poll_s: float = 0.02,
                     stop: Optional[Callable[[], bool]] = None) -> None:
    """Block until every marker of `rank_dirs` exists in `tmp_dir`, looking after
    `poll_s` seconds, then half as long again each time, up to MAX_POLL_S.

    Raises RuntimeError with the writer's message as soon as one of them left a failure
    marker, and TimeoutError naming the missing ones after `timeout_s` seconds (a writer
    died or its file system is not the one this rank sees); RuntimeError as soon as
    `stop()` is true (the save was abandoned) -- when it is a text, that text says why and
    the message names the missing ones (`AsyncSaver.stop_reason`)."""
    pending = set(rank_dirs)
    deadline = time.monotonic() + timeout_s
    unpublished = "the checkpoint was not published (the tracker still names the previous one)"
    while True:
        pending = {d for d in pending if not os.path.exists(marker_path(tmp_dir, d))}
        if not pending:
            return
        for d in sorted(pending):
            message = _failure(tmp_dir, d)
            if message is not None:
                raise RuntimeError(f"the writer of {d} failed: {message}; {unpublished}")
        reason = stop() if stop is not None else None
        if isinstance(reason, str):  # the run is stopping: no longer waiting for them
            raise RuntimeError(f"{reason}, no finished files from {', '.join(sorted(pending))} "
                               f"in {tmp_dir}; {unpublished}")
        if reason:
            raise RuntimeError(f"abandoned; {unpublished}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"after {timeout_s:.0f} s, no finished files from {', '.join(sorted(pending))} "
                f"in {tmp_dir}: a rank died while writing, or the ranks do not share this "
                f"directory; {unpublished}")
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, max(poll_s, MAX_POLL_S))


def writers_stopped(tmp_dir: str, rank_dirs: Iterable[str], timeout_s: float,
                    poll_s: float = 0.02) -> bool:
    """Whether every writer of `rank_dirs` left a marker in `tmp_dir` -- done or failed:
    it writes there no more -- within `timeout_s` seconds (polling)."""
    pending = set(rank_dirs)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = {d for d in pending if not (os.path.exists(marker_path(tmp_dir, d)) or
                                              os.path.exists(failed_marker_path(tmp_dir, d)))}
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def remove_markers(tmp_dir: str, rank_dirs: Iterable[str]) -> None:
    for d in rank_dirs:
        try:
            os.remove(marker_path(tmp_dir, d))
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- the writer
class AsyncSaver:
    """At most one save in flight per process, written by a background thread.

    `submit(work)` starts `work()` on a non-daemon thread; `wait()` joins it and re-raises
    its failure as RuntimeError; `report_failure()` prints that failure early, once.
    `snapshot(obj)` is `snapshot_to_cpu` with pinned buffers reused from the previous save
    (call it only after `wait()`). `publish(fn)` runs the
    step that makes a save visible unless `abandon()` (Ctrl-C) came first: both hold one
    lock, so once `abandon()` returns the tracker no longer changes.

    A run told to stop while its save is in flight finishes that save first, within
    STOP_FINISH_S (`finish`, called on the way out of an error, and from SIGTERM's handler:
    while a save is in flight, SIGTERM under its default handling first finishes the save,
    then ends the process by SIGTERM as before -- as a synchronous save, done before the
    next step, would have kept that checkpoint). Ctrl-C abandons it instead (`abandon`)."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._what = ""
        self._pinned = _PinnedBuffers()
        self._lock = threading.Lock()
        self._abandoned = False
        self._published = False
        self._report = self._reported = False
        self.tmp_dir: Optional[str] = None  # the directory the last submitted save writes
        # set by the thread itself when it ends: Thread.is_alive() is not to be trusted
        # after a join() that Ctrl-C interrupted (CPython 3.11 marks the thread stopped)
        self._finished = threading.Event()
        self._who = ""  # '[rank N]' for the line `finish` prints
        self._stop_at: Optional[float] = None  # time.monotonic() deadline set by `finish`
        self._stop_budget = 0.0
        self._guarding = False  # SIGTERM's handler is `_on_sigterm` (see `_guard_sigterm`)

    @property
    def pending(self) -> bool:
        """True while a submitted save has not been waited for."""
        return self._thread is not None

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def done(self) -> bool:
        """True when no save is in flight (a finished one may still need `wait()`)."""
        return self._thread is None or self._finished.is_set()

    def snapshot(self, obj):
        assert self.done(), "snapshot while the previous save still reads the buffers"
        return snapshot_to_cpu(obj, self._pinned)

    def submit(self, work: Callable[[], None], what: str, report: bool = True,
               tmp_dir: Optional[str] = None, who: str = "") -> None:
        """Run `work()` in the background; `what` names the save in error messages;
        `report`: `report_failure` prints a failure on this rank (one rank reports for
        all); `tmp_dir`: the directory it writes into (removed after an agreed failure);
        `who`: what names this rank in `finish`'s line ('[rank 3]')."""
        assert self._thread is None, "wait() for the previous save first"
        self._error, self._what, self._published, self.tmp_dir = None, what, False, tmp_dir
        self._who, self._stop_at = who, None
        self._report, self._reported = report, False
        self._finished.clear()

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # re-raised by wait(), printed by report_failure()
                self._error = exc
            finally:
                self._finished.set()

        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=False)
        self._thread.start()
        self._guard_sigterm()

    def report_failure(self) -> None:
        """Print the failure of the last save once it has failed, on the reporting rank,
        at most once. Call it only where the run goes on (the training loop, before a
        step): the wait that ends the run reports a failure itself, with every rank.
        Once the save is done, SIGTERM gets its default handling back."""
        if self._finished.is_set():
            self._unguard_sigterm()
        if self._report and not self._reported and self._finished.is_set() \
                and self._error is not None:  # _error is set before _finished
            self._reported = True
            print(f"ERROR: background save of {self._what} failed: {self._error}", flush=True)

    def publish(self, publish_fn: Callable[[], None]) -> bool:
        """`publish_fn()` (from the writer thread) unless the save was abandoned; whether
        it ran."""
        with self._lock:
            if self._abandoned:
                return False
            publish_fn()
            self._published = True
            return True

    def abandon(self) -> Optional[str]:
        """The run stops without finishing the save in flight (Ctrl-C): it is never
        published, and a wait for other writers' markers stops. Returns what names that
        save when one was in flight and not yet published, else None."""
        with self._lock:
            self._abandoned = True
            return None if self.done() or self._published else self._what

    def stop_reason(self):
        """For `wait_for_markers`' `stop`: True once abandoned; a text once the run is
        stopping and `finish`'s time is up; else False."""
        if self._abandoned:
            return True
        if self._stop_at is not None and time.monotonic() > self._stop_at:
            return (f"the run is stopping and waited {self._stop_budget:.0f} s for every "
                    "rank's part of it")
        return False

    def finish(self, budget_s: float = STOP_FINISH_S) -> Optional[bool]:
        """The run stops (SIGTERM, an error) with this save in flight: let it finish --
        written and, on global rank 0, published once every writer's part is complete;
        never a part-written one -- within `budget_s` seconds, saying so in one line.
        None when no save was in flight (or it was abandoned), else whether it ended in
        time (a failure of it, e.g. a rank whose part never came, is printed)."""
        if self.done() or self._abandoned:
            self._unguard_sigterm()
            return None
        self._stop_budget = budget_s
        self._stop_at = time.monotonic() + budget_s
        print(f"{self._who + ' ' if self._who else ''}stopping: finishing the background "
              f"save of {self._what} first (at most {budget_s:.0f} s)", flush=True)
        ended = self._finished.wait(budget_s + 1.0)  # its marker wait stops at _stop_at
        self._unguard_sigterm()
        if ended and self._error is not None:
            print(f"{self._who + ' ' if self._who else ''}ERROR: background save of "
                  f"{self._what} failed: {self._error}", flush=True)
        return ended

    def _guard_sigterm(self) -> None:
        """While the save is in flight, SIGTERM under its default handling (which would
        end the process at once, the writer mid-file) runs `_on_sigterm`. Only from the
        main thread, and never over another handler (--exit-signal-handler notes SIGTERM
        and the run finishes the save on its way out)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._guarding = True

    def _unguard_sigterm(self) -> None:
        if not self._guarding or threading.current_thread() is not threading.main_thread():
            return
        self._guarding = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM while a save is in flight: finish it (`finish`), then end the process
        by SIGTERM, as the default handling would have."""
        if self._stop_at is not None:  # a second SIGTERM during the wait, or the run's
            return  # own `finish` running: that wait goes on
        self.finish()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def wait(self) -> None:
        """Wait for the save in flight, if any; RuntimeError when it failed."""
        if self._thread is None:
            return
        self._thread.join()
        self._unguard_sigterm()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background save of {self._what} failed: {error}") from error


def agreed_wait(saver: Optional[AsyncSaver], is_rank_0: bool, group=None) -> None:
    """Wait for this rank's save in flight; when it failed on any rank, every rank raises
    the same `AgreedExit` (one report: rank 0's when it has one -- it names the writer
    that failed -- else each failing rank's), and rank 0 first removes the failed save's
    temporary directory: every rank joined its own writer before the agreement, so none
    can still write there. In a single process the failure's SystemExit.

    Collective: one `agree` over `group`, which every rank must call
    at the same point, with a saver or not."""
    error = None
    try:
        if saver is not None:
            saver.wait()
    except RuntimeError as exc:
        error = f"error: {exc}"
    errors = agree(None, group, error)
    report = errors[0] or agreed_report(errors)
    if report is None:
        return
    if is_rank_0 and saver is not None and saver.tmp_dir:
        shutil.rmtree(saver.tmp_dir, ignore_errors=True)
    raise exit_on_every_rank(report, group)


__all__ = ["AsyncSaver", "agreed_wait", "STOP_FINISH_S", "snapshot_to_cpu", "marker_path", "mark_done", "mark_failed",
           "failed_marker_path", "wait_for_markers", "writers_stopped", "remove_markers",
           "MARKER_PREFIX", "FAILED_PREFIX"]
