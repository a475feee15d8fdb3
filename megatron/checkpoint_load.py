"""Checkpoint load in Megatron-LM's on-disk layout (megatron/checkpointing.py, which
re-exports this module's functions, has the layout and the save side).

All ranks agree on the iteration to load (the tracker files' maximum), an interrupted
re-save of it is restored from its `.old` copy, and a missing directory or rank file, or
one that cannot be read, exits every rank with one message printed once
(megatron/agreed_exit.py). Every file loads with `torch.load(..., weights_only=True)`
(megatron/checkpoint_files.py normalises Megatron-LM's own files).
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.agreed_exit import agree, exit_on_every_rank, max_over_ranks
from megatron.arguments_inputs import missing_home_hint
from megatron.checkpoint_dirs import (
    checkpoint_name,
    exit_on_missing_message,
    incomplete_checkpoint_message,
    iteration_dir_name,
    malformed_tracker_message,
    missing_iteration_dir_message,
    missing_rank_files_message,
    model_file,
    read_tracker,
    refuse_untracked_checkpoints,
    tracker_path,
    unreadable_file_message,
)
from megatron.checkpoint_files import load_checkpoint_file, torch_reason
from megatron.core.parallel_state import ParallelState
from megatron.logging_utils import print_rank_0
from megatron.save_lock import SaveDirLock, held_by_this_process
from megatron.watchdog import watching


# ---------------------------------------------------------------------------------------
# Collectives (no-ops in a single process)
def _all_reduce_max(values: List[int]) -> List[int]:
    """Element-wise MAX over the world (all-reduce); identity in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.int64, device=device)
    with watching("checkpoint flags all-reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.cpu().tolist()]


def _failing_ranks(ps: ParallelState, failed: bool) -> List[int]:
    """The global ranks for which `failed` is true (`max_over_ranks` of the flag over the
    world, so that every rank takes the same decision, then, when some rank failed, an
    all-reduce MAX of a vector of one flag per rank to name them); [0] or [] in a single
    process."""
    with watching("checkpoint flag (any rank failed)"):
        if not max_over_ranks([failed])[0]:
            return []
    flags = [0] * ps.world_size
    flags[ps.rank] = int(failed)
    return [r for r, f in enumerate(_all_reduce_max(flags)) if f]


# ---------------------------------------------------------------------------------------
# Load
# what torch.load raises for a truncated, damaged or foreign file
READ_ERRORS = (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError)


def read_checkpoint_file(path: str, mmap: bool = False):
    """torch.load(path, weights_only=True) to CPU, through `load_checkpoint_file` (files
    written by Megatron-LM itself are normalised; the legacy non-zip format is read
    unmapped); SystemExit naming the file and the way out when it cannot be read
    (`unreadable_file_message`)."""
    try:
        return load_checkpoint_file(path, mmap=mmap)
    except pickle.UnpicklingError as exc:  # torch's text would advise weights_only=False
        reason = pickle.UnpicklingError(torch_reason(exc))
        raise SystemExit(unreadable_file_message(path, reason)) from exc
    except READ_ERRORS as exc:
        raise SystemExit(unreadable_file_message(path, exc)) from exc


REPLACE_WAIT_S = 30.0  # how long a load waits for another run's save to finish a replace


def _recover_interrupted_replace(root: str, iteration: int, release: bool) -> Optional[str]:
    """Rank 0: undo a re-save of the same iteration that died between moving the old
    directory aside and renaming the new one into place (the tracker names it); the error
    message when it cannot. Only while no other process holds `root`'s save lock
    (megatron/save_lock.py): a run saving there now may be between those two renames,
    and moving its `.old` back made its save fail; the load waits for it instead."""
    final_dir = os.path.join(root, iteration_dir_name(iteration, release))
    if os.path.exists(final_dir) or not os.path.isdir(final_dir + ".old"):
        return None
    lock = SaveDirLock(root, holder="load of its checkpoint")
    try:
        busy = None if held_by_this_process(root) else lock.acquire()
    except OSError:  # a directory this run cannot write to: the rename below says so
        busy = None
    try:
        if busy is not None:
            return _wait_for_replace(final_dir, busy)
        print(f"WARNING: restoring {final_dir} from {final_dir}.old (an interrupted save)",
              flush=True)
        os.rename(final_dir + ".old", final_dir)
    except OSError as exc:
        if not os.path.isdir(final_dir):  # (else another process restored it meanwhile)
            return (f"error: cannot restore {final_dir} from its .old copy (an interrupted "
                    f"save): {exc}")
    finally:
        lock.release()
    return None


def _wait_for_replace(final_dir: str, busy: str) -> Optional[str]:
    """Wait up to REPLACE_WAIT_S for the run holding the save lock (`busy`: the lock's
    message) to move its new `final_dir` into place; the error message when it does not."""
    deadline = time.monotonic() + REPLACE_WAIT_S
    while time.monotonic() < deadline:
        if os.path.isdir(final_dir):
            return None
        time.sleep(0.1)
    holder = busy.partition(" is in use by another ")[2].partition(": two runs")[0]
    return (f"error: {final_dir} is missing and {final_dir}.old is there, while another "
            f"{holder or 'run'} saves into {os.path.dirname(final_dir)}: it is replacing "
            f"that checkpoint, and did not finish within {REPLACE_WAIT_S:.0f} s. Load again "
            "once its save has finished (it moves the new copy into place), or stop that "
            "run; nothing was changed")


def _check_rank_files(root: str, iteration: int, release: bool, ps: ParallelState) -> str:
    """This rank's file path (`model_file`: Megatron-LM 23.04's model_rng.pt when that is
    the one there); SystemExit on every rank if any rank's file is missing.

    Collective over the world: `_failing_ranks`.
    """
    path = model_file(os.path.dirname(
        checkpoint_name(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size, release)))
    missing = _failing_ranks(ps, not os.path.isfile(path))
    if not missing:
        return path
    paths = []
    for r in missing:
        c = ps.grid.coords(r)
        paths.append(checkpoint_name(root, iteration, c["tp"], c["pp"], ps.pp_size, release))
    iter_dir = os.path.join(root, iteration_dir_name(iteration, release))
    raise exit_on_every_rank(missing_rank_files_message(iter_dir, paths, ps.tp_size, ps.pp_size))


def _agreed_iteration(root: str, group=None) -> Tuple[int, bool]:
    """(iteration, release) from the tracker, the MAX over ranks (`max_over_ranks` over
    `group`, after an `agree`); -1 if none. Every rank exits when a rank's tracker file
    is malformed."""
    error, iteration, release = None, None, False
    try:
        iteration, release = read_tracker(root)
    except ValueError as exc:
        error = malformed_tracker_message(root, exc)
    local = -1 if iteration is None else iteration
    agree(error, group)
    agreed, any_release = (int(v) for v in max_over_ranks([local, release], group))
    if local != agreed and dist.is_available() and dist.is_initialized():
        print(f"WARNING: on rank {dist.get_rank()} found iteration {local} in {tracker_path(root)}"
              f" while max iteration across the ranks is {agreed}, replacing it with max "
              f"iteration.", flush=True)
    return agreed, bool(any_release) and agreed == 0


def resolve_checkpoint(root: Optional[str], ps: ParallelState, exit_on_missing: bool = False,
                       group=None) -> Optional[Tuple[int, bool]]:
    """(iteration, release) of the latest checkpoint under `root`, agreed by all ranks, or
    None when there is no tracker file (a warning; an exit when `exit_on_missing`).

    Collective: agreements (megatron/agreed_exit.py) over `group` (the run's CPU control
    group; None: the default group) on the trackers' iterations, and after rank 0 has
    restored an interrupted re-save of that iteration, a flag reduction (the directory
    exists); without a tracker an agreement on the untracked-checkpoint check. A failure
    exits on every rank, printed once (megatron/agreed_exit.py)."""
    agreed, release = (-1, False) if root is None else _agreed_iteration(root, group)
    if agreed < 0:
        tracker = tracker_path(root) if root is not None else "(no --load directory given)"
        if exit_on_missing:
            raise exit_on_every_rank(exit_on_missing_message(tracker))
        if root is not None:
            error = None
            try:
                refuse_untracked_checkpoints(root)
            except SystemExit as exc:
                error = str(exc.code)
            agree(error, group)
        print_rank_0(f"WARNING: could not find the metadata file {tracker}")
        print_rank_0("    will not load any checkpoints and will start from random")
        hint = missing_home_hint(root) if root is not None else ""
        if hint:
            print_rank_0(f"    (--load {root}{hint})")
        return None
    error = _recover_interrupted_replace(root, agreed, release) if ps.rank == 0 else None
    agree(error, group)  # also the barrier: the restored directory is there for everyone
    _check_iteration_dir(root, agreed, release, ps)
    return agreed, release


def _check_iteration_dir(root: str, iteration: int, release: bool, ps: ParallelState) -> None:
    """Exit on every rank (all-reduce of a flag) when the directory the tracker names does
    not exist on some rank: which directories do exist, and how to fix the tracker."""
    name = iteration_dir_name(iteration, release)
    if not _failing_ranks(ps, not os.path.isdir(os.path.join(root, name))):
        return
    raise exit_on_every_rank(missing_iteration_dir_message(root, iteration, release))


def load_rank_file(root: str, iteration: int, release: bool, ps: ParallelState,
                   group=None) -> Dict:
    """This rank's model_optim_rng.pt. Collective: every rank exits when a rank's file is
    missing (all-reduce of per-rank flags) or cannot be read (`agree` over `group`, the
    run's CPU control group), the message printed once."""
    path = _check_rank_files(root, iteration, release, ps)
    print_rank_0(f" loading checkpoint from {root} at iteration {iteration}")
    state, error = None, None
    try:
        state = read_checkpoint_file(path)
    except SystemExit as exc:
        error = str(exc.code)
    agree(error, group)
    return state


def load_checkpoint(root: str, ps: ParallelState, exit_on_missing: bool = False,
                    group=None) -> Optional[Tuple[int, Dict]]:
    """Load this rank's shard of the latest checkpoint under `root`.

    Collective (over the world, and `group`: see `resolve_checkpoint`). Returns
    (iteration, state) -- iteration is 0 for a release checkpoint -- or None when there is
    no tracker file (a warning; or an exit when `exit_on_missing`). Every rank exits when
    a rank's file is missing, naming the layout the checkpoint appears to have.
    """
    found = resolve_checkpoint(root, ps, exit_on_missing, group)
    if found is None:
        return None
    agreed, release = found
    state = load_rank_file(root, agreed, release, ps, group)
    print_rank_0(f"  successfully loaded checkpoint from {root} at iteration {agreed}")
    return (0 if release else agreed), state


def load_extra_file(root: str, iteration: int, ps: ParallelState, name: str,
                    release: bool = False):
    """Load a file saved with `extra_files` next to this rank's model_optim_rng.pt (the
    distributed optimizer's distrib_optim.pt, this rank's optimizer state); SystemExit
    naming the checkpoint as incomplete, and --no-load-optim, when it is missing."""
    path = os.path.join(os.path.dirname(
        checkpoint_name(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size, release)), name)
    if not os.path.isfile(path):
        iter_dir = os.path.join(root, iteration_dir_name(iteration, release))
        raise SystemExit(incomplete_checkpoint_message(
            iter_dir, [os.path.relpath(path, iter_dir)],
            f"{name} holds the optimizer state; --no-load-optim loads the checkpoint without "
            "it, with a fresh optimizer"))
    return read_checkpoint_file(path)


__all__ = ["READ_ERRORS", "load_checkpoint", "load_extra_file", "load_rank_file",
           "read_checkpoint_file", "resolve_checkpoint"]
