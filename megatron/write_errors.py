"""The real reason of a failed file write. torch.save into a file that runs out of room (a
full disk, a disk quota, the process's file-size limit `ulimit -f`) fails closing its zip
archive with a RuntimeError ("unexpected pos 27456 vs 27350"), the OSError that says why
only in its context: `write_error_text` names that OSError instead, and for a file-size
limit the limit, which the free space of the file system does not show."""
from __future__ import annotations

import errno
import os
import resource
import tempfile
from typing import Optional

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def no_room_error(exc: BaseException) -> Optional[OSError]:
    """The OSError of a full disk, quota or file-size limit that is `exc` or that `exc` was
    raised from or while handling (its __cause__ / __context__ chain), else None."""
    seen, inner = set(), exc
    while inner is not None and id(inner) not in seen:
        if isinstance(inner, OSError) and inner.errno in NO_ROOM:
            return inner
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    return None


def file_size_limit_text() -> str:
    """'files of at most 37.4 MiB (ulimit -f 38330)': the file-size limit of this process."""
    try:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (OSError, ValueError):
        return "files up to its file-size limit (ulimit -f)"
    if limit == resource.RLIM_INFINITY:
        return "files of any size (ulimit -f unlimited here; the limit was on the writer)"
    size = (f"{limit / 2**20:.1f} MiB" if limit >= 2**20 else
            f"{limit / 1024:.1f} KiB" if limit >= 1024 else f"{limit} bytes")
    return f"files of at most {size} (ulimit -f {limit // 1024})"


def write_error_text(exc: BaseException) -> str:
    """'<type>: <message>' of a failed write: the full-disk, quota or file-size-limit
    OSError behind `exc` when there is one (see the module), else `exc` itself."""
    inner = no_room_error(exc)
    shown = exc if inner is None else inner
    text = f"{type(shown).__name__}: {shown}"
    if inner is not None and inner.errno == errno.EFBIG:
        text += f"; this process may write {file_size_limit_text()}"
    return text


def room_fix(exc: BaseException, other: str) -> str:
    """The fix for a failed write (`other`: where else to write, '--save' or the like):
    raise a file-size limit, free space under a quota, else free space or write elsewhere."""
    inner = no_room_error(exc)
    if inner is not None and inner.errno == errno.EFBIG:
        return f"Raise the file-size limit (ulimit -f unlimited) before the run, or pass {other} "\
               "on a file system without one"
    if inner is not None and inner.errno == errno.EDQUOT:
        return f"Free space within your disk quota (or have it raised), or pass {other} on " \
               "a file system with room in your quota"
    return f"Free space or pass {other}"


def write_probe_error(directory: str) -> Optional[OSError]:
    """Why no file can be created in the existing `directory` (the OSError), or None: an
    exclusive temporary file is created there and removed. os.access says yes to root and
    on some network or overlay file systems (`/proc`, a read-only mount); this does not."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_test.", dir=directory)
    except OSError as exc:
        return exc
    os.close(fd)
    try:
        os.remove(probe)
    except OSError:
        pass
    return None
