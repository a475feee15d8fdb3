"""Preemption signals: remember that SIGTERM/SIGUSR1 arrived; the loop asks all ranks.

Slurm sends SIGUSR1 (with `--signal=USR1@N`) before a job's time limit and SIGTERM on
preemption; torchrun forwards SIGTERM to its workers. The handler only sets a flag; the
training loop checks it once per iteration, agrees across ranks, saves and exits.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Iterable, Optional

# The last SIGTERM/SIGUSR1 any SignalHandler noted during the current run (0: none yet;
# `forget_noted` at each run's start and end).
_last_noted = 0


def forget_noted() -> None:
    """Forget a SIGTERM/SIGUSR1 noted so far: called as an entry point's run starts and
    ends (megatron.entry_state.entry_point_changes_undone), so that a signal one in-process
    call noted does not make a later call skip its wait for the launcher."""
    global _last_noted
    _last_noted = 0


class SignalHandler:
    """Installs handlers for `signals` that record the last one received (in the main
    thread only: ValueError naming --exit-signal-handler elsewhere)."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)):
        thread = threading.current_thread()
        if thread is not threading.main_thread():
            raise ValueError(
                f"--exit-signal-handler needs the main thread: Python lets only it install "
                f"signal handlers, and this run was called from thread {thread.name!r}; "
                "call it from the main thread, or drop --exit-signal-handler")
        self.received: Optional[int] = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        global _last_noted
        self.received = _last_noted = signum

    def any_rank_received(self, group=None) -> Optional[str]:
        """Name of a signal received by any rank (collective over `group`), else None.

        `group` should be a CPU (gloo) group so the check never waits on the GPU."""
        import torch.distributed as dist

        code = self.received or 0
        if dist.is_initialized():
            from megatron.agreed_exit import max_over_ranks
            from megatron.watchdog import watching

            with watching("exit-signal check", group):
                code = max_over_ranks([code], group)[0]
        return signal_name(code)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Cut(Exception):
    """Raised by the handler `sleep_unless_signalled` installs, to end its sleep."""


def sleep_unless_signalled(seconds: float) -> bool:
    """`time.sleep(seconds)`, cut short by a SIGTERM/SIGUSR1 that a SignalHandler would
    only note, and skipped when one was noted already: a process that is exiting anyway
    and waits to be ended by its launcher would otherwise wait for the launcher's SIGKILL.
    Signals without a SignalHandler keep their handling (SIGTERM's default ends the
    process). Returns whether a signal cut the wait."""
    noting = {}

    def cut(signum, frame):
        noting[signum](signum, frame)  # the SignalHandler notes it, as it would have
        raise _Cut()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            handler = signal.getsignal(sig)
            if isinstance(getattr(handler, "__self__", None), SignalHandler):
                noting[sig] = handler
                signal.signal(sig, cut)
    try:
        if not _last_noted:
            time.sleep(seconds)
    except _Cut:
        pass
    finally:
        for sig, handler in noting.items():
            signal.signal(sig, handler)
    return bool(_last_noted)


def signal_name(code: float) -> Optional[str]:
    """'SIGTERM' for its number (a float from `max_over_ranks` too); None for 0."""
    return signal.Signals(int(code)).name if code else None
