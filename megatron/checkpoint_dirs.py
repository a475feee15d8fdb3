"""Checkpoint directories under --load / --save: the tracker file, the iteration
directories there are, and the messages that name them with the fix when a load cannot
go ahead (megatron/checkpointing.py re-exports these)."""
from __future__ import annotations

import os
import re
from typing import List

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_ITER_DIR_RE = re.compile(r"^(iter_\d{7}|release)$")


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_FILENAME)


def list_checkpoints(root: str) -> List[str]:
    """The checkpoint directories under `root` (`iter_XXXXXXX`, `release`), sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root)
                  if _ITER_DIR_RE.match(d) and os.path.isdir(os.path.join(root, d)))


def missing_tracker_message(root: str) -> str:
    """Why there is no checkpoint to load under `root` (which has no tracker file), and the
    fix: the parent directory when `root` is itself an iteration directory, --iteration
    when it holds iteration directories."""
    name = os.path.basename(os.path.normpath(root))
    if _ITER_DIR_RE.match(name):
        parent = os.path.dirname(os.path.normpath(root)) or "."
        pick = "" if name == "release" else f" --iteration {int(name[len('iter_'):])}"
        return (f"--load {root} is one checkpoint's iteration directory; --load takes the "
                f"directory above it: --load {parent}{pick}")
    found = list_checkpoints(root)
    where = f"no checkpoint under --load {root}: {tracker_path(root)} does not exist"
    if found:
        return f"{where}; it holds {', '.join(found)}: pass --iteration N to pick one"
    return f"{where} and {root} holds no iter_XXXXXXX or release directory"


def refuse_untracked_checkpoints(root: str) -> None:
    """SystemExit when --load has no tracker file but is a checkpoint's iteration directory,
    or holds iteration directories: starting from random there is almost surely not what
    was meant (and later saves would mix with those checkpoints)."""
    name = os.path.basename(os.path.normpath(root))
    if _ITER_DIR_RE.match(name) and os.path.isdir(root):
        parent = os.path.dirname(os.path.normpath(root)) or "."
        raise SystemExit(f"error: --load {root} is one checkpoint's iteration directory; "
                         f"--load takes the directory above it: --load {parent} (its "
                         f"{TRACKER_FILENAME} names the iteration to resume)")
    if list_checkpoints(root):
        raise SystemExit(f"error: --load {root} has no {TRACKER_FILENAME} but holds "
                         f"checkpoints; {other_checkpoints_hint(root, '')}")


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
    return (f"error: cannot read checkpoint file {path} ({type(exc).__name__}: {exc}); it is "
            f"truncated or damaged (copied incompletely, or written by another program). Load "
            f"another checkpoint: "
            f"{other_checkpoints_hint(os.path.dirname(iter_dir), os.path.basename(iter_dir))}")
