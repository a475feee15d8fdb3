"""Checkpoint save/load in Megatron-LM's on-disk layout.

    <root>/latest_checkpointed_iteration.txt     "100" (no newline) or "release"
    <root>/iter_0000100/mp_rank_00/model_optim_rng.pt          pp_size == 1
    <root>/iter_0000100/mp_rank_00_000/model_optim_rng.pt      pp_size > 1 (tp 2 digits, pp 3)

One file per (tp, pp) pair, written by its data-parallel rank 0. Every file loads with
`torch.load(..., weights_only=True)`: the contents are tensors and plain Python data only
(`args` is a dict of plain values, RNG states are tuples/lists of ints and tensors: see
megatron/checkpoint_plain.py, whose functions this module re-exports). The names of the
directories and files, and reading the tracker, are in megatron/checkpoint_dirs.py
(re-exported here too).

Saving is crash safe: files go to `iter_XXXXXXX.tmp/`, then global rank 0 renames the
directory into place and writes the tracker file last. A crash at any point leaves the
previous tracker pointing at a complete checkpoint; a save that an exception (Ctrl-C) stops
midway removes its partial directory once each writer's marker there says it stopped
(`save_checkpoint`). With `--async-save` only the copy to CPU blocks training; the files
are written by a background thread (megatron/async_save.py, which also has the markers).

Loading (the ranks agree on the iteration, every rank exits on a missing or unreadable
file) is in megatron/checkpoint_load.py, re-exported here. This module knows nothing of the
Trainer: what a Trainer's payload holds, and resharding a checkpoint of another parallel
layout on load, are in megatron/trainer_checkpoint.py.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.agreed_exit import AgreedExit, agree
from megatron.async_save import (
    AsyncSaver,
    agreed_wait,
    mark_done,
    mark_failed,
    marker_path,
    remove_markers,
    wait_for_markers,
    writers_stopped,
)
from megatron.checkpoint_dirs import (
    MODEL_FILENAME,
    TRACKER_FILENAME,
    check_output_dir,
    check_save_dir,
    checkpoint_name,
    describe_layout,
    exit_on_missing_message,
    free_space_text,
    iteration_dir_name,
    later_checkpoints_warning,
    list_checkpoints,
    malformed_tracker_message,
    missing_iteration_dir_message,
    missing_tracker_message,
    previous_checkpoint_text,
    rank_dir_name,
    read_tracker,
    tracker_path,
    unpublished_message,
    unreadable_file_message,
    untracked_save_message,
)
from megatron.checkpoint_load import (  # re-exported: the load side
    READ_ERRORS,
    load_checkpoint,
    load_extra_file,
    load_rank_file,
    read_checkpoint_file,
    resolve_checkpoint,
)
from megatron.checkpoint_plain import args_to_plain, get_rng_state, set_rng_state
from megatron.core.datasets.index_cache import create_new_beside
from megatron.core.parallel_state import ParallelState
from megatron.logging_utils import print_rank_0
from megatron.oom_report import out_of_memory_kind
from megatron.watchdog import watching
from megatron.write_errors import room_fix, write_error_text

CHECKPOINT_VERSION = 3.0


# ---------------------------------------------------------------------------------------
# Writing the tracker file
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support syncing directories
    finally:
        os.close(fd)


def write_tracker(root: str, iteration: int, release: bool) -> None:
    """Write the tracker atomically: temporary file, fsync, os.replace. The temporary file
    has a fresh name, created exclusively (never one another writer of `root` is writing:
    where the file system cannot lock --save, a second run's save truncated the shared
    `.tmp` after the first had moved it into place, and readers found the tracker empty),
    with the mode the umask gives any new file (others sharing the checkpoint can read it)."""
    path = tracker_path(root)
    fd, tmp = create_new_beside(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("release" if release else str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(root)


# ---------------------------------------------------------------------------------------
# Collectives (no-ops in a single process)
def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    """World barrier when torch.distributed is initialised (watched: megatron/watchdog.py)."""
    if _dist_ready():
        with watching("checkpoint barrier"):
            dist.barrier()


# ---------------------------------------------------------------------------------------
# Save
class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written or published (disk full, quota, I/O error): the
    tracker still names the previous checkpoint; the message says what is on disk."""


def interrupt_behind(exc: BaseException) -> Optional[BaseException]:
    """The KeyboardInterrupt (Ctrl-C) that `exc` was raised while handling, else None:
    torch.save into an open file, stopped by Ctrl-C midway, fails closing its zip archive
    ("unexpected pos 704 vs 598", a RuntimeError), which hides the interrupt; a write
    error it is not (and no free-space advice fits it)."""
    seen, inner = set(), exc.__context__
    while inner is not None and id(inner) not in seen:
        if isinstance(inner, KeyboardInterrupt):
            return inner
        seen.add(id(inner))
        inner = inner.__context__
    return None


def _torch_save_synced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def remove_dir(path: str, shown: Optional[str] = None) -> None:
    """Remove the directory `path`; a symbolic link there (an iteration directory moved to
    other storage and linked back) is removed as a link: what it points to is left as it
    was, with a note naming `shown` (default `path`) and the target (shutil.rmtree refuses
    links, which failed the save)."""
    if os.path.islink(path):
        print(f"note: {shown or path} is a link to {os.path.realpath(path)}: the link is "
              "removed, the directory it points to is left as it was", flush=True)
        os.unlink(path)
    else:
        shutil.rmtree(path)


def move_into_place(root: str, tmp_dir: str, final_dir: str) -> None:
    """Rename `tmp_dir` to `final_dir`, replacing an older copy through `final_dir.old`.
    An `.old` without `final_dir` beside it is the only copy of an interrupted replace
    (`_recover_interrupted_replace` restores it): it goes only once `tmp_dir` is in place,
    so that no crash leaves neither. A link in place of the older copy goes as a link
    (`remove_dir`)."""
    old_dir = final_dir + ".old"
    replaced_link = os.path.islink(final_dir)
    if os.path.lexists(final_dir):
        if os.path.lexists(old_dir):
            remove_dir(old_dir)
        os.rename(final_dir, old_dir)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    if os.path.lexists(old_dir):
        remove_dir(old_dir, shown=final_dir if replaced_link else None)


def _publish(root: str, tmp_dir: str, final_dir: str, iteration: int, release: bool) -> None:
    """Rank 0: move `tmp_dir` into place (replacing an older copy), then write the tracker.
    CheckpointWriteError (the OSError chained) saying what is on disk when either fails."""
    try:
        move_into_place(root, tmp_dir, final_dir)
    except OSError as exc:
        raise CheckpointWriteError(unpublished_message(root, tmp_dir, iteration, exc)) from exc
    try:
        write_tracker(root, iteration, release)
    except OSError as exc:  # its temporary file is gone already
        raise CheckpointWriteError(untracked_save_message(root, iteration, release, exc)) \
            from exc


def _check_save_iteration(iteration: int, release: bool) -> None:
    if iteration < 1 and not release:
        raise ValueError(f"cannot save a checkpoint at iteration {iteration}: Megatron's "
                         f"tracker only accepts iterations > 0 (or a release checkpoint)")


def _prepare_tmp_dir(root: str, tmp_dir: str, ps: ParallelState, barrier: bool = True) -> None:
    """Rank 0 makes a fresh `tmp_dir` (removing leftovers of a crashed save of the same
    iteration); a world barrier (unless the caller makes it) makes sure it exists before
    anyone writes into it."""
    if ps.rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.lexists(tmp_dir):
            remove_dir(tmp_dir)
        os.makedirs(tmp_dir)
    if barrier:
        _barrier()


def _try_prepare(root: str, tmp_dir: str, iteration: int,
                 ps: ParallelState) -> Optional[CheckpointWriteError]:
    """`_prepare_tmp_dir` without its barrier; rank 0's failure (a full disk or quota
    refusing the directory) is returned, for the agreement that stands for the barrier."""
    try:
        _prepare_tmp_dir(root, tmp_dir, ps, barrier=False)
    except OSError as exc:
        error = CheckpointWriteError(
            f"the checkpoint at iteration {iteration} could not be written: {tmp_dir} could "
            f"not be made ({write_error_text(exc)}); {free_space_text(root)}; "
            f"{previous_checkpoint_text(root)}. {room_fix(exc, 'another --save')}")
        error.__cause__ = exc
        return error
    return None


def _rank_files(ps: ParallelState, state: Optional[Dict],
                extra_files: Optional[Dict[str, object]]) -> Optional[Dict[str, object]]:
    """file name -> object this rank writes (data-parallel rank 0 only), else None."""
    if ps.dp_rank != 0:
        return None
    if state is None:
        raise ValueError(f"data-parallel rank 0 (global rank {ps.rank}) must pass its state")
    return {MODEL_FILENAME: state, **(extra_files or {})}


def _write_rank_files(root: str, iteration: int, tmp_dir: str, ps: ParallelState,
                      files: Dict[str, object]) -> str:
    """Write and fsync this rank's files into its `mp_rank_*` directory; returns its name.
    CheckpointWriteError (the original error chained) naming the file, the free space and
    the checkpoint that stays in use when a file cannot be written."""
    name = rank_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size)
    rank_dir = os.path.join(tmp_dir, name)
    path = rank_dir
    try:
        os.makedirs(rank_dir, exist_ok=True)
        for file_name, obj in files.items():
            path = os.path.join(rank_dir, file_name)
            _torch_save_synced(obj, path)
        _fsync_dir(rank_dir)
    except (OSError, RuntimeError, MemoryError) as exc:
        interrupt = interrupt_behind(exc)
        if interrupt is not None:  # Ctrl-C: the save stops as an interrupted one
            raise interrupt from None
        if out_of_memory_kind(exc):  # not the disk: no free-space advice
            raise CheckpointWriteError(
                f"the checkpoint at iteration {iteration} could not be written to {path}: "
                f"out of {'host' if out_of_memory_kind(exc) == 'host' else 'GPU'} memory "
                f"while serialising it ({exc}); {previous_checkpoint_text(root)}. Lower the "
                "memory use of the run (python pretrain_gpt.py ... --dry-run estimates it) "
                "or the process count per node") from exc
        raise CheckpointWriteError(
            f"the checkpoint at iteration {iteration} could not be written to {path} "
            f"({write_error_text(exc)}); {free_space_text(root)}; "
            f"{previous_checkpoint_text(root)}. {room_fix(exc, 'another --save')}") from exc
    return name


def _after_write(root: str, iteration: int, tmp_dir: str, ps: ParallelState,
                 error: Optional[CheckpointWriteError], group=None) -> None:
    """The barrier after writing, as an agreement on each rank's failure (`agree` over
    `group`, the run's CPU control group): when a rank could not write, rank 0 removes the
    partial directory and every rank raises the same `AgreedExit`, whose report rank 0
    prints once, naming the ranks that failed and each one's message (the files they could
    not write, the free space, the checkpoint that stays in use). In a single process the
    rank's own CheckpointWriteError is raised."""
    if _world_size(group) == 1:
        if error is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise SystemExit(f"error: {error}") from error  # a message, as with several ranks
        return
    try:
        agree(None if error is None else f"error: {error}", group)
    except AgreedExit as exc:
        if ps.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise exc from error


def _try_publish(root: str, tmp_dir: str, final_dir: str, iteration: int,
                 release: bool) -> Optional[CheckpointWriteError]:
    """Rank 0: `_publish`; its failure is returned, for `_agree_published`."""
    try:
        _publish(root, tmp_dir, final_dir, iteration, release)
    except CheckpointWriteError as exc:
        return exc
    return None


def _agree_published(error: Optional[CheckpointWriteError], group=None) -> None:
    """The barrier after rank 0 published (or made the temporary directory), as an
    agreement on its failure (`agree` over `group`): every rank exits with rank 0's
    message (rank 0 alone raised, the others waited in the barrier)."""
    try:
        agree(None if error is None else f"error: {error}", group)
    except SystemExit as exc:
        raise exc from error


def _world_size(group=None) -> int:
    return dist.get_world_size(group) if _dist_ready() else 1


def _write_own_files(root: str, iteration: int, tmp_dir: str, ps: ParallelState,
                     files: Optional[Dict[str, object]]) -> Optional[CheckpointWriteError]:
    """Write this rank's `files` (None: it writes nothing), then leave its marker in
    `tmp_dir` saying that it writes there no more: done, or failed with the write error,
    which is returned. Another exception (Ctrl-C) leaves the marker to the caller."""
    if files is None:
        return None
    name = rank_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size)
    try:
        _write_rank_files(root, iteration, tmp_dir, ps, files)
    except CheckpointWriteError as exc:
        mark_failed(tmp_dir, name, str(exc))
        return exc
    try:
        mark_done(tmp_dir, name)
    except OSError as exc:  # an empty file, but a full quota or directory refuses it too
        error = CheckpointWriteError(
            f"the checkpoint at iteration {iteration} could not be written: its marker "
            f"{marker_path(tmp_dir, name)} could not be created ({write_error_text(exc)}); "
            f"{free_space_text(root)}; {previous_checkpoint_text(root)}. "
            f"{room_fix(exc, 'another --save')}")
        error.__cause__ = exc
        mark_failed(tmp_dir, name, str(error))
        return error
    return None


def _writer_dirs(ps: ParallelState) -> List[str]:
    """The rank directory of every (tp, pp) pair: one writer each."""
    return [rank_dir_name(t, p, ps.pp_size) for p in range(ps.pp_size) for t in range(ps.tp_size)]


def _stop_save(tmp_dir: str, ps: ParallelState, writing: bool, pending: List[str],
               on_stop: Optional[Callable[[str, bool], None]], wait_s: float) -> None:
    """An exception stops a save midway (Ctrl-C, a peer gone). A writer that may have
    written (`writing`) leaves its failure marker: it will not write again, its process is
    on its way out. Rank 0 then removes the partial `tmp_dir` (made by it for this save)
    once every writer of `pending` has left its marker, waiting up to `wait_s` seconds:
    no file system call of the save can then still be under way. A writer that stays
    silent (killed, or on a node the signal did not reach, still writing) keeps the
    directory, for the next start's warning. `on_stop(tmp_dir, removed)` on rank 0 when
    the directory was still there (not published, not removed after an agreed failure)."""
    if writing:
        mark_failed(tmp_dir, rank_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size), "stopped")
    if ps.rank != 0 or not os.path.isdir(tmp_dir):
        return
    removed = writers_stopped(tmp_dir, pending, wait_s)
    if removed:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if on_stop is not None:
        on_stop(tmp_dir, removed)


def save_checkpoint(root: str, iteration: int, state: Optional[Dict], ps: ParallelState,
                    release: bool = False, extra_files: Optional[Dict[str, object]] = None,
                    group=None, on_stop: Optional[Callable[[str, bool], None]] = None,
                    stop_wait_s: float = 10.0) -> float:
    """Save this rank's `state` as `<root>/iter_XXXXXXX/mp_rank_.../model_optim_rng.pt`.

    Every rank must call this (it is collective: world barriers). Only data-parallel
    rank 0 of each (tp, pp) pair writes: `state` (and `extra_files`, name -> object, e.g.
    `distrib_optim.pt`) are ignored elsewhere and may be None there. Files are written into
    `iter_XXXXXXX.tmp/`; after a barrier global rank 0 renames it into place and writes the
    tracker file last; a final barrier makes the checkpoint visible to all. Returns seconds.
    A rank that cannot write makes every rank raise the same `AgreedExit` (agreed over
    `group`, default the world), printed once by rank 0; the tracker keeps its checkpoint.
    An exception that stops the save midway (Ctrl-C's KeyboardInterrupt) is re-raised after
    rank 0 removed the partial `iter_XXXXXXX.tmp/` if every writer is known to have stopped
    (`_stop_save`, no collective: the ranks' markers in the directory; `on_stop`).
    """
    _check_save_iteration(iteration, release)
    start = time.perf_counter()
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root}")
    final_dir = os.path.join(root, iteration_dir_name(iteration, release))
    tmp_dir = final_dir + ".tmp"
    writing, pending = ps.dp_rank == 0, _writer_dirs(ps)  # who may write into tmp_dir
    publish_error = None
    prepare_error = _try_prepare(root, tmp_dir, iteration, ps)
    try:
        _agree_published(prepare_error, group)  # tmp_dir exists before anyone writes into it
        files = _rank_files(ps, state, extra_files)
        error = _write_own_files(root, iteration, tmp_dir, ps, files)
        writing = False
        _after_write(root, iteration, tmp_dir, ps, error, group)  # every shard is on disk
        pending = []  # agreed: no writer is left
        if ps.rank == 0:
            remove_markers(tmp_dir, _writer_dirs(ps))
            publish_error = _try_publish(root, tmp_dir, final_dir, iteration, release)
    except BaseException:
        _stop_save(tmp_dir, ps, writing, pending, on_stop, stop_wait_s)
        raise
    _agree_published(publish_error, group)  # the tracker names a complete checkpoint
    seconds = time.perf_counter() - start
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}")
    print_rank_0(f"  checkpoint save time (blocking {seconds:.2f} s)")
    return seconds


# A wait for the previous background save longer than this is named in the save-time line.
PREVIOUS_SAVE_WAIT_NOTE_S = 0.05


def _waited_text(waited: float) -> str:
    """', of which N s waiting for the previous save to finish writing' when an async save
    blocked on that (saves come faster than the writer finishes them: the blocking time is
    then mostly not the CPU copy), else ''."""
    if waited < PREVIOUS_SAVE_WAIT_NOTE_S:
        return ""
    return f", of which {waited:.2f} s waiting for the previous save to finish writing"


def save_checkpoint_async(root: str, iteration: int, state: Optional[Dict], ps: ParallelState,
                          saver: AsyncSaver, release: bool = False,
                          extra_files: Optional[Dict[str, object]] = None,
                          timeout_s: float = 660.0, started: Optional[float] = None,
                          group=None) -> float:
    """`save_checkpoint` where only the CPU copy blocks; `saver` writes in the background.

    Blocking part (collective: agreements over `group`): wait for this rank's previous
    save, make the temporary directory (rank 0; when it cannot, every rank exits with its
    message, printed once), copy the state to CPU. Background thread: write and fsync the
    files, drop a marker; on global rank 0 wait (up to `timeout_s`) for every (tp, pp)
    pair's marker, then rename and write the tracker last -- no collective, see
    megatron/async_save.py. Returns the seconds the caller was blocked, counted from
    `started` (a time.perf_counter() value; default: now). `saver.wait()` finishes it
    (`async_save.agreed_wait` on every rank together); until then `saver.report_failure()`
    prints a failure on rank 0, which learns of every writer's.
    When the previous background save failed, every rank exits here with one report
    (`async_save.agreed_wait`, an agreement over `group`; rank 0 removes its directory).
    A save `saver.abandon()` stopped (Ctrl-C) is never published.
    """
    started = time.perf_counter() if started is None else started
    _check_save_iteration(iteration, release)
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {root}")  # as a sync save
    waited = time.perf_counter()
    agreed_wait(saver, ps.rank == 0, group)  # on rank 0 that includes publishing it
    waited = time.perf_counter() - waited
    final_dir = os.path.join(root, iteration_dir_name(iteration, release))
    tmp_dir = final_dir + ".tmp"
    # the barrier after rank 0 made tmp_dir, as an agreement on its failure (a full disk)
    _agree_published(_try_prepare(root, tmp_dir, iteration, ps), group)
    files = _rank_files(ps, state, extra_files)
    snapshot = None if files is None else saver.snapshot(files)
    writers = _writer_dirs(ps) if ps.rank == 0 else []
    blocking = time.perf_counter() - started

    def write_and_publish() -> None:
        t0 = time.perf_counter()
        if snapshot is not None:
            try:
                mark_done(tmp_dir, _write_rank_files(root, iteration, tmp_dir, ps, snapshot))
            except Exception as exc:  # rank 0 stops waiting for this writer
                mark_failed(tmp_dir, rank_dir_name(ps.tp_rank, ps.pp_rank, ps.pp_size),
                            f"{exc} (rank {ps.rank})")
                raise
        if writers:
            wait_for_markers(tmp_dir, writers, timeout_s, stop=saver.stop_reason)
            remove_markers(tmp_dir, writers)
            if not saver.publish(lambda: _publish(root, tmp_dir, final_dir, iteration, release)):
                return
            print(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}\n"
                  f"  checkpoint save time (blocking {blocking:.2f} s{_waited_text(waited)}, "
                  f"writing {time.perf_counter() - t0:.2f} s in the background)", flush=True)

    saver.submit(write_and_publish, f"the checkpoint at iteration {iteration} to {root}",
                 report=ps.rank == 0, tmp_dir=tmp_dir, who=f"[rank {ps.rank}]")
    return blocking


__all__ = [
    "CHECKPOINT_VERSION", "TRACKER_FILENAME", "MODEL_FILENAME", "checkpoint_name",
    "iteration_dir_name", "rank_dir_name", "tracker_path", "read_tracker", "describe_layout",
    "CheckpointWriteError", "check_output_dir", "check_save_dir", "later_checkpoints_warning",
    "save_checkpoint", "move_into_place",
    "save_checkpoint_async", "resolve_checkpoint",
    "load_checkpoint", "load_rank_file", "load_extra_file", "list_checkpoints", "read_checkpoint_file",
    "missing_tracker_message", "malformed_tracker_message", "exit_on_missing_message",
    "missing_iteration_dir_message",
    "unreadable_file_message", "READ_ERRORS", "get_rng_state", "set_rng_state", "args_to_plain",
]
