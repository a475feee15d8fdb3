"""One training run at a time per `--save` directory.

Two runs given the same `--save` (a job launched twice, a script copied without changing
it, a requeued job whose first launch still runs) replace each other's iteration
directories, remove each other's `iter_N.tmp/` while it is being written and point the
shared tracker at each other's checkpoints, so that a resume continues the other run's
training. Megatron-LM has no guard against it.

While `pretrain()` runs, global rank 0 holds an exclusive `flock` on `<save>/.save.lock`
(holding what holds it, its host, process id and start time). A second run that finds it
held stops at start-up, every rank with one message naming the holder. The conversions
of tools/checkpoint_convert.py that write a checkpoint (reshard, to-megatron, from-hf)
take the same lock on their --save while they write: one of them and a run saving into
that directory (or two of them) would otherwise remove or replace each other's
`iter_N.tmp/`. The kernel releases the lock when
its process ends, however it ends, so a killed run leaves no stale lock (at most the file,
which the next run takes over). The file is removed when the run ends. Where the file
system implements no `flock` (some Lustre and NFS mounts), the run goes on unguarded, with
a note.
"""
from __future__ import annotations

import errno
import os
import socket
import time
from typing import Optional

from megatron.agreed_exit import agree

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

LOCK_NAME = ".save.lock"
TRAINING = "training run"  # what holds the lock, unless told otherwise
_held_here: set = set()  # real paths of the directories whose lock this process holds


def held_by_this_process(root: str) -> bool:
    """Whether this process holds the lock of `root` (a second `acquire` of it here would
    find it held: flock locks belong to the open file, not to the process)."""
    return os.path.realpath(root) in _held_here


class SaveDirLock:
    """The lock of one `--save` directory, held by this process (`held`) or not; `holder`
    says what this process is, for the message of another that finds it held."""

    def __init__(self, root: str, holder: str = TRAINING) -> None:
        self.path = os.path.join(root, LOCK_NAME)
        self.root = root
        self.holder = holder
        self.fd: Optional[int] = None
        self.unsupported: Optional[str] = None  # why the file system cannot lock

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> Optional[str]:
        """Take the lock; the error message when another process holds it, else None. A
        file system without locks leaves it not held (see `unsupported`)."""
        if fcntl is None:
            self.unsupported = "no fcntl module"
            return None
        for _ in range(10):  # the holder may remove the file between our open and lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return self._in_use_message()
                self.unsupported = f"{type(exc).__name__}: {exc}"
                return None
            if self._is_current(fd):
                self.fd = fd
                _held_here.add(os.path.realpath(self.root))
                os.ftruncate(fd, 0)
                os.write(fd, f"{self.holder}, host {socket.gethostname()}, process "
                             f"{os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                             .encode())
                return None
            os.close(fd)
        return self._in_use_message()

    def _is_current(self, fd: int) -> bool:
        """Whether `fd` is still the file at `self.path` (not one its holder removed)."""
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _in_use_message(self) -> str:
        try:
            with open(self.path) as f:
                holder = f.read().strip()
        except OSError:
            holder = ""
        what, found, where = holder.partition(", host ")  # an older file: "host ..." only
        what, where = (what, "host " + where) if found else (TRAINING, holder)
        return (f"error: --save {self.root} is in use by another {what} "
                f"({where or 'its details not yet written'}; {self.path} is locked): two runs "
                "saving into one directory replace each other's checkpoints and point its "
                "tracker at each other's. Stop that run, or pass another --save")

    def release(self) -> None:
        """Remove the file, then let the lock go (in this order: a run waiting for the
        file to be free then finds it gone, or a new one)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        _held_here.discard(os.path.realpath(self.root))

    def __enter__(self) -> "SaveDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_save_dir(root: Optional[str], ps, group=None) -> SaveDirLock:
    """The lock of `--save root`, taken by global rank 0 (`ps.rank`); use it as a context
    manager for the run. Collective (`agree` over `group`): when another run holds it every
    rank exits with rank 0's message. `root` None (no --save): a lock that holds nothing."""
    lock = SaveDirLock(root or "")
    if root is None:
        return lock
    error = None
    if ps.rank == 0:
        try:
            error = lock.acquire()
        except OSError as exc:  # --save was just probed writable: unexpected
            error = (f"error: cannot create {lock.path} ({type(exc).__name__}: {exc}); "
                     f"pass a --save directory this run can write to")
        if lock.unsupported:
            print(f"note: --save {root}: its file system does not lock files "
                  f"({lock.unsupported}), so another run writing the same --save would "
                  "not be detected", flush=True)
    try:
        agree(error, group)
    except BaseException:
        lock.release()
        raise
    return lock


__all__ = ["LOCK_NAME", "SaveDirLock", "held_by_this_process", "lock_save_dir"]
