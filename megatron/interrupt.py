"""Ctrl-C during a training run: one line saying where it stopped, not a traceback per rank.

A terminal's Ctrl-C sends SIGINT to every process of the job on that node (torchrun and its
workers alike). Python turns it into a KeyboardInterrupt wherever each rank happens to be,
and a rank whose peer has already gone fails in its next collective instead ("connection
closed"), so each rank used to print a long traceback. `InterruptWatch` records that this
process received SIGINT (and still raises KeyboardInterrupt, as Python's own handler does);
pretrain_gpt.py then treats whatever stopped the run after the signal as the interrupt:
rank 0 (and the first process of every other node the signal reached) prints
`interrupt_message`, the others nothing, and the process exits with status 130 (128 +
SIGINT, the shell's convention). Nothing is saved, as in Megatron-LM: the message names
the last checkpoint in --save, the one a relaunch with --load resumes from. The run's own
teardown still runs (TensorBoard's last events are written, data loader workers stop, a
background checkpoint save in flight finishes).
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

INTERRUPTED_STATUS = 128 + signal.SIGINT


class InterruptWatch:
    """`with InterruptWatch() as watch:` -- SIGINT in the main thread sets `watch.received`
    and raises KeyboardInterrupt (each time: a second Ctrl-C interrupts the teardown too).
    Outside the main thread (a library call) it installs nothing."""

    def __init__(self) -> None:
        self.received = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True
        raise KeyboardInterrupt

    def __enter__(self) -> "InterruptWatch":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def explains(self, exc: BaseException) -> bool:
        """Whether `exc`, which stopped the run, is (a consequence of) the interrupt: any
        error but an exit once SIGINT came."""
        return self.received and not isinstance(exc, SystemExit)


def interrupt_message(iteration: Optional[int], save: Optional[str]) -> str:
    """'interrupted at iteration N (SIGINT, e.g. Ctrl-C): ...' naming the checkpoint a
    relaunch resumes from."""
    from megatron.checkpointing import iteration_dir_name, read_tracker

    where = f" at iteration {iteration}" if iteration is not None else ""
    text = f"interrupted{where} (SIGINT, e.g. Ctrl-C): stopped without saving"
    if not save:
        return text + " (no --save)"
    try:
        saved, release = read_tracker(save)
    except (OSError, ValueError):
        saved, release = None, False
    if saved is None:
        return text + f"; --save {save} holds no checkpoint yet"
    name = iteration_dir_name(saved, release)
    return (text + f"; the last checkpoint is {save}/{name}: relaunch with --load {save} "
            "to resume from it")


__all__ = ["INTERRUPTED_STATUS", "InterruptWatch", "interrupt_message"]
