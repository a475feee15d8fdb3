"""The timer hook that megatron/core code accepts from its caller.

A hook is a callable `hook(name, log_level)` returning an object with `start()` and
`stop()` -- in training, the driver's Megatron-style timers (`--timing-log-level`). The
caller decides what happens there: whether a timer above its level does anything,
whether a start waits at a barrier, whether CUDA is synchronised before the clock is read.
Core code only names the phases and their levels. It takes the hook as an argument that
is None when nothing is timed; then `timed()` calls nothing outside this module, so an
untimed step adds no synchronisation and no call into the driver.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

TimerHook = Callable[[str, int], Any]


class _Untimed:
    """The timer of a phase when there is no hook: start/stop do nothing."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


UNTIMED = _Untimed()


def timer(hook: Optional[TimerHook], name: str, log_level: int):
    """The hook's timer `name` at `log_level`, or a shared do-nothing timer without one."""
    return UNTIMED if hook is None else hook(name, log_level)


class timed:
    """`with timed(hook, name):` times the block with the hook's timer `name` (level 1 by
    default, as Megatron's optimizer and gradient-reduction timers); nothing when `hook`
    is None. The timer is stopped when the block raises too."""

    __slots__ = ("_timer",)

    def __init__(self, hook: Optional[TimerHook], name: str, log_level: int = 1) -> None:
        self._timer = None if hook is None else hook(name, log_level)

    def __enter__(self) -> None:
        if self._timer is not None:
            self._timer.start()

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.stop()
