"""The GPT index cache: Megatron 23.05's `.dsc`/`.npy` files, found, checked or built.

The md5 H of a dataset's description names four files: `H.dsc`, `H_doc_idx.npy`,
`H_sample_idx.npy` and `H_shuffle_idx.npy`. They are looked up in
`<dirname(prefix)>/index-cache/` and then in the cache dir (`--data-cache-path`), and
built into the last of those when missing. Names and contents are Megatron's, so either
tool can use the other's files.

The description does not say which documents the index covers, so one name can stand for
different indexes: `--train-data-path X` (all documents) and `--data-path X` (the train
split) share it, and so do the data at a prefix before and after it is preprocessed
again. Every set found is therefore checked against the dataset it is loaded for (the
caller's `check`); a set that does not match is skipped, and the search goes on.

A mismatching set is never overwritten. Building is already safe between the ranks of one
run (only the builder rank writes, the others load after the barrier), but the files are
shared by name with other runs: a job using the other index may be running now, and its
loader workers reopen the files by path, so a rewrite would hand it this run's index (and
its next start would rewrite them back). When the directory that would receive a new
index holds a mismatching set, the build stops with an error listing the stale files and
the fix: delete them to rebuild, or pass another `--data-cache-path` (the dataset builder
collects these errors over all datasets and raises one: `stale_caches_error`). A
mismatching set in `index-cache/` next to the data, with a cache dir given, is skipped
with a warning and a fresh index is built into (or loaded from) the cache dir.

Files are written to temporary names and moved into place, so an interrupted build never
leaves a truncated file under a cache name; a truncated or corrupt file found anyway is
reported by name, with the fix (delete it to rebuild). Two runs that find no set and build
one at the same time never replace each other's files either: a file another run put under
a name first is kept, and the set is checked after the build like any set found (equal
settings build equal files: the later run uses the earlier one's; other documents under the
same name: the later run stops with the stale-cache error). A build killed while writing
(SIGKILL) leaves its temporary file; the next run that may build into that directory
removes such files once `ABANDONED_TMP_IDLE_S` untouched (`remove_abandoned_tmp`).

The arrays are plain integers, and are read as such: a file that numpy would unpickle
(which can run any code -- a dataset directory shared with its `index-cache/`, or a
`--data-cache-path` others can write, may hold any file under a cache name) is refused by
name. Megatron-LM reads them with `allow_pickle=True`; its own files hold no objects, so
either tool still reads the other's.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

logger = logging.getLogger(__name__)

Arrays = Tuple[np.ndarray, np.ndarray, np.ndarray]  # doc_idx, sample_idx, shuffle_idx
ARRAY_KEYS = ("doc", "sample", "shuffle")


def cache_paths(directory: str, desc_hash: str) -> Dict[str, str]:
    """{'desc', 'doc', 'sample', 'shuffle'} -> the four cache file paths in `directory`."""
    return {key: os.path.join(directory, desc_hash + suffix) for key, suffix in
            (("desc", ".dsc"), ("doc", "_doc_idx.npy"), ("sample", "_sample_idx.npy"),
             ("shuffle", "_shuffle_idx.npy"))}


def load_npy(path: str, siblings: str) -> np.ndarray:
    """`path` memory-mapped; an unreadable file raises ValueError naming it and the fix
    (delete it and `siblings`, the other files of its cache set, to rebuild). Never
    unpickles: a file of pickled objects is refused (see the module docstring)."""
    try:
        return np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        if "pickle" in str(e) or "Python objects" in str(e):
            raise ValueError(f"index cache file {path} is not an array of integers (numpy "
                             "would unpickle it, which can run any code, so it is not "
                             "loaded): neither Megatron-LM nor this framework wrote it; "
                             f"delete it and its siblings ({siblings}) to rebuild the index, "
                             "and check who can write to that directory") from None
        raise ValueError(f"index cache file {path} is unreadable ({e}): truncated or corrupt, "
                         f"e.g. by an interrupted write; delete it and its siblings ({siblings}) "
                         "to rebuild the index") from None


def load_arrays(paths: Dict[str, str]) -> Arrays:
    """The three arrays, memory-mapped (see `load_npy`)."""
    return tuple(load_npy(paths[key], _listing(paths)) for key in ARRAY_KEYS)


def _listing(paths: Dict[str, str]) -> str:
    return ", ".join(paths[k] for k in ("desc",) + ARRAY_KEYS)


def create_new_beside(path: str) -> Tuple[int, str]:
    """(descriptor, name) of a new file beside `path` with a fresh random name, created
    exclusively (O_EXCL: never a file or link already there) with the mode the umask gives
    any new file (0644 under 022: the other users of a shared cache can read it)."""
    for _ in range(100):
        tmp = f"{path}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _save(path: str, write: Callable, replace: bool = True) -> None:
    """Write `path` through a temporary file beside it (`create_new_beside`: never one that
    another job on shared storage, or a container with the same process ids, is writing),
    renamed into place when complete. `replace` False leaves a file already at `path` as
    it is (another run's, which its loader workers reopen by name): the temporary file is
    linked into place, which fails when the name is taken, then removed."""
    fd, tmp = create_new_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        if replace:
            os.replace(tmp, path)
        else:
            _place_new(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _place_new(tmp: str, path: str) -> None:
    """Link `tmp` as `path` unless a file is there already (then nothing); a file system
    without hard links gets a rename when the name is free."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:
        if not os.path.lexists(path):
            os.replace(tmp, path)


class _PythonWrites:
    """A file seen by numpy as a plain object with `write`, so np.save writes through
    Python's file object: numpy's own write to a real file (`ndarray.tofile`) buffers in C
    and drops the error of its final flush, so a full disk, quota or file-size limit left
    a truncated .npy, renamed into place as if complete (or raised without the reason)."""

    def __init__(self, f) -> None:
        self.write = f.write


def _write_npy(f, array: np.ndarray) -> None:
    np.save(_PythonWrites(f), array, allow_pickle=False)


def save_npy(path: str, array: np.ndarray) -> None:
    """np.save `array` to `path` through a temporary file renamed into place."""
    _save(path, lambda f: _write_npy(f, array))


def save_text(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file renamed into place."""
    _save(path, lambda f: f.write(text.encode("utf-8")))


def save_cache(paths: Dict[str, str], desc: str, arrays: Arrays) -> None:
    """Write the three arrays (np.save format), then the description. A file another run
    wrote under one of these names meanwhile is kept, not replaced (`_save`): the caller
    loads and checks the set it finds after this."""
    os.makedirs(os.path.dirname(paths["desc"]) or ".", exist_ok=True)
    for key, array in zip(ARRAY_KEYS, arrays):
        _save(paths[key], lambda f, a=array: _write_npy(f, a), replace=False)
    _save(paths["desc"], lambda f: f.write(desc.encode("utf-8")), replace=False)


_STALE_WHY = ("built for other data under the same name: the prefix was preprocessed again, "
              "or it was used with --train/valid/test-data-path and now with --data-path and "
              "--split (Megatron names both indexes alike); or its files are damaged")
_STALE_FIX = ("delete them to rebuild, or pass --data-cache-path with another directory to "
              "build a separate index there")


def _stale_found(stale: List[Tuple[Dict[str, str], str]]) -> str:
    return "; ".join(f"{os.path.dirname(p['desc'])}: {reason}" for p, reason in stale)


def _stale_files(stale: List[Tuple[Dict[str, str], str]]) -> str:
    return ", ".join(_listing(p) for p, _ in stale)


class MissingIndexCacheError(ValueError):
    """No cache set fits a dataset and `may_build` is False."""


def missing_on_this_rank(what: str, directory: str) -> str:
    """The message of a `MissingIndexCacheError`: `what` (files in `directory`) is not there
    after the builder rank's barrier -- it failed, or this rank does not see its files."""
    return (f"{what} missing on this rank after the builder rank (global rank 0) built the "
            f"index: {directory} must be a directory that every node sees (shared storage, "
            "not a node-local disk such as /tmp); pass a --data-cache-path that all nodes "
            "share")


class StaleIndexCacheError(ValueError):
    """The index cache sets found for one dataset (`what`) do not match it and a fresh one
    cannot be built beside them: `stale` holds (paths, reason) of each set."""

    def __init__(self, stale: List[Tuple[Dict[str, str], str]], what: str) -> None:
        self.stale, self.what = stale, what
        super().__init__(
            f"the index cache for {what} does not match it ({_stale_found(stale)}). It was "
            f"{_STALE_WHY}. Stale files: {_stale_files(stale)}. Fix: {_STALE_FIX}")


def stale_caches_error(errors: List[StaleIndexCacheError]) -> ValueError:
    """One error for the stale caches of several datasets (the single error for one), so
    that a run reports them all at once rather than one per start."""
    if len(errors) == 1:
        return errors[0]
    lines = [f"  {e.what}: {_stale_found(e.stale)}; stale files: {_stale_files(e.stale)}"
             for e in errors]
    return ValueError(f"the index caches of {len(errors)} datasets do not match them (each was "
                      f"{_STALE_WHY}):\n" + "\n".join(lines) +
                      f"\nFix: {_STALE_FIX.replace('them', 'all these files', 1)}")


def cache_directories(data_prefix: str, cache_dir: Optional[str]) -> List[str]:
    """Where the caches of the data at `data_prefix` are looked for, in order:
    `<dirname(prefix)>/index-cache/`, then `cache_dir` when given (and another directory).
    A missing cache is built into the last of them."""
    directories = [os.path.join(os.path.dirname(data_prefix), "index-cache")]
    if cache_dir is not None and os.path.abspath(cache_dir) != os.path.abspath(directories[0]):
        directories.append(cache_dir)
    return directories


def unwritable(directory: str) -> Optional[OSError]:
    """Why no cache file can be written into `directory` (created if missing), or None:
    a file is created there (exclusively, under a fresh name) and removed again. The
    OSError itself, so that a full disk or quota is told apart (`cache_write_fix`)."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = create_new_beside(os.path.join(directory, "write-test"))
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return e
    return None


def cache_write_fix(e: OSError, need_bytes: Optional[int] = None) -> str:
    """What to do about a cache write that failed with `e`: for a full disk, a disk quota
    or a file-size limit which one it is and the room the cache needs (`need_bytes`, when
    known), else 'pass a writable --data-cache-path'."""
    if e.errno not in NO_ROOM:
        return "pass a writable --data-cache-path"
    size = None if need_bytes is None else (f"{need_bytes / 2**20:.1f} MiB" if need_bytes >= 2**20
                                            else f"{need_bytes / 1024:.1f} KiB")
    need = "" if size is None else f" (it needs {size})"
    if e.errno == errno.EFBIG:
        return (f"the process's file-size limit (ulimit -f) is smaller than the cache{need}: "
                "raise it (ulimit -f unlimited) before the run")
    if e.errno == errno.EDQUOT:
        return (f"your disk quota there is full: free space within it{need}, or pass "
                "--data-cache-path with a directory on a disk with room in your quota")
    return (f"the disk is full: free space there{need}, or pass --data-cache-path with a "
            "directory on a disk with room")


def npy_problem(path: str, dtype: np.dtype, length: int) -> Optional[str]:
    """Why `path` is not a complete `.npy` file of `length` values of `dtype` (missing,
    not the .npy format, pickled objects, another dtype or shape, shorter or longer than
    its header says), or None. Reads the header only; never unpickles."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, got = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, got = np.lib.format.read_array_header_2_0(f)
            header = f.tell()
            actual = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, EOFError) as e:
        return f"not a .npy array file ({e})"
    if got.hasobject:
        return "holds Python objects (numpy would unpickle them), not integers"
    if got != np.dtype(dtype) or tuple(shape) != (length,) or fortran:
        return f"holds {got} {tuple(shape)}, not {np.dtype(dtype)} ({length},)"
    expected = header + length * got.itemsize
    if actual != expected:
        return f"{actual} bytes where its header needs {expected}: truncated or corrupt"
    return None


# A temporary file of this module's (`create_new_beside`) untouched for this long belongs to a
# writer that was killed (SIGKILL, the OOM killer): one that lives writes it without pause.
ABANDONED_TMP_IDLE_S = 600.0
_TMP_NAME = re.compile(r"([0-9a-f]{32}(\.dsc|_(doc|sample|shuffle)_idx\.npy)|blend-[0-9a-f]{32}"
                       r"(\.dsc|_index\.npy|_sample_index\.npy)|write-test)\.[0-9a-f]{12}\.tmp")
_swept: set = set()  # directories `remove_abandoned_tmp` has looked at in this process


def remove_abandoned_tmp(directory: str, idle_s: float = ABANDONED_TMP_IDLE_S) -> List[str]:
    """Remove the temporary cache files in `directory` that a killed build left (nothing
    else removes them: each later build writes under a fresh name), those not written to
    for `idle_s` seconds; a younger one may be another run's live write, and stays. Once
    per directory and process; the names removed (a warning says so, with their size)."""
    key = os.path.abspath(directory)
    if key in _swept:
        return []
    _swept.add(key)
    try:
        names = [n for n in os.listdir(directory) if _TMP_NAME.fullmatch(n)]
    except OSError:
        return []
    removed, size, now = [], 0, time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
            if now - st.st_mtime < idle_s:
                continue
            os.remove(path)
        except OSError:
            continue
        removed.append(name)
        size += st.st_size
    if removed:
        warnings.warn(f"removed {len(removed)} temporary file(s) of index builds killed while "
                      f"writing from {directory} ({size / 2**20:.1f} MiB, untouched for "
                      f"{idle_s:.0f} s or more): {', '.join(sorted(removed))}", stacklevel=3)
    return removed


def find_or_build_cache(desc: str, data_prefix: str, cache_dir: Optional[str],
                        build: Callable[[], Arrays], may_build: bool,
                        check: Callable[[Arrays], Optional[str]], what: str
                        ) -> Tuple[Dict[str, str], Arrays]:
    """(paths, loaded arrays) of the first cache set that `check` accepts (it returns None,
    or the reason of a mismatch), else of one built by `build` into the last directory
    looked at. `may_build` False (a non-builder rank) raises instead of building. See the
    module docstring for what happens to sets that `check` rejects."""
    desc_hash = hashlib.md5(desc.encode("utf-8")).hexdigest()
    directories = cache_directories(data_prefix, cache_dir)
    if may_build:
        remove_abandoned_tmp(directories[-1])
    stale: List[Tuple[Dict[str, str], str]] = []
    for directory in directories:
        paths = cache_paths(directory, desc_hash)
        if not all(os.path.isfile(p) for p in paths.values()):
            continue
        arrays = load_arrays(paths)
        reason = check(arrays)
        if reason is None:
            _warn_skipped(stale, what, paths)
            return paths, arrays
        stale.append((paths, reason))
    target = cache_paths(directories[-1], desc_hash)
    if stale and stale[-1][0] == target:
        raise StaleIndexCacheError(stale, what)
    if not may_build:
        raise MissingIndexCacheError(missing_on_this_rank(f"index files {target['doc']} (and "
                                                          "siblings)", directories[-1]))
    _warn_skipped(stale, what, target)
    start = time.time()
    arrays = build()
    try:
        save_cache(target, desc, arrays)
    except OSError as e:
        raise ValueError(cache_write_error(directories[-1], e, arrays)) from e
    logger.info("built index %s in %.2f s", desc_hash, time.time() - start)
    arrays = load_arrays(target)
    reason = check(arrays)  # another run may have written this name while this one built
    if reason is not None:
        raise StaleIndexCacheError([(target, f"{reason}; written by another run using this "
                                     "cache name while this one built its index")], what)
    return target, arrays


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def cache_write_error(directory: str, e: OSError, arrays: Arrays) -> str:
    """The error text of a failed index cache write into `directory`: the system's reason
    and what to do (`cache_write_fix`: for a full disk, quota or file-size limit, which
    one and the room the index needs)."""
    reason = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    fix = cache_write_fix(e, sum(a.nbytes for a in arrays))
    kept = ". No partial file was left under a cache name" if e.errno in NO_ROOM else ""
    return f"cannot write the dataset index cache to {directory} ({reason}); {fix}{kept}"


def _warn_skipped(stale: List[Tuple[Dict[str, str], str]], what: str,
                  used: Dict[str, str]) -> None:
    for paths, reason in stale:
        files = paths["desc"][:-len(".dsc")] + "{.dsc,_*_idx.npy}"
        warnings.warn(f"ignoring the index cache {files}: it does not match {what} "
                      f"({reason}); using {os.path.dirname(used['desc'])} instead",
                      stacklevel=3)
