"""Preemption signals: remember that SIGTERM/SIGUSR1 arrived; the loop asks all ranks.

Slurm sends SIGUSR1 (with `--signal=USR1@N`) before a job's time limit and SIGTERM on
preemption; torchrun forwards SIGTERM to its workers. The handler only sets a flag; the
training loop checks it once per iteration, agrees across ranks, saves and exits.
"""
from __future__ import annotations

import signal
from typing import Iterable, Optional

import torch.distributed as dist


class SignalHandler:
    """Installs handlers for `signals` that record the last one received."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)):
        self.received: Optional[int] = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def any_rank_received(self, group=None) -> Optional[str]:
        """Name of a signal received by any rank (collective over `group`), else None.

        `group` should be a CPU (gloo) group so the check never waits on the GPU."""
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


def signal_name(code: float) -> Optional[str]:
    """'SIGTERM' for its number (a float from `max_over_ranks` too); None for 0."""
    return signal.Signals(int(code)).name if code else None
