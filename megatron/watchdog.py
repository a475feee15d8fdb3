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

followed by the last point each missing rank did reach, then ends the process with
`os._exit(EXIT_CODE)` (a hung collective cannot be unwound; the launcher tears the other
ranks down). An empty list means every rank arrived and the collective itself is stuck
(network, NCCL, or ranks that issued collectives in different orders).

Works with gloo and NCCL: the check-ins go through the store, not the backend. With NCCL
the collectives are asynchronous, so watch a point that waits for them (e.g. the gradient
sync's wait, or the host read of the loss), not the kernel launch. Every member of a group
must pass through the same watched names in the same order.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, List, Optional, Sequence, TextIO

EXIT_CODE = 124  # as coreutils `timeout`
KEY_PREFIX = "collective-watchdog"


class CollectiveWatchdog:
    """Watches blocks of code that run collectives; see the module docstring.

    Args:
        store: a torch.distributed Store every rank shares (e.g. the default group's
            TCPStore, see `build_watchdog`); only set/check/get are used.
        rank, world_size: this process's global rank and the world size.
        timeout_s: how long one watched block may run.
        on_timeout: called with the message instead of printing it and ending the process
            (for tests and embedding); default: print to `stream`, flush, os._exit(EXIT_CODE).
        stream: where the default handler prints (default sys.stderr).
    """

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, *,
                 on_timeout: Optional[Callable[[str], None]] = None,
                 stream: Optional[TextIO] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self._on_timeout = on_timeout or self._print_and_exit
        self._stream = stream
        self._counts: dict = {}
        self._active: List[tuple] = []  # (deadline, name, count, ranks), innermost last
        self._cond = threading.Condition()
        self._closed = False
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
        """Stop the monitor thread (the watchdog does nothing afterwards)."""
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
        with self._cond:
            while not self._closed:
                if not self._active:
                    self._cond.wait()
                    continue
                entry = min(self._active, key=lambda e: e[0])
                left = entry[0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                break
            else:
                return
        _, name, count, ranks = entry
        self._on_timeout(self.timeout_message(name, count, ranks))

    def timeout_message(self, name: str, count: int, ranks: Sequence[int]) -> str:
        """The message for `name` (reached `count` times here) not completing in time."""
        try:
            missing = self.missing_ranks(name, count, ranks)
        except Exception as exc:  # the store itself is gone (rank 0 died)
            return (f"[watchdog rank {self.rank}] collective {name} did not complete within "
                    f"{self.timeout_s:g} s; the rendezvous store cannot be read ({exc}), so the "
                    "ranks that did not arrive are unknown (rank 0, which hosts it, may be dead)")
        lines = [f"[watchdog rank {self.rank}] collective {name} did not complete within "
                 f"{self.timeout_s:g} s; ranks that did not arrive: {missing}"]
        for r in missing:
            lines.append(f"  rank {r} reached '{name}' {self._reached(name, r)} times; "
                         f"this rank is at its call number {count}")
        if not missing:
            lines.append("  every rank arrived: the collective itself is stuck (network or NCCL "
                         "trouble, or ranks issuing collectives in different orders)")
        return "\n".join(lines)

    def _print_and_exit(self, message: str) -> None:
        stream = self._stream or sys.stderr
        print(message, file=stream, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_CODE)


class NullWatchdog:
    """Same API, does nothing (a single process has no one to wait for)."""

    @contextlib.contextmanager
    def watch(self, name: str, ranks: Optional[Sequence[int]] = None) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


def build_watchdog(timeout_s: float, store=None):
    """A `CollectiveWatchdog` on the default process group's store (torch.distributed must
    be initialised), or a `NullWatchdog` when it is not or the world has one rank.

    Give the process group a slightly longer timeout than `timeout_s` (e.g. + 60 s), so
    the watchdog's message comes before the backend's own timeout error.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return NullWatchdog()
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    return CollectiveWatchdog(store, dist.get_rank(), dist.get_world_size(), timeout_s)


__all__ = ["CollectiveWatchdog", "NullWatchdog", "build_watchdog", "EXIT_CODE"]
