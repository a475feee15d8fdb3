"""The blending index cache: a blend's two arrays, kept where the GPT indexes are kept.

A blend's arrays (`dataset_index` uint8, `dataset_sample_index` int64, one value per
sample) depend on the normalised weights, the number of samples and the builder's
algorithm, and on nothing else: not on the members' data, nor on how many samples each
member has. The key text names exactly these (the weights as exact float64 hex, so that
weights differing in their last bit differ here; Megatron's description prints them
rounded to 8 digits):

    Blending indices
    Builder version <v>
    Size <n>
    Weights <w_0.hex()> <w_1.hex()> ...

K = the first 32 hex digits of its sha256 names the set: `blend-K.dsc` (the key text),
`blend-K_index.npy` and `blend-K_sample_index.npy`. The set is looked for in the
directories the members' GPT indexes use (`index_cache.cache_directories` of the first
member: `index-cache/` beside its data, then the cache dir) and written into the last of
them, each file under a temporary name renamed into place, the key file last. A set is used
only when its key file holds the key and both arrays pass a header and size check
(`npy_problem`): a truncated, corrupt or foreign file is warned about and rebuilt (the
content is a function of the key alone, so replacing it cannot hurt another run using it).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.index_cache import load_npy, npy_problem, save_npy, save_text
from megatron.core.datasets.index_cache import unwritable as _unwritable

BlendArrays = Tuple[np.ndarray, np.ndarray]  # dataset_index, dataset_sample_index
_DTYPES = {"index": np.uint8, "sample_index": np.int64}


def blend_key(weights: np.ndarray, size: int, version: int) -> str:
    """The key text of the blend of `size` samples over the normalised `weights`."""
    shown = " ".join(float(w).hex() for w in np.asarray(weights, dtype=np.float64))
    return f"Blending indices\nBuilder version {version}\nSize {int(size)}\nWeights {shown}\n"


def blend_cache_paths(directory: str, key: str) -> Dict[str, str]:
    """{'key', 'index', 'sample_index'} -> the cache file paths of `key` in `directory`."""
    name = "blend-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
    return {"key": os.path.join(directory, name + ".dsc"),
            "index": os.path.join(directory, name + "_index.npy"),
            "sample_index": os.path.join(directory, name + "_sample_index.npy")}


class BlendIndexCache:
    """The cache sets one blend may be read from (`directories`, in order) and written to
    (the last). `find` and `save` are all a rank needs; see the module docstring."""

    def __init__(self, directories: Sequence[str], weights: np.ndarray, size: int,
                 version: int):
        self.weights = np.asarray(weights, dtype=np.float64)
        self.size = int(size)
        self.key = blend_key(self.weights, self.size, version)
        self.sets: List[Dict[str, str]] = [blend_cache_paths(d, self.key) for d in directories]
        self.directory = directories[-1]

    def present(self) -> bool:
        """Whether some directory holds a (not yet checked) set of this key."""
        return any(all(os.path.isfile(p) for p in paths.values()) for paths in self.sets)

    def problem(self, paths: Dict[str, str]) -> Optional[str]:
        """Why the set at `paths` cannot be used (None: it can)."""
        try:
            with open(paths["key"], "rb") as f:
                if f.read(len(self.key) + 1) != self.key.encode("utf-8"):
                    return f"{paths['key']}: holds another key than this blend's"
        except OSError as e:
            return f"{paths['key']}: {e}"
        for name, dtype in _DTYPES.items():
            why = npy_problem(paths[name], dtype, self.size)
            if why is not None:
                return f"{paths[name]}: {why}"
        return None

    def load(self, paths: Dict[str, str]) -> Optional[BlendArrays]:
        """The memory-mapped arrays of the set at `paths`, or None when it is unusable."""
        if self.problem(paths) is not None:
            return None
        listing = ", ".join(paths.values())
        return load_npy(paths["index"], listing), load_npy(paths["sample_index"], listing)

    def find(self) -> Optional[Tuple[Dict[str, str], BlendArrays]]:
        """(paths, memory-mapped arrays) of the first usable set, else None. A set that
        is there but unusable is warned about and passed over. One without its key file
        (written last) is incomplete, not damaged: another run sharing the directory is
        writing it now (or a write stopped between renames); passed over silently."""
        for paths in self.sets:
            if not os.path.exists(paths["key"]):
                continue
            why = self.problem(paths)
            if why is None:
                return paths, self.load(paths)
            warnings.warn(f"ignoring the blending index cache in {os.path.dirname(paths['key'])}"
                          f" ({why}); building the blend again", stacklevel=2)
        return None

    def unwritable(self) -> Optional[OSError]:
        """Why the set cannot be written (None: it can), from a trial write."""
        return _unwritable(self.directory)

    def nbytes(self) -> int:
        """Bytes of the set's two arrays on disk (uint8 and int64 per sample), about."""
        return 9 * self.size

    def save(self, arrays: BlendArrays) -> Dict[str, str]:
        """Write `arrays` as this key's set into the last directory (OSError if it cannot
        be written); the key file goes last, so a set with one is complete."""
        paths = self.sets[-1]
        os.makedirs(self.directory, exist_ok=True)
        save_npy(paths["index"], np.asarray(arrays[0], dtype=np.uint8))
        save_npy(paths["sample_index"], np.asarray(arrays[1], dtype=np.int64))
        save_text(paths["key"], self.key)
        return paths
