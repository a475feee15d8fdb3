"""Ctrl-C during a training run: one line saying where it stopped, not a traceback per rank.

A terminal's Ctrl-C sends SIGINT to every process of the job on that node (torchrun and its
workers alike). Python turns it into a KeyboardInterrupt wherever each rank happens to be,
and a rank whose peer has already gone fails in its next collective instead ("connection
closed"), so each rank used to print a long traceback. `InterruptWatch` records that this
process received SIGINT (and still raises KeyboardInterrupt, as Python's own handler does);
pretrain_gpt.py then treats whatever stopped the run after the signal as the interrupt:
rank 0 (and the first process of every other node the signal reached) prints
`interrupt_message`, the others nothing, and the process exits with status 130 (128 +
SIGINT, the shell's convention). The line says where the run was (`RunProgress`: during
start-up, at iteration N, during the evaluation at iteration N, while saving the
checkpoint of iteration N). Nothing is saved, as in Megatron-LM: the message names the
last checkpoint in --save, the one a relaunch with --load resumes from. The run's own
teardown still runs (TensorBoard's last events are written, data loader workers stop). A
synchronous save stopped midway removes its partial `iter_N.tmp/` (global rank 0, once
every writer left its marker there: none can still be writing; see
`checkpointing.save_checkpoint`), and the line says so -- or that it stays, when a writer
did not say it stopped within seconds (killed, or on a node the signal did not reach). A
background checkpoint save in flight (--async-save) is abandoned before the tracker is
read: it is never published, so the line stays true, and the process exits without
waiting for its writer (its `iter_N.tmp` stays behind; the next start warns of it).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator, Optional, Tuple

INTERRUPTED_STATUS = 128 + signal.SIGINT


class SigintHandler:
    """Base of a `with` block that handles SIGINT (and the other `signals` of a subclass) by
    `self._handle(signum, frame)` in the main thread, and puts the previous handlers back
    after; outside the main thread (a library call) it installs nothing."""

    signals: Tuple[int, ...] = (signal.SIGINT,)
    _previous: Optional[dict] = None

    def _handle(self, signum, frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in (self._previous or {}).items():
            signal.signal(sig, handler)
        self._previous = None


class InterruptWatch(SigintHandler):
    """`with InterruptWatch() as watch:` -- SIGINT in the main thread sets `watch.received`
    and raises KeyboardInterrupt (each time: a second Ctrl-C interrupts the teardown too),
    except within `FORWARDED_WITHIN_S` of the first: that is the same Ctrl-C again, which
    torchrun forwards to workers the terminal has already reached; raised again, it would
    cut the run's teardown short at a random point. Outside the main thread (a library
    call) it installs nothing."""

    FORWARDED_WITHIN_S = 1.0

    def __init__(self) -> None:
        self.received = False
        self._first = 0.0

    def _handle(self, signum, frame) -> None:
        if self.received and time.monotonic() - self._first < self.FORWARDED_WITHIN_S:
            return
        if not self.received:
            self.received, self._first = True, time.monotonic()
        raise KeyboardInterrupt

    def explains(self, exc: BaseException) -> bool:
        """Whether `exc`, which stopped the run, is (a consequence of) the interrupt: any
        error but an exit once SIGINT came."""
        return self.received and not isinstance(exc, SystemExit)


class RunProgress:
    """Where a run is, for the interrupt line: its phase ("start-up" until the data
    loaders are built -- "loading" while it reads --load --, then "training",
    "evaluation" or "saving" the checkpoint) and the
    trainer once built (its iteration, its background saver). `stage(phase)` sets the
    phase for a block and puts the previous one back only when the block ends normally,
    so an interrupt leaves the phase it came in."""

    def __init__(self) -> None:
        self.phase = "start-up"
        self.trainer = None  # megatron.training.Trainer once built
        self.partial_save: Optional[Tuple[str, bool]] = None  # see save_stopped

    @property
    def iteration(self) -> Optional[int]:
        return None if self.trainer is None else self.trainer.state.iteration

    @contextlib.contextmanager
    def stage(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        yield
        self.phase = previous

    def where(self) -> str:
        """'during start-up', 'while loading the checkpoint', 'at iteration N', 'during
        the evaluation at iteration N', 'while saving the checkpoint of iteration N'."""
        return _where(self).strip()

    def save_stopped(self, tmp_dir: str, removed: bool) -> None:
        """A synchronous save stopped midway (`checkpointing.save_checkpoint`'s `on_stop`,
        rank 0): whether its partial `tmp_dir` was removed, for the interrupt line."""
        self.partial_save = (tmp_dir, removed)

    def abandon_save(self) -> Optional[str]:
        """Abandon this process's background save in flight (--async-save), so that it is
        never published: what names it when one was in flight and unpublished, else None.
        Call it before reading the tracker (`interrupt_message`)."""
        saver = getattr(self.trainer, "async_saver", None)
        return None if saver is None else saver.abandon()

    def writer_running(self) -> bool:
        """Whether a background checkpoint writer of this process is still running."""
        saver = getattr(self.trainer, "async_saver", None)
        return saver is not None and not saver.done()

    def wait_for_writer(self) -> None:
        """Wait for this process's background checkpoint writer to end (after
        `abandon_save`: its save is never published, and a failure of it is moot)."""
        saver = getattr(self.trainer, "async_saver", None)
        if saver is None:
            return
        try:
            saver.wait()
        except RuntimeError:  # the abandoned save's own failure
            pass


def _where(progress: Optional[RunProgress]) -> str:
    if progress is None:
        return ""
    it = progress.iteration
    if progress.phase == "loading":
        return " while loading the checkpoint"
    if progress.phase == "start-up" or it is None:
        return " during start-up"
    return {"evaluation": f" during the evaluation at iteration {it}",
            "saving": f" while saving the checkpoint of iteration {it}"}.get(
                progress.phase, f" at iteration {it}")


def interrupt_message(progress: Optional[RunProgress], save: Optional[str],
                      abandoned: Optional[str] = None) -> str:
    """'interrupted at iteration N (SIGINT, e.g. Ctrl-C): ...' -- or 'during start-up',
    'during the evaluation at iteration N', 'while saving the checkpoint of iteration N'
    -- naming the checkpoint a relaunch resumes from (read from the tracker now: call it
    after the writers can no longer publish). `abandoned`: the background save in flight
    that was abandoned (`RunProgress.abandon_save`)."""
    text = f"interrupted{_where(progress)} (SIGINT, e.g. Ctrl-C): stopped without saving"
    if abandoned:
        text += f" (the background save of {abandoned} was abandoned)"
    if progress is not None and progress.partial_save is not None:
        tmp_dir, removed = progress.partial_save
        name = os.path.basename(tmp_dir)
        text += (f" (its partial {name}/ was removed)" if removed else
                 f" (its partial {name}/ stays: a writer may still be running; delete it "
                 "once the job has ended)")
    saved, release = _tracked(save)
    if progress is not None and progress.phase == "saving" and not release \
            and saved is not None and saved == progress.iteration:  # after the tracker
        text = text.replace("stopped without saving", "stopped after saving it")
    return text + last_checkpoint_text(save)


def _tracked(save: Optional[str]) -> Tuple[Optional[int], bool]:
    """The tracker of `save`: (iteration, release), (None, False) when there is none."""
    from megatron.checkpointing import read_tracker

    if not save:
        return None, False
    try:
        return read_tracker(save)
    except (OSError, ValueError):
        return None, False


def last_checkpoint_text(save: Optional[str]) -> str:
    """What a run that stopped can resume from, read from --save's tracker now: '; the
    last checkpoint is SAVE/iter_N: relaunch with --load SAVE to resume from it', '; --save
    SAVE holds no checkpoint yet', or ' (no --save)'."""
    from megatron.checkpointing import iteration_dir_name

    if not save:
        return " (no --save)"
    saved, release = _tracked(save)
    if saved is None:
        return f"; --save {save} holds no checkpoint yet"
    name = iteration_dir_name(saved, release)
    return f"; the last checkpoint is {save}/{name}: relaunch with --load {save} to resume from it"


__all__ = ["INTERRUPTED_STATUS", "InterruptWatch", "RunProgress", "SigintHandler",
           "interrupt_message", "last_checkpoint_text"]
