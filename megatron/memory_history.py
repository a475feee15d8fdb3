"""`--record-memory-history`: the CUDA caching allocator's history, as a snapshot file for
https://pytorch.org/memory_viz (every live tensor over time, with the Python stack that
allocated it).

Every rank records from before the model is built (torch keeps the last MAX_ENTRIES
allocation events per process). The last rank writes its snapshot to
`--memory-snapshot-path` (default `snapshot.pickle`) after each `--log-interval`
iterations, replacing the previous one; a rank that runs out of memory writes
`<stem>_oom_rank<R><ext>` beside it before the out-of-memory report (which names the
file). Files are written to a temporary name and renamed into place, so a reader never
sees half a file.

Recording costs host time for every allocation (the Python stack is captured), and each
snapshot takes seconds to write for a long history: a debugging aid, not for production
runs. It needs CUDA (the flag is refused without it).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.core.datasets.index_cache import create_new_beside

MAX_ENTRIES = 100_000  # allocation events kept per process
VIEWER = "https://pytorch.org/memory_viz"


def oom_snapshot_path(path: str, rank: int) -> str:
    """Where rank `rank` writes its snapshot when it runs out of memory."""
    root, ext = os.path.splitext(path)
    return f"{root}_oom_rank{rank}{ext or '.pickle'}"


class MemoryHistory:
    """Records the allocator's history of this process and writes snapshots (see the
    module doc). Disabled (every call a no-op) when `path` is None."""

    def __init__(self, path: Optional[str], rank: int, world_size: int,
                 log_interval: int) -> None:
        self.path, self.rank, self.log_interval = path, rank, log_interval
        self.writes_intervals = rank == world_size - 1
        self.recording = False
        self.announced = False

    @classmethod
    def from_config(cls, config, rank: int, world_size: int) -> "MemoryHistory":
        args = config.args
        path = args.get("memory_snapshot_path") if args.get("record_memory_history") else None
        return cls(path, rank, world_size, config.logging.log_interval)

    def start(self) -> None:
        if self.path is None or self.recording:
            return
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python",
                                                 max_entries=MAX_ENTRIES)
        self.recording = True

    def stop(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def write(self, path: str) -> str:
        """The snapshot of the history so far, written to `path` (through a temporary file
        renamed into place)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # a fresh name, created exclusively: a predictable `<path>.tmp<pid>` in a shared
        # directory such as /tmp let another user's link there redirect the snapshot
        fd, tmp = create_new_beside(path)
        os.close(fd)
        try:
            torch.cuda.memory._dump_snapshot(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    def after_iteration(self, iteration: int) -> None:
        """The last rank's snapshot after every --log-interval iterations. A write that
        fails (a full disk, a quota) warns once and ends these snapshots; training goes on
        (an out-of-memory snapshot is still tried)."""
        if not (self.recording and self.writes_intervals
                and iteration % self.log_interval == 0):
            return
        try:
            self.write(self.path)
        except OSError as exc:
            self.writes_intervals = False
            print(f"warning: cannot write the memory snapshot to --memory-snapshot-path "
                  f"{self.path} ({exc.strerror or exc}): these snapshots stopped here, "
                  "training continues; free space there (or raise your quota), or pass "
                  "another --memory-snapshot-path", flush=True)
            return
        if not self.announced:
            print(f" > memory snapshot of rank {self.rank} written to {self.path} (replaced "
                  f"every {self.log_interval} iterations; open it at {VIEWER})", flush=True)
            self.announced = True

    def write_oom(self) -> Optional[str]:
        """This rank's snapshot at an out-of-memory error; its path, or None when not
        recording. A failure to write is reported in the returned text, never raised."""
        if not self.recording:
            return None
        path = oom_snapshot_path(self.path, self.rank)
        try:
            return f"{self.write(path)} (open it at {VIEWER})"
        except Exception as e:  # noqa: BLE001 - the out-of-memory report comes first
            return f"not written to {path}: {e!r}"


__all__ = ["MAX_ENTRIES", "MemoryHistory", "oom_snapshot_path"]
