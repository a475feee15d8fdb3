"""Output names that differ only by case: on a file system that ignores case (macOS's
default APFS volumes, Windows) they name one file, and the second write replaces the first."""
from __future__ import annotations

if __name__ == "__main__":
    raise SystemExit("tools/case_names.py is a library module (output names that differ only "
                     "by case); run python tools/preprocess_data.py --help")

import os
import tempfile
from typing import Iterable, List


def case_clashes(names: Iterable[str]) -> List[List[str]]:
    """The groups of `names` that are equal but for case (each group in the given order)."""
    groups: dict = {}
    for name in names:
        groups.setdefault(name.casefold(), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def ignores_case(directory: str) -> bool:
    """Whether the file system of `directory` (or of its nearest existing parent, for a
    directory still to be made) finds a file under its name in other case. False where no
    probe file can be made there (the write fails later with its own message)."""
    d = os.path.abspath(directory)
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    try:
        fd, probe = tempfile.mkstemp(prefix=".case-probe-", dir=d)  # lower-case name
    except OSError:
        return False
    os.close(fd)
    try:
        head, name = os.path.split(probe)
        return os.path.exists(os.path.join(head, name.upper()))
    finally:
        os.remove(probe)
