"""Blending several datasets with exact weights (`--data-path w1 p1 w2 p2 ...`).

Sample s of the blend comes from the dataset d that maximises
`w_d * max(s, 1) - count_d` (ties: lowest d), evaluated in float64 as Megatron's helper
does; `count_d` (before the increment) is the sample taken from dataset d. This module
computes the same two arrays without a compiled helper: two datasets use a vectorised
predict-and-verify scheme (exact, verified step by step in numpy), a few a plain loop over
the datasets per sample, and from `NUMPY_STEP_MIN` datasets one numpy argmax per sample
(about a microsecond whatever their number: 50 datasets over 100 million samples take a
few minutes, hundreds no longer). The build is sequential by nature (each pick depends on
all earlier ones), which is why a blend's indices are worth caching (`--data-cache-path`).
With a cache dir the two arrays are cached (written under temporary names, renamed into
place); they depend only on the weights and the size, both named in the description.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.index_cache import (
    MissingIndexCacheError,
    load_npy,
    missing_on_this_rank,
    save_npy,
    save_text,
)


def parse_weighted_prefixes(data_prefix: Sequence[str]) -> Tuple[List[str], List[float]]:
    """`[w1, p1, w2, p2, ...]` -> (prefixes, normalised weights); `[p]` -> ([p], [1.0])."""
    if len(data_prefix) == 1:
        return [data_prefix[0]], [1.0]
    if len(data_prefix) == 0 or len(data_prefix) % 2:
        raise ValueError(f"data path {list(data_prefix)} must be one prefix or pairs "
                         "'weight prefix weight prefix ...'")
    try:
        weights = [float(w) for w in data_prefix[0::2]]
    except ValueError as e:
        raise ValueError(f"data path {list(data_prefix)}: weights must be numbers ({e}); give "
                         "one prefix or pairs 'weight prefix weight prefix ...'") from e
    prefixes = [p.strip() for p in data_prefix[1::2]]
    total = 0.0
    for w in weights:
        total += w
    if not math.isfinite(total) or total <= 0.0 or min(weights) < 0:
        raise ValueError(f"data path weights {weights} must be finite numbers >= 0 with a "
                         "positive sum")
    return prefixes, [w / total for w in weights]


def per_dataset_num_samples(num_samples: int, weights: Sequence[float]) -> List[int]:
    """Samples asked of each member: ceil(n * w * 1.005) (0.5% headroom, as Megatron)."""
    return [int(math.ceil(num_samples * w * 1.005)) for w in weights]


def _blending_loop(weights: np.ndarray, size: int, counts: np.ndarray, start: int,
                   dataset_index: np.ndarray, sample_index: np.ndarray) -> None:
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    num = len(w)
    for s in range(start, size):
        sd = float(s) if s > 1 else 1.0
        best, best_err = 0, w[0] * sd - c[0]
        for d in range(1, num):
            err = w[d] * sd - c[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[s] = best
        sample_index[s] = c[best]
        c[best] += 1


NUMPY_STEP_MIN = 40  # datasets from which one numpy argmax per sample beats a Python loop
_FLUSH = 1 << 20  # samples picked between writes into the output arrays


def _blending_numpy_steps(weights: np.ndarray, size: int, dataset_index: np.ndarray,
                          sample_index: np.ndarray) -> None:
    """The greedy with one numpy argmax per sample: the same float64 products and
    differences as `_blending_loop` (counts are exact integers in float64), and argmax
    returns the first maximum, so ties go to the lowest dataset as there."""
    w = np.asarray(weights, dtype=np.float64)
    counts = np.zeros(len(w), dtype=np.float64)
    err = np.empty(len(w), dtype=np.float64)
    multiply, subtract, argmax = np.multiply, np.subtract, np.ndarray.argmax
    for start in range(0, size, _FLUSH):
        stop = min(size, start + _FLUSH)
        picks, taken = [], []
        for s in range(start, stop):
            multiply(w, s if s > 1 else 1.0, out=err)
            subtract(err, counts, out=err)
            d = int(argmax(err))
            picks.append(d)
            taken.append(counts[d])
            counts[d] += 1.0
        dataset_index[start:stop] = picks
        sample_index[start:stop] = taken


def _predict(weights: np.ndarray, counts: np.ndarray, length: int) -> np.ndarray:
    """Guess the next `length` picks: dataset d's j-th next pick near step (c_d + j) / w_d."""
    times, owners = [], []
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        n = int(math.ceil(length * w)) + 2
        times.append((counts[d] + np.arange(n)) / w)
        owners.append(np.full(n, d, dtype=np.int64))
    t, o = np.concatenate(times), np.concatenate(owners)
    return o[np.lexsort((o, t))[:length]]


def _blending_vectorised(weights: np.ndarray, size: int, dataset_index: np.ndarray,
                         sample_index: np.ndarray) -> None:
    num = len(weights)
    counts = np.zeros(num, dtype=np.int64)
    s, block = 0, 1024
    while s < size:
        block = min(block, size - s)
        guess = _predict(weights, counts, block)
        onehot = np.zeros((block, num), dtype=np.int64)
        onehot[np.arange(block), guess] = 1
        before = counts + np.cumsum(onehot, axis=0) - onehot  # counts before each step
        steps = np.maximum(np.arange(s, s + block), 1).astype(np.float64)
        truth = np.argmax(weights[None, :] * steps[:, None] - before, axis=1)  # first max
        wrong = np.flatnonzero(truth != guess)
        good = block if len(wrong) == 0 else int(wrong[0]) + 1  # truth is right one further
        picks = truth[:good]
        dataset_index[s:s + good] = picks
        sample_index[s:s + good] = before[np.arange(good), picks]
        counts += np.bincount(picks, minlength=num)
        s += good
        block = min(block * 2, 1 << 20) if len(wrong) == 0 else max(1024, block // 2)


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index uint8 [size], dataset_sample_index int64 [size]) of Megatron's greedy."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) >= 255:
        raise ValueError(f"at most 254 blended datasets are supported, got {len(weights)}")
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    if len(weights) == 1:
        sample_index[:] = np.arange(size)
    elif len(weights) == 2:
        _blending_vectorised(weights, size, dataset_index, sample_index)
    elif len(weights) >= NUMPY_STEP_MIN:
        _blending_numpy_steps(weights, size, dataset_index, sample_index)
    else:
        _blending_loop(weights, size, np.zeros(len(weights), dtype=np.int64), 0,
                       dataset_index, sample_index)
    return dataset_index, sample_index


def samples_needed(dataset_index: np.ndarray, sample_index: np.ndarray,
                   num_datasets: int) -> np.ndarray:
    """int64 [num_datasets]: 1 + the largest sample index the blend takes from each dataset
    (0 for one it never picks). One pass in blocks, whatever the number of datasets: each
    block is grouped by dataset with numpy's radix sort of its uint8 indices (a pass per
    dataset cost minutes on every rank for a large blend of hundreds of shards)."""
    need = np.zeros(num_datasets, dtype=np.int64)
    for start in range(0, len(dataset_index), _FLUSH * 4):
        picks = np.asarray(dataset_index[start:start + _FLUSH * 4])
        taken = np.asarray(sample_index[start:start + _FLUSH * 4])
        order = np.argsort(picks, kind="stable")
        counts = np.bincount(picks, minlength=num_datasets)
        present = np.flatnonzero(counts)
        starts = (np.cumsum(counts) - counts)[present]
        most = np.maximum.reduceat(taken[order], starts)
        need[present] = np.maximum(need[present], most + 1)
    return need


class BlendedDataset:
    """Samples of several datasets interleaved by weight; items carry `dataset_idx`."""

    def __init__(self, datasets: List, weights: Sequence[float], size: int,
                 cache_dir: Optional[str] = None, may_build: bool = True,
                 on_build: Optional[Callable[[], None]] = None):
        """`on_build` is called before the indices are built (not when a cache is used);
        `build_s` is then the seconds the build took, else None."""
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.size = int(size)
        weights = np.array(weights, dtype=np.float64)
        if weights.sum() <= 0:
            raise ValueError(f"blending weights {weights} must have a positive sum")
        weights /= weights.sum()
        self.weights = weights
        desc = "Blendable dataset\n\nDatasets:\n"
        for dataset in datasets:
            desc += dataset.desc + "\n\n"
        desc += f"Weights: {weights}\n"
        desc += f"Size: {size}\n"
        self.desc = desc
        self.build_s: Optional[float] = None
        self._on_build = on_build
        if cache_dir:
            self.dataset_index, self.dataset_sample_index = self._cached(cache_dir, may_build)
        else:
            self.dataset_index, self.dataset_sample_index = self._build()
        self._check_members()

    def _build(self) -> Tuple[np.ndarray, np.ndarray]:
        if self._on_build is not None:
            self._on_build()
        start = time.time()
        arrays = build_blending_indices(self.weights, self.size)
        self.build_s = time.time() - start
        return arrays

    def _cached(self, cache_dir: str, may_build: bool) -> Tuple[np.ndarray, np.ndarray]:
        h = hashlib.md5(self.desc.encode("utf-8")).hexdigest()
        paths = [os.path.join(cache_dir, h + suffix)
                 for suffix in (".dsc", "_index.npy", "_sample_index.npy")]
        if not (os.path.isfile(paths[1]) and os.path.isfile(paths[2])):
            if not may_build:
                raise MissingIndexCacheError(missing_on_this_rank(f"blending index {paths[1]}",
                                                                  cache_dir))
            index, sample_index = self._build()
            try:
                os.makedirs(cache_dir, exist_ok=True)
                save_npy(paths[1], index)
                save_npy(paths[2], sample_index)
                save_text(paths[0], self.desc)
            except OSError as e:  # the GPT indexes may all have been found elsewhere
                raise ValueError(f"cannot write the blending index cache to {cache_dir} ({e}); "
                                 "pass a writable --data-cache-path") from e
        siblings = ", ".join(paths)
        return load_npy(paths[1], siblings), load_npy(paths[2], siblings)

    def _check_members(self) -> None:
        """Every member has the samples the blend takes from it (a cached blend may come
        from other members)."""
        need = samples_needed(self.dataset_index, self.dataset_sample_index, len(self.datasets))
        for d, dataset in enumerate(self.datasets):
            if need[d] > len(dataset):
                raise ValueError(f"blended dataset {d} has {len(dataset)} samples but the blend "
                                 f"needs {need[d]}")

    def achieved_weights(self) -> np.ndarray:
        """Fraction of the blend's samples drawn from each dataset."""
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        return counts / max(self.size, 1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} outside the blend of {self.size}")
        d = int(self.dataset_index[idx])
        return {"dataset_idx": d, **self.datasets[d][int(self.dataset_sample_index[idx])]}
