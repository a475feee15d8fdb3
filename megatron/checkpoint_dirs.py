"""Checkpoint directories under --load / --save: the tracker file (its path, reading it),
the iteration directories there are, the rank directories and model files in one, the
start-up check that --save can be written, and the messages that name them with the fix
when a load cannot go ahead, a save fails (what stays in use, the free space) or a run
would point the tracker back (megatron/checkpointing.py re-exports these).

Megatron-LM 23.04 with --use-distributed-optimizer wrote another layout: the model (and
RNG states) in `mp_rank_XX[_YYY]/model_rng.pt`, and one optimizer file per data-parallel
rank in `mp_rank_XX[_YYY]_<dp rank, 3 digits>/optim.pt`. Its model files are read (no
`model_optim_rng.pt` beside them); its optimizer files are not (their layout is not
documented), and with pp 1 their directories (`mp_rank_00_000`, ...) are named like the
rank directories of pp > 1: `model_rank_dirs` leaves them out.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from typing import List, Optional, Tuple

from megatron.agreed_exit import agree
from megatron.checkpoint_foreign import (
    deepspeed_message,
    dist_backend,
    dist_checkpoint_message,
    foreign_format_message,
)
from megatron.write_errors import write_probe_error

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
LEGACY_MODEL_FILENAME = "model_rng.pt"  # Megatron-LM 23.04, distributed optimizer
LEGACY_OPTIM_FILENAME = "optim.pt"  # ... one per data-parallel rank
_ITER_DIR_RE = re.compile(r"^(iter_\d{7}|release)$")
_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def is_iteration_dir_name(name: str) -> bool:
    """Whether `name` is a checkpoint's iteration directory's (iter_XXXXXXX, release)."""
    return bool(_ITER_DIR_RE.match(name))


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_FILENAME)


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """`mp_rank_00` when pp_size == 1, else `mp_rank_00_000`."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_name(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    release: bool = False) -> str:
    """Path of one (tp, pp) rank's `model_optim_rng.pt`."""
    return os.path.join(root, iteration_dir_name(iteration, release),
                        rank_dir_name(tp_rank, pp_rank, pp_size), MODEL_FILENAME)


_TRACKER_MAX_BYTES = 4096  # an iteration number or 'release' (and white space)


def read_tracker(root: str) -> Tuple[Optional[int], bool]:
    """Parse `latest_checkpointed_iteration.txt`.

    Returns (None, False) when the file does not exist, (0, True) for "release" and
    (iteration, False) otherwise. Raises ValueError naming the file and its content when
    it holds anything else (Megatron requires an integer > 0 or "release").
    """
    path = tracker_path(root)
    if not os.path.isfile(path):
        return None, False
    with open(path, "rb") as f:  # not UTF-8, or a large file copied over it: named below
        raw = f.read(_TRACKER_MAX_BYTES + 1)
    content = raw.decode("utf-8", errors="replace")
    if len(raw) > _TRACKER_MAX_BYTES:
        content = f"{content[:200]}... (over {_TRACKER_MAX_BYTES} bytes)"
    text = content.strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = None
    if iteration is None or iteration <= 0:
        raise ValueError(
            f"malformed checkpoint tracker file {path}: content {content!r}; expected an "
            f"iteration number > 0 or 'release'. Fix or delete the file (it should name one "
            f"of the iter_XXXXXXX directories in {root})"
        )
    return iteration, False


def list_checkpoints(root: str) -> List[str]:
    """The checkpoint directories under `root` (`iter_XXXXXXX`, `release`), sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root)
                  if _ITER_DIR_RE.match(d) and os.path.isdir(os.path.join(root, d)))


def check_save_dir(root: str, ps, group=None) -> None:
    """Startup check of --save: global rank 0 creates `root` and writes and removes a probe
    file in it. Collective (`agree` over `group`, the run's CPU control group): when that
    fails, every rank exits (rank 0 prints), naming the path and the error -- not after
    training, at the first save."""
    check_output_dir(root, "--save", ps, group)


def check_output_dir(root: str, flag: str, ps, group=None,
                     writer_rank: int = 0) -> None:
    """`check_save_dir` for any output directory `flag` names, probed by the rank that
    writes there (`writer_rank`; tensorboard's is the last). Collective."""
    error = None
    if ps.rank == writer_rank:
        try:
            os.makedirs(root, exist_ok=True)
            refused = write_probe_error(root)
            if refused is not None:
                raise refused
        except OSError as exc:
            error = (f"error: {flag} {root} cannot be used: could not create it "
                     f"or write into it ({type(exc).__name__}: {exc}); pass a directory that "
                     "can be created and written to")
    agree(error, group)


def _leftovers(root: str, suffix: str) -> List[str]:
    """The `iter_XXXXXXX<suffix>` / `release<suffix>` directories under `root`, sorted."""
    return sorted(d for d in os.listdir(root) if d.endswith(suffix)
                  and _ITER_DIR_RE.match(d[:-len(suffix)]) and os.path.isdir(os.path.join(root, d)))


def _gib(root: str, names: List[str]) -> str:
    size = sum(os.path.getsize(os.path.join(top, f))
               for d in names for top, _, files in os.walk(os.path.join(root, d)) for f in files)
    return f"{size / 2**30:.2f} GiB"


def _remove_unfinished(root: str, stale: List[str], size: str, idle_s: float) -> str:
    """Remove the `stale` .tmp directories under `root`: the line that says so, or the
    warning naming those that could not be removed."""
    failed = []
    for name in stale:
        path = os.path.join(root, name)
        try:
            if os.path.islink(path):  # the link, not what it points to
                os.unlink(path)
            else:
                shutil.rmtree(path)
        except OSError as exc:
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    if failed:
        return (f"WARNING: --save {root} holds unfinished checkpoint save(s) of a run that no "
                f"longer runs that could not be removed: {', '.join(failed)}; nothing loads "
                "them, delete them to free the space")
    return (f"removed {', '.join(stale)} from --save {root} ({size}): unfinished checkpoint "
            "save(s) of an earlier run, stopped while writing them or before moving them into "
            f"place; nothing loads them, this run holds the directory's save lock and nothing "
            f"was written to them for {idle_s:.0f} s, so no other run is writing them")


UNFINISHED_IDLE_S = 600.0  # a .tmp written to more recently may be a live save


def _idle_s(path: str, now: float) -> float:
    """Seconds since anything at or under `path` was last modified (links not followed)."""
    newest = os.lstat(path).st_mtime
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(top, name)).st_mtime)
            except OSError:  # removed meanwhile: someone is at work there
                return 0.0
    return now - newest


def _live_saves_warning(root: str, recent: List[Tuple[str, float]], idle_s: float) -> str:
    listing = ", ".join(f"{name}, written to {max(age, 0.0):.0f} s ago" for name, age in recent)
    return (f"WARNING: --save {root} holds {listing}: the unfinished save of another run, or "
            "one still being written by a run on another node (a file system that keeps "
            "locks per node, e.g. NFS mounted nolock or local_lock, lets two runs hold the "
            f"save lock); left in place, removed after {idle_s:.0f} s without a write by a "
            "later start. Delete it once no other run uses the directory")


def unfinished_saves_report(root: str, locked: bool,
                            idle_s: float = UNFINISHED_IDLE_S) -> Optional[str]:
    """What interrupted saves left under --save `root`, one line each:
    `iter_XXXXXXX.tmp` / `release.tmp` directories, saves a killed process never finished
    (megatron/checkpointing.py writes there, then renames): nothing loads them, and a later
    save would remove one only when it saves that same iteration again, so one left by a
    save at an off-interval iteration (a preemption signal, --exit-duration-in-mins) stayed
    for good. With `locked` (this process holds the --save lock of megatron/save_lock.py,
    and has not begun saving: no other run writes there) they are removed, and the line
    says so; without (a file system without locks) another run may be writing them, so
    they are only warned of. Even with it, one written to in the last `idle_s` seconds
    is only warned of: a file system whose locks are per node lets a run on another node
    hold the lock too, and that one may be writing it. Also `iter_XXXXXXX.old`, the copy a re-save of that iteration
    moved aside: beside the new `iter_XXXXXXX` a leftover, without it the only copy (a
    --load of `root` restores it when the tracker names it); never removed. None when
    there is nothing."""
    if not os.path.isdir(root):
        return None
    lines = []
    stale = _leftovers(root, ".tmp")
    if stale and locked:
        now = time.time()
        ages = [(name, _idle_s(os.path.join(root, name), now)) for name in stale]
        recent = [(name, age) for name, age in ages if age < idle_s]
        stale = [name for name, age in ages if age >= idle_s]
        if recent:
            lines.append(_live_saves_warning(root, recent, idle_s))
        if stale:
            lines.append(_remove_unfinished(root, stale, _gib(root, stale), idle_s))
    elif stale:
        lines.append(f"WARNING: --save {root} holds {', '.join(stale)}: unfinished checkpoint "
                     f"save(s) of a process killed while writing ({_gib(root, stale)}); "
                     "nothing loads them, but --save's file system does not lock files, so "
                     "another run may be writing them: delete them to free the space once "
                     "no other run uses the directory")
    for old in _leftovers(root, ".old"):
        new = old[:-len(".old")]
        if os.path.isdir(os.path.join(root, new)):
            lines.append(f"WARNING: --save {root} holds {old} ({_gib(root, [old])}): the "
                         f"earlier copy of {new} that a save replaced before it was stopped; "
                         f"{new} is the complete new one, delete {old} to free the space")
        else:
            keep = (f"a --load of {root} restores it (its tracker names it)"
                    if _tracked_dir(root) == new else
                    f"`mv {shlex.quote(os.path.join(root, old))} "
                    f"{shlex.quote(os.path.join(root, new))}` keeps it")
            lines.append(f"WARNING: --save {root} holds {old}, the only copy of {new} (a "
                         f"save replacing it was stopped): {keep}; a save of that iteration "
                         "replaces it")
    return "\n".join(lines) or None


def _tracked_dir(root: str) -> Optional[str]:
    """The iteration directory name the tracker of `root` names, or None."""
    try:
        iteration, release = read_tracker(root)
    except ValueError:
        return None
    return None if iteration is None else iteration_dir_name(iteration, release)


def later_checkpoints_warning(root: str, start_iteration: int,
                              finetune: bool = False) -> Optional[str]:
    """The warning for a run that starts at `start_iteration` while --save `root` already
    tracks a later checkpoint (no --load, --finetune, or --load of another directory): its
    saves replace the iteration directories they reach and point the tracker back, so the
    later checkpoints drop out of a resume. The fix to resume names dropping --finetune
    when the run has it (a requeued fine-tuning job restarts at iteration 0 otherwise, even
    from --load `root`). Without such a tracker (none, a release or malformed one, or one
    at or before `start_iteration`), iteration directories past `start_iteration` get
    `_untracked_later_warning`'s; None when there is nothing to lose. Local, no collective:
    call it on one rank."""
    try:
        saved, release = read_tracker(root)
    except ValueError:
        saved, release = None, False
        tracked = "is malformed"
    else:
        tracked = ("does not exist" if saved is None else "names 'release'" if release
                   else f"names iteration {saved}")
    if saved is None or release or saved <= start_iteration:
        return _untracked_later_warning(root, start_iteration, tracked)
    resume = f"pass --load {root}"
    if finetune:
        resume += " without --finetune (which restarts at iteration 0 from any --load)"
    return (f"WARNING: --save {root} already holds checkpoints up to iteration {saved} (its "
            f"{TRACKER_FILENAME}), and this run starts at iteration {start_iteration}: its "
            f"first save will point the tracker back, and its saves replace the iteration "
            f"directories they reach. To resume instead, {resume}; to keep both, pass "
            "another --save directory")


def _untracked_later_warning(root: str, start_iteration: int, tracked: str) -> Optional[str]:
    """The warning for iteration directories in --save `root` past `start_iteration` that
    its tracker does not name (no tracker, a malformed one, or one naming an earlier
    iteration: another run's, a copy, a rolled-back tracker): a save of this run at one of
    those iterations replaces that directory, which nothing said before."""
    later = [d for d in list_checkpoints(root)
             if d != "release" and int(d[len("iter_"):]) > start_iteration]
    if not later:
        return None
    shown = ", ".join(later[:3]) + (f" and {len(later) - 3} more" if len(later) > 3 else "")
    return (f"WARNING: --save {root} holds {shown}, past this run's start at iteration "
            f"{start_iteration}, and its {TRACKER_FILENAME} {tracked}: this run's saves "
            "replace the iteration directories they reach. "
            f"To keep those checkpoints, move them out of {root} or pass another --save "
            "directory")


def previous_checkpoint_text(root: str) -> str:
    """What a failed save leaves in use: the tracker's checkpoint, or that there is none."""
    try:
        iteration, release = read_tracker(root)
    except ValueError:
        iteration, release = None, False
    if iteration is None:
        return f"there is no earlier checkpoint in {root}"
    return (f"the previous checkpoint {os.path.join(root, iteration_dir_name(iteration, release))}"
            f" is intact (the tracker still names it)")


def unpublished_message(root: str, tmp_dir: str, iteration: int, exc: OSError) -> str:
    """A save whose files are all in `tmp_dir` but could not be renamed into place."""
    final_dir = tmp_dir[:-len(".tmp")]
    return (f"the checkpoint at iteration {iteration} was written to {tmp_dir} but could not "
            f"be moved into place as {final_dir} ({type(exc).__name__}: {exc}); "
            f"{previous_checkpoint_text(root)}")


def untracked_save_message(root: str, iteration: int, release: bool, exc: OSError) -> str:
    """A save in place whose tracker could not be written (`exc`): the tracker names the
    previous checkpoint, which a resume loads; how to name this one instead."""
    final_dir = os.path.join(root, iteration_dir_name(iteration, release))
    value = "release" if release else str(iteration)
    return (f"the checkpoint at iteration {iteration} was written to {final_dir}, but "
            f"{tracker_path(root)} could not be updated to name it ({type(exc).__name__}: "
            f"{exc}); {free_space_text(root)}; {previous_checkpoint_text(root)}, and a resume "
            f"loads that one. To resume from iteration {iteration} instead, free space and "
            f"run `printf {value} > {tracker_path(root)}`")


def free_space_text(path: str) -> str:
    """'1.5 GiB free on the file system of <path> (...)' (or why that is unknown): what the
    file system has, which a disk quota or a file-size limit may not let the run use."""
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return f"free space on the file system of {path} unknown ({exc})"
    units = ["KiB", "MiB", "GiB", "TiB"]
    size, unit = float(free), -1
    while size >= 1024 and unit < len(units) - 1:
        size, unit = size / 1024, unit + 1
    amount = f"{free} bytes" if unit < 0 else f"{size:.1f} {units[unit]}"
    return (f"{amount} free on the file system of {path} (a disk quota or file-size limit "
            "may allow less)")


def model_file(rank_dir: str) -> str:
    """The model file of a rank directory: `model_optim_rng.pt`, or Megatron-LM 23.04's
    `model_rng.pt` when only that exists (`model_optim_rng.pt` when neither does)."""
    path = os.path.join(rank_dir, MODEL_FILENAME)
    legacy = os.path.join(rank_dir, LEGACY_MODEL_FILENAME)
    return legacy if not os.path.isfile(path) and os.path.isfile(legacy) else path


def is_legacy_model_file(path: str) -> bool:
    """Whether `path` is a Megatron-LM 23.04 distributed-optimizer model file."""
    return os.path.basename(path) == LEGACY_MODEL_FILENAME


def _is_legacy_optimizer_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LEGACY_OPTIM_FILENAME)) and \
        not os.path.isfile(model_file(path))


def model_rank_dirs(iter_dir: str) -> List[Tuple[str, int, int]]:
    """(name, tp rank, pp rank) of the `mp_rank_XX[_YYY]` directories of a saved iteration,
    sorted by name, leaving out Megatron-LM 23.04's per-data-parallel optimizer directories
    (an `optim.pt` and no model file); [] when there are none."""
    if not os.path.isdir(iter_dir):
        return []
    out = []
    for name in sorted(os.listdir(iter_dir)):
        m = _RANK_DIR_RE.match(name)
        if m and not _is_legacy_optimizer_dir(os.path.join(iter_dir, name)):
            out.append((name, int(m.group(1)), int(m.group(2) or 0)))
    return out


def _saved_size(args: Optional[dict], key: str) -> int:
    value = args.get(key) if isinstance(args, dict) else None
    return value if isinstance(value, int) and value >= 1 else 1


def _stored_sizes(args: Optional[dict]) -> Optional[Tuple[int, int]]:
    """(tp, pp) stored in a checkpoint's `args`, None when it does not hold both."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    values = [args.get(k) if isinstance(args, dict) else None for k in keys]
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
    return (values[0], values[1]) if ok else None


def _has_grid(found: List[Tuple[str, int, int]], tp: int, pp: int) -> bool:
    """Whether the rank directories `found` include every one of a tp x pp save."""
    names = {name for name, _, _ in found}
    return all(rank_dir_name(t, p, pp) in names for p in range(pp) for t in range(tp))


def _refuse_mixed_names(iter_dir: str, names: List[str]) -> None:
    """SystemExit when `iter_dir` holds rank directories of both naming schemes
    (`mp_rank_XX` of pp 1 and `mp_rank_XX_YYY` of pp > 1): Megatron-LM saves into an
    existing iteration directory, so a save at another pipeline size leaves the earlier
    save's directories beside its own, and which files are this save's cannot be told."""
    plain = [n for n in names if _RANK_DIR_RE.match(n).group(2) is None]
    staged = [n for n in names if _RANK_DIR_RE.match(n).group(2) is not None]
    if plain and staged:
        raise SystemExit(
            f"error: checkpoint {iter_dir} holds rank directories of two saves: "
            f"{', '.join(plain)} (pipeline-model-parallel size 1) and {', '.join(staged)} "
            "(pipeline-model-parallel size > 1): a save at another pipeline size into the "
            "same iteration directory leaves the earlier one's. Move the directories of the "
            "save that is not wanted out of it (their model_optim_rng.pt 'args' hold "
            "pipeline_model_parallel_size), then load again")


def complete_layout(iter_dir: str, args: Optional[dict] = None) -> Tuple[int, int]:
    """(tp, pp) of a saved iteration from its `mp_rank_*` directories (`model_rank_dirs`).
    SystemExit when there are none, or when some are missing: a gap in the tp x pp grid
    they span (a 3-digit pipeline suffix means pp >= 2), or fewer than the sizes stored in
    its `args` (the rank-0 file's) when every directory lies within those. Such a
    checkpoint was copied in part (or each node wrote its own ranks to a disk of its own):
    read as a smaller layout, it was resharded and failed on shapes, blaming the model
    flags. When `args` store sizes whose directories are all there, those are the sizes:
    directories beyond them are strays that Megatron-LM never reads (an earlier save at a
    larger tp or pp into the same iteration directory, which Megatron-LM writes in place).
    SystemExit as well for directories of both naming schemes (`_refuse_mixed_names`)."""
    found = model_rank_dirs(iter_dir)
    if not found:
        raise SystemExit(no_rank_dirs_message(iter_dir))
    _refuse_mixed_names(iter_dir, [name for name, _, _ in found])
    stored = _stored_sizes(args)
    if stored is not None and _has_grid(found, *stored):
        return stored  # directories beyond it are strays (an earlier save at another layout)
    tp, pp = 1 + max(t for _, t, _ in found), 1 + max(p for _, _, p in found)
    if any(_RANK_DIR_RE.match(name).group(2) for name, _, _ in found):
        pp = max(pp, 2)
    saved = (_saved_size(args, "tensor_model_parallel_size"),
             _saved_size(args, "pipeline_model_parallel_size"))
    have = {(t, p) for _, t, p in found}
    if all(t < saved[0] and p < saved[1] for t, p in have):  # else they name another layout
        tp, pp = max(tp, saved[0]), max(pp, saved[1])
    missing = [rank_dir_name(t, p, pp) for p in range(pp) for t in range(tp) if (t, p) not in have]
    if missing:
        said = (f"; its arguments say tensor-model-parallel size {saved[0]} and "
                f"pipeline-model-parallel size {saved[1]}" if (tp, pp) == saved else "")
        raise SystemExit(incomplete_checkpoint_message(
            iter_dir, missing, f"found {', '.join(name for name, _, _ in found)}{said}"))
    return tp, pp


def no_rank_dirs_message(iter_dir: str) -> str:
    """The error for a checkpoint's iteration directory without rank directories: what it
    is when another program wrote it (a Megatron-Core distributed checkpoint), else that it
    is not a checkpoint."""
    dist = dist_checkpoint_message(iter_dir)
    if dist is not None:
        return f"error: {dist}"
    root, name = os.path.split(os.path.normpath(iter_dir))
    return (f"error: {iter_dir} holds no mp_rank_* directories (not a checkpoint: emptied, "
            f"or copied in part); load another checkpoint: "
            f"{other_checkpoints_hint(root or '.', name)}")


def incomplete_checkpoint_message(iter_dir: str, missing: List[str], found: str) -> str:
    """The error for a checkpoint whose rank directories or files `missing` (relative to
    `iter_dir`) are not there, `found` saying what is; the fix: the other checkpoints."""
    root, name = os.path.dirname(iter_dir), os.path.basename(iter_dir)
    return (f"error: checkpoint {iter_dir} is incomplete: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing ({found}). It was copied in part, "
            "or its ranks saved to disks of their own; copy what is missing into it, or load "
            f"another checkpoint: {other_checkpoints_hint(root, name)}")


def missing_rank_files_message(iter_dir: str, paths: List[str], tp_size: int,
                               pp_size: int) -> str:
    """The error for rank files `paths` missing from `iter_dir` for a run of `tp_size` x
    `pp_size`: incomplete when its directories are that layout's, else the layout the
    directories show, to run with or reshard to."""
    paths = sorted(set(paths))
    if dist_backend(iter_dir) is not None and not model_rank_dirs(iter_dir):
        return no_rank_dirs_message(iter_dir)
    if {(t, p) for _, t, p in model_rank_dirs(iter_dir)} == {
            (t, p) for t in range(tp_size) for p in range(pp_size)}:
        return incomplete_checkpoint_message(
            iter_dir, [os.path.relpath(p, iter_dir) for p in paths],
            f"its layout is this run's: tensor-model-parallel size {tp_size}, "
            f"pipeline-model-parallel size {pp_size}")
    return (f"checkpoint file(s) missing: {', '.join(paths)}. This run uses "
            f"tensor-model-parallel size {tp_size} and pipeline-model-parallel size "
            f"{pp_size}; {describe_layout(iter_dir)}. Run with the checkpoint's sizes or "
            "reshard the checkpoint.")


def legacy_optimizer_message(path: str) -> str:
    """Why the optimizer state of the Megatron-LM 23.04 checkpoint whose model file is
    `path` cannot be loaded, and the flags that load the rest."""
    iter_dir = os.path.dirname(os.path.dirname(path))
    return (f"error: {iter_dir} is a Megatron-LM 23.04-layout distributed-optimizer "
            f"checkpoint (the model in mp_rank_*/{LEGACY_MODEL_FILENAME}, the optimizer in one "
            f"mp_rank_*_<data-parallel rank>/{LEGACY_OPTIM_FILENAME} per data-parallel rank); "
            "its optimizer state cannot be read here (that layout is not documented). Pass "
            "--no-load-optim to resume from it (the weights, the iteration and the consumed "
            "samples are kept; the Adam moments and the learning-rate schedule start fresh), "
            "or --finetune to start from its weights at iteration 0")


def _checkpoint_root_above(path: str) -> Optional[str]:
    """The --load directory `path` lies inside when it is one checkpoint's iteration
    directory, a rank directory in one, or a file in such a rank directory; else None."""
    head, below = os.path.normpath(path), []
    for _ in range(3):  # iter_X; iter_X/mp_rank_00; iter_X/mp_rank_00/model_optim_rng.pt
        head, name = os.path.split(head)
        if _ITER_DIR_RE.match(name):
            if not below or _RANK_DIR_RE.match(below[0]):
                return head or "."
            return None
        below.insert(0, name)
    return None


def misplaced_load_message(root: str, flag: str = "--load") -> Optional[str]:
    """Why --load `root` (no tracker file there) is not a checkpoint directory though it
    holds or is part of one, with the fix: an iteration directory, a rank directory or a
    checkpoint file (the directory above the iteration directories is meant), another
    program's checkpoint or model (megatron/checkpoint_foreign.py: the command that
    converts it), another file, the parent of a checkpoint directory. None otherwise.
    `flag` names the option in the message."""
    above = _checkpoint_root_above(root)
    foreign = foreign_format_message(root, flag) if above is None or os.path.isdir(root) \
        else None
    if foreign is not None:
        return foreign
    name = os.path.basename(os.path.normpath(root))
    if above is not None:
        what = ("one checkpoint's iteration directory" if _ITER_DIR_RE.match(name)
                else "a file inside a checkpoint" if os.path.isfile(root)
                else "one rank's directory inside a checkpoint")
        return (f"{flag} {root} is {what}; {flag} takes the directory above the iteration "
                f"directories (the one --save wrote): {flag} {shlex.quote(above)}")
    if os.path.isfile(root):
        return (f"{flag} {root} is a file; {flag} takes the directory --save wrote (the one "
                f"holding {TRACKER_FILENAME} and the iter_XXXXXXX directories)")
    below = _tracked_subdirectories(root)
    if below:
        return (f"{flag} {root} has no {TRACKER_FILENAME}, but {', '.join(below)} below it "
                f"{'has' if len(below) == 1 else 'have'} one; {flag} takes the directory "
                f"--save wrote: {flag} {shlex.quote(below[-1])} (or another {flag} to start "
                "from scratch)")
    return None


def missing_tracker_message(root: str) -> str:
    """Why there is no checkpoint to load under `root` (which has no tracker file), and the
    fix: the parent directory when `root` is itself an iteration directory, --iteration
    when it holds iteration directories (`misplaced_load_message` for the other mistakes)."""
    name = os.path.basename(os.path.normpath(root))
    if _ITER_DIR_RE.match(name) and dist_backend(root) is None:
        parent = os.path.dirname(os.path.normpath(root)) or "."
        pick = "" if name == "release" else f" --iteration {int(name[len('iter_'):])}"
        return (f"--load {root} is one checkpoint's iteration directory; --load takes the "
                f"directory above it: --load {shlex.quote(parent)}{pick}")
    misplaced = misplaced_load_message(root)
    if misplaced is not None:
        return misplaced
    found = list_checkpoints(root)
    where = f"no checkpoint under --load {root}: {tracker_path(root)} does not exist"
    if found:
        return f"{where}; it holds {', '.join(found)}: pass --iteration N to pick one"
    from megatron.arguments_inputs import missing_home_hint

    return (f"{where} and {root} holds no iter_XXXXXXX or release directory"
            f"{missing_home_hint(root)}")


def refuse_untracked_checkpoints(root: str) -> None:
    """SystemExit when --load has no tracker file but is part of a checkpoint (an iteration
    directory, a rank directory, a checkpoint file), a file, another program's checkpoint or
    model (`misplaced_load_message`), or holds iteration directories or a subdirectory with
    a tracker (--load named the checkpoint directory's parent): starting from random
    there is almost surely not what was meant (and later saves would mix with those
    checkpoints)."""
    name = os.path.basename(os.path.normpath(root))
    if _ITER_DIR_RE.match(name) and os.path.isdir(root) and dist_backend(root) is None:
        parent = os.path.dirname(os.path.normpath(root)) or "."
        raise SystemExit(f"error: --load {root} is one checkpoint's iteration directory; "
                         f"--load takes the directory above it: --load {shlex.quote(parent)} "
                         f"(its {TRACKER_FILENAME} names the iteration to resume)")
    misplaced = misplaced_load_message(root) if os.path.exists(root) else None
    if misplaced is not None:
        raise SystemExit(f"error: {misplaced}")
    if list_checkpoints(root):
        raise SystemExit(f"error: --load {root} has no {TRACKER_FILENAME} but holds "
                         f"checkpoints; {other_checkpoints_hint(root, '')}")


def _tracked_subdirectories(root: str) -> List[str]:
    """The direct subdirectories of `root` that hold a tracker file (checkpoint directories
    one level down: --load named their parent)."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root))
            if os.path.isfile(os.path.join(root, d, TRACKER_FILENAME))]


def other_checkpoints_hint(root: str, skip: str) -> str:
    """How to resume from another checkpoint under `root` than the directory `skip`."""
    others = [d for d in list_checkpoints(root) if d != skip]
    if not others:
        return f"there is no other checkpoint under {root}"
    last = others[-1]
    value = "release" if last == "release" else str(int(last[len("iter_"):]))
    return (f"the checkpoints under {root} are {', '.join(others)}: to resume from one, write "
            f"its iteration into {tracker_path(root)} (e.g. `printf {value} > "
            f"{tracker_path(root)}`)")


def unreadable_file_message(path: str, exc: BaseException) -> str:
    """The message for a checkpoint file torch.load cannot read: the file, the error, and
    how to fall back to an earlier checkpoint (`path` is <root>/<iter dir>/<rank dir>/file)."""
    iter_dir = os.path.dirname(os.path.dirname(path))
    # torch's zip reader appends a paragraph of advice ("This is an internal miniz
    # error. If you are seeing this error, ..."): keep its first sentence only
    detail = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
    return (f"error: cannot read checkpoint file {path} ({type(exc).__name__}: {detail}) "
            f"(the file is truncated or not a torch checkpoint: copied incompletely, or "
            f"written by another program). Load another checkpoint: "
            f"{other_checkpoints_hint(os.path.dirname(iter_dir), os.path.basename(iter_dir))}")


def iteration_dir_name(iteration: int, release: bool = False) -> str:
    """`iter_0000100`, or `release` for a release checkpoint."""
    return "release" if release else f"iter_{iteration:07d}"


def describe_layout(iter_dir: str) -> str:
    """What the `mp_rank_*` directories in a checkpoint say about its tp/pp layout."""
    found = model_rank_dirs(iter_dir)
    if not found:
        return f"{iter_dir} holds no mp_rank_* directories"
    return (f"the checkpoint appears to have tensor-model-parallel size "
            f"{max(t for _, t, _ in found) + 1} and pipeline-model-parallel size "
            f"{max(p for _, _, p in found) + 1} (found {', '.join(n for n, _, _ in found)})")


def malformed_tracker_message(root: str, exc: ValueError) -> str:
    """The error for a tracker file `read_tracker` rejects (`exc`), and the way out."""
    return f"error: {exc}; {other_checkpoints_hint(root, '')}"


def exit_on_missing_message(tracker: str) -> str:
    """The error for a --load without a tracker file under --exit-on-missing-checkpoint."""
    return (f"no checkpoint found: {tracker} does not exist and --exit-on-missing-checkpoint "
            f"is set; check --load or drop the flag")


def missing_iteration_dir_message(root: str, iteration: int, release: bool) -> str:
    """The error for a tracker naming an iteration directory that does not exist."""
    name = iteration_dir_name(iteration, release)
    value = "release" if release else iteration
    deepspeed = deepspeed_message(root)
    if deepspeed is not None:  # Megatron-DeepSpeed writes a tracker beside global_stepN/
        return (f"error: {tracker_path(root)} names {value}, but there is no "
                f"{os.path.join(root, name)}: {deepspeed}")
    return (f"error: {tracker_path(root)} names {value}, but the checkpoint directory "
            f"{os.path.join(root, name)} does not exist; fix the tracker file: "
            f"{other_checkpoints_hint(root, name)}")


def same_dir(a: Optional[str], b: Optional[str]) -> bool:
    """Whether `a` and `b` name one directory: one real path, or (both existing) one file
    under two spellings -- a case-insensitive file system's (macOS), a bind mount's."""
    if not (a and b):
        return False
    try:
        return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False
