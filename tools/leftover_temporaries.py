"""The temporary files preprocess_data.py and merge_datasets.py write a dataset to
(`<prefix>.tmp<pid>-<random>.bin/.idx`, see preprocess_data.temporary_prefix), found
beside the outputs: a run killed with SIGKILL (or by the out-of-memory killer) cannot
remove its own, and they are no dataset. Nothing here deletes them: whether their
process runs is known on this host only (a run on another host of shared storage, or in
another container, looks gone), so the later run names them and the command that removes
them."""
from __future__ import annotations

if __name__ == "__main__":
    raise SystemExit("tools/leftover_temporaries.py is a library module (the temporaries of "
                     "killed runs); run python tools/merge_datasets.py --help")

import os
import re
import shlex
from typing import Optional

# The names `temporary_prefix` gives (a partition's `_<i>` included), with the .bin/.idx.
_TEMPORARY_NAME = re.compile(r"\.tmp(\d+)-[0-9a-f]{8}(?:_\d+)?\.(?:bin|idx)$")


def temporary_files(directory: str, names=None) -> tuple:
    """(stale, live): the paths in `directory` (of `names`, default all its files) that are
    preprocess_data.py's or merge_datasets.py's temporaries; stale ones belong to a process no
    longer running on this host (a run killed with SIGKILL, or by the out-of-memory killer,
    cannot remove them), live ones to a running process (perhaps a run writing now)."""
    stale, live = [], []
    for name in sorted(os.listdir(directory) if names is None else names):
        found = _TEMPORARY_NAME.search(name)
        if found:
            path = os.path.join(directory, name)
            (live if _running(int(found.group(1))) else stale).append(path)
    return stale, live


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's, or not a pid: not named
        return True
    return True


def stale_temporaries_warning(paths, what: str = "are left beside the outputs"
                              ) -> Optional[str]:
    """The warning naming stale temporaries (they `what`) and the command that removes
    them; None for none."""
    if not paths:
        return None
    return (f"warning: {len(paths)} unfinished temporary file(s) of an interrupted "
            f"preprocess_data.py or merge_datasets.py run (its process is gone) {what}; "
            "they are no dataset. Remove them with: rm -f "
            + " ".join(shlex.quote(p) for p in paths))
