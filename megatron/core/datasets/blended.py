"""Blending several datasets with exact weights (`--data-path w1 p1 w2 p2 ...`).

Sample s of the blend comes from the dataset d that maximises
`w_d * max(s, 1) - count_d` (ties: lowest d), evaluated in float64 as Megatron's helper
does; `count_d` (before the increment) is the sample taken from dataset d. This module
computes the same two arrays without a compiled helper. From 3 to LANES_MIN - 1
datasets it guesses a block of picks (each dataset's next picks where its deficit would
reach the current maximum), computes in numpy the greedy's true pick at every step given the
guess's counts, and repairs each wrong step i by moving its true pick forward from its next
place p in the guess (the counts after p are unchanged, so only steps i+1..p are computed
again) until the guess and the true picks agree everywhere: then, by induction from the
block's first step, the guess is the greedy (0.1-1 microsecond per sample; a plain
per-sample loop takes over where the guesses keep failing). Two datasets keep a simpler
variant (the verified part of each guess). From `LANES_MIN` datasets on (the guesses'
cost grows with the datasets: each step's check takes them all), blend_lanes.py runs many
stretches of the blend side by side, each looking at a few candidate datasets at a time
(0.25-0.65 microsecond per sample up to 254 datasets). The build is sequential by nature
(each pick depends on all earlier ones), which is why a blend's indices are cached where the members' GPT indexes are (blend_cache.py), and why a long build reports its
progress.
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.blend_cache import BlendIndexCache
from megatron.core.datasets.blend_lanes import HEAD_PER_DATASET, blending_lanes
from megatron.core.datasets.index_cache import cache_directories, cache_write_fix, load_npy

# Bump when build_blending_indices' output changes: it is part of the cache key, so caches
# written by an earlier builder are not read.
BLENDING_INDEX_VERSION = 1
# Blends from this size on are cached beside the data without --data-cache-path (with it,
# all are): a smaller one builds in about a second, not worth files in the data directory.
BLEND_CACHE_MIN_SAMPLES = 1_000_000
PROGRESS_INTERVAL_S = 10.0  # at most one progress line this often while a blend is built
# A blend records each sample's dataset in one byte (uint8, as Megatron-LM's helper does).
MAX_BLENDED_DATASETS = 254
Progress = Optional[Callable[[int], None]]  # called with the samples built so far


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
    if len(prefixes) > MAX_BLENDED_DATASETS:  # said before any index is built
        raise ValueError(
            f"data path of {len(prefixes)} 'weight prefix' pairs: at most "
            f"{MAX_BLENDED_DATASETS} datasets can be blended (a blend stores each sample's "
            "dataset in one byte, as Megatron-LM does, which stops on an assertion after "
            "building every index); merge shards of one source into one dataset with "
            "python tools/merge_datasets.py --input SHARD_PREFIXES_OR_DIR --output-prefix OUT, "
            "and give it the sum of their weights")
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


_LOOP_CHUNK = 1 << 16  # samples of the per-sample loop between progress calls


def _blending_loop(weights: np.ndarray, size: int, counts: np.ndarray, start: int,
                   dataset_index: np.ndarray, sample_index: np.ndarray,
                   progress: Progress = None) -> None:
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    num = len(w)
    for begin in range(start, size, _LOOP_CHUNK):
        for s in range(begin, min(size, begin + _LOOP_CHUNK)):
            sd = float(s) if s > 1 else 1.0
            best, best_err = 0, w[0] * sd - c[0]
            for d in range(1, num):
                err = w[d] * sd - c[d]
                if err > best_err:
                    best, best_err = d, err
            dataset_index[s] = best
            sample_index[s] = c[best]
            c[best] += 1
        if progress is not None:
            progress(min(size, begin + _LOOP_CHUNK))


LANES_MIN = 16  # datasets from which the lanes of blend_lanes.py beat guessed blocks
_FLUSH = 1 << 20  # samples of one block of `samples_needed`


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
                         sample_index: np.ndarray, progress: Progress = None) -> None:
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
        if progress is not None:
            progress(s)


_ROTATE_CAP = 1 << 20  # steps x datasets of one block of `_blending_rotations`
_ROTATE_ROUNDS = 64  # repair rounds of one block before its verified part is kept
_ROTATE_SLOW = 128  # a block that keeps fewer samples: the plain loop takes a stretch
_ROTATE_LOOP = 4096  # samples of the plain loop's first stretch


def _guess_picks(weights: np.ndarray, counts: np.ndarray, length: int,
                 level: float) -> np.ndarray:
    """int64 [<= length]: the next picks if each dataset were picked when its deficit reaches
    `level` (the current maximum): dataset d's j-th next at step (c_d + level + j) / w_d."""
    total = float(np.sum(weights[weights > 0]))
    times, owners = [], []
    for d, w in enumerate(weights):
        if w > 0:
            n = int(math.ceil(length * w / total)) + 2
            times.append((counts[d] + level + np.arange(n)) / w)
            owners.append(np.full(n, d, dtype=np.int64))
    order = np.argsort(np.concatenate(times), kind="stable")  # ties: lowest dataset
    return np.concatenate(owners)[order[:length]]


def _true_picks(weights: np.ndarray, steps: np.ndarray, before: np.ndarray) -> np.ndarray:
    """The greedy's pick at each of `steps` (float64 max(s, 1)) given the counts `before`
    [steps, datasets] (exact integers in float64): the same float64 differences as
    `_blending_loop`'s, and argmax returns the first maximum (ties: lowest dataset)."""
    err = np.multiply.outer(steps, weights)
    err -= before
    return err.argmax(axis=1)


def _repairs(guess: np.ndarray, truth: np.ndarray,
             wrong: np.ndarray) -> Tuple[np.ndarray, np.ndarray, int]:
    """Disjoint regions (starts i, ends p): wrong step i's true pick is the guess's next
    pick of that dataset, at p. Third: the first wrong step whose true pick the guess has no
    later (-1: none); no region from there on."""
    block = len(guess)
    order = np.argsort(guess.astype(np.uint8), kind="stable")  # each dataset's in order
    keys = guess[order] * block + order
    want = truth[wrong]
    found = np.searchsorted(keys, want * block + wrong, side="right")
    ends = order[np.minimum(found, block - 1)]
    missing = np.flatnonzero((guess[ends] != want) | (ends <= wrong))
    stop = len(wrong) if len(missing) == 0 else int(missing[0])
    starts, ends = wrong[:stop], ends[:stop]
    if stop > 1:  # a region starting inside an earlier one waits for the next round
        keep = np.ones(stop, dtype=bool)
        keep[1:] = starts[1:] > np.maximum.accumulate(ends)[:-1]
        starts, ends = starts[keep], ends[keep]
    return starts, ends, (-1 if stop == len(wrong) else int(wrong[stop]))


def _rotate(guess: np.ndarray, before: np.ndarray, steps: np.ndarray, weights: np.ndarray,
            truth: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The guess with each region's last pick moved to its start (the others one step on);
    `before` and `truth` updated on the regions' steps (the counts elsewhere are the same)."""
    block = len(guess)
    depth = np.cumsum(np.bincount(starts + 1, minlength=block + 1)[:block]
                      - np.bincount(ends + 1, minlength=block + 1)[:block])
    inside = np.flatnonzero(depth)  # steps i+1..p of each region
    moved = guess[ends][np.searchsorted(starts, inside) - 1]
    before[inside, moved] += 1.0
    before[inside, guess[inside - 1]] -= 1.0
    new = guess.copy()
    new[inside] = guess[inside - 1]
    new[starts] = guess[ends]
    truth[inside] = _true_picks(weights, steps[inside], before[inside])  # only counts moved
    return new


def _rotation_block(weights: np.ndarray, counts: np.ndarray, start: int,
                    block: int) -> Tuple[np.ndarray, np.ndarray]:
    """(picks, counts before each) of the greedy's next steps from `start`: all of a guessed
    `block` once repaired, else the part verified within `_ROTATE_ROUNDS` rounds."""
    level = float(np.max(weights * max(start, 1) - counts))
    guess = _guess_picks(weights, counts, block, level)
    block = len(guess)
    before = np.zeros((block, len(weights)), dtype=np.float64)
    before[0] = counts
    before[np.arange(1, block), guess[:-1]] += 1.0
    np.cumsum(before, axis=0, out=before)
    steps = np.maximum(np.arange(start, start + block), 1).astype(np.float64)
    truth = _true_picks(weights, steps, before)
    for rnd in range(_ROTATE_ROUNDS):
        wrong = np.flatnonzero(truth != guess)
        if len(wrong) == 0:
            return guess, before
        first = int(wrong[0])  # every step before it is the greedy's
        starts, ends, missing = _repairs(guess, truth, wrong)
        if missing == first or rnd == _ROTATE_ROUNDS - 1:
            guess[first] = truth[first]
            return guess[:first + 1], before[:first + 1]
        guess = _rotate(guess, before, steps, weights, truth, starts, ends)
    raise AssertionError("unreachable")


def _blending_rotations(weights: np.ndarray, size: int, dataset_index: np.ndarray,
                        sample_index: np.ndarray, progress: Progress = None,
                        clock: Callable[[], float] = time.perf_counter) -> None:
    """The greedy in guessed and repaired blocks (module docstring), and stretches of
    `_blending_loop` (the first `_ROTATE_LOOP` samples, timing it) wherever a block comes
    out slower per sample than the loop or keeps under `_ROTATE_SLOW` samples: guesses some
    weights keep failing (a dominant one, powers of two) cost more than the loop does. Each
    stretch in a row is twice the last, so such blends lose little to the blocks tried."""
    num = len(weights)
    counts = np.zeros(num, dtype=np.int64)
    first = min(1024, _LOOP_CHUNK)
    cap = min(max(first, _ROTATE_CAP // num), _LOOP_CHUNK)  # samples between progress calls
    s, block, stretch, loop_rate = 0, first, _ROTATE_LOOP, math.inf
    slow = True
    while s < size:
        if slow or not np.any(weights > 0):  # nothing to guess from without a weight
            stop = min(size, s + stretch)
            start = clock()
            _blending_loop(weights, stop, counts, s, dataset_index, sample_index, progress)
            loop_rate = (clock() - start) / (stop - s)
            counts += np.bincount(dataset_index[s:stop], minlength=num)
            s, stretch = stop, min(stretch * 2, 1 << 20)
            slow = False
            continue
        asked, start = min(block, size - s), clock()
        picks, before = _rotation_block(weights, counts, s, asked)
        good = len(picks)
        dataset_index[s:s + good] = picks
        sample_index[s:s + good] = before[np.arange(good), picks]
        counts += np.bincount(picks, minlength=num)
        s += good
        block = min(block * 2, cap) if good == asked else max(1, block // 2)
        slow = good < min(asked, _ROTATE_SLOW) or (clock() - start) / good > loop_rate
        if not slow:
            stretch = _ROTATE_LOOP
        if progress is not None:
            progress(s)

def build_blending_indices(weights: Sequence[float], size: int,
                           progress: Progress = None) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index uint8 [size], dataset_sample_index int64 [size]) of Megatron's greedy.
    `progress(done)` is called every block of samples built (at most about a second
    apart at a microsecond per sample)."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) > MAX_BLENDED_DATASETS:
        raise ValueError(f"at most {MAX_BLENDED_DATASETS} blended datasets are supported, got "
                         f"{len(weights)}")
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    if len(weights) == 1:
        sample_index[:] = np.arange(size)
    elif len(weights) == 2:
        _blending_vectorised(weights, size, dataset_index, sample_index, progress)
    elif len(weights) >= LANES_MIN:
        head = size if np.sum(weights) <= 0 else min(size, HEAD_PER_DATASET * len(weights))
        _blending_loop(weights, head, np.zeros(len(weights), dtype=np.int64), 0,
                       dataset_index, sample_index, progress)
        blending_lanes(weights, size, dataset_index, sample_index, head, progress)
    else:
        _blending_rotations(weights, size, dataset_index, sample_index, progress)
    return dataset_index, sample_index


class ProgressLine:
    """A `progress` for `build_blending_indices` that gives `log` one line at most every
    `interval_s` seconds: samples built of all, the rate and the time left."""

    def __init__(self, log: Callable[[str], None], size: int,
                 interval_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.size, self.clock = log, size, clock
        self.interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
        self.start = self.last = clock()

    def __call__(self, done: int) -> None:
        now = self.clock()
        if now - self.last < self.interval_s or done >= self.size:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        left = (self.size - done) / max(rate, 1e-9)
        self.log(f"    blending indices: {done} of {self.size} samples "
                 f"({100.0 * done / self.size:.0f}%), {rate / 1e6:.2f} M samples/s, about "
                 f"{left:.0f} s left")


def estimated_build_s(num_datasets: int, size: int) -> float:
    """A generous estimate of the seconds `build_blending_indices` takes (a busy CPU)."""
    if num_datasets <= 1:
        return 0.0
    return size * (0.3e-6 if num_datasets == 2 else 2e-6)


def normalised_weights(weights: Sequence[float]) -> np.ndarray:
    """float64 weights divided by their sum, as the blend uses them."""
    weights = np.array(weights, dtype=np.float64)
    if weights.sum() <= 0:
        raise ValueError(f"blending weights {weights} must have a positive sum")
    return weights / weights.sum()


def blend_index_cache(directories: Sequence[str], weights: Sequence[float],
                      size: int) -> BlendIndexCache:
    """The cache of the blend of `size` samples over `weights` (normalised here) in
    `directories` (read in order, written to the last)."""
    return BlendIndexCache(directories, normalised_weights(weights), size,
                           BLENDING_INDEX_VERSION)


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


class BlendPlan:
    """Which blends of a run are cached where (`cache`), and which of them the builder
    rank builds before the barrier while the others wait (`before_barrier`)."""

    def __init__(self, cache_dir: Optional[str], may_build: bool,
                 log: Optional[Callable[[str], None]] = None,
                 budget_s: Optional[float] = None):
        """`budget_s`: seconds of building the other ranks may wait for in all (None: any)."""
        self.cache_dir, self.may_build, self.log = cache_dir, may_build, log
        self.budget_s = budget_s
        self._unwritable: set = set()  # cache directories found unwritable

    def cache(self, first_prefix: str, weights: Sequence[float],
              size: int) -> Optional[BlendIndexCache]:
        """The blend's index cache (None: kept in memory), in the directories of its first
        member's GPT index (`cache_directories`). Without a cache dir a blend under
        BLEND_CACHE_MIN_SAMPLES is not cached (it builds in about a second). The builder
        rank tries a write first: where none can be written it warns once, and every rank
        builds the blends in memory."""
        if size == 0 or (size < BLEND_CACHE_MIN_SAMPLES and not self.cache_dir):
            return None
        cache = blend_index_cache(cache_directories(first_prefix, self.cache_dir), weights, size)
        if not self.may_build:  # reads the builder's set, or builds in memory as it did
            return cache
        if cache.directory in self._unwritable:
            return None
        why = None if cache.present() else cache.unwritable()
        if why is None:
            return cache
        warnings.warn(f"cannot write the blending index cache to {cache.directory} ({why}): "
                      "the blends are built again at every start, on every rank; "
                      f"{cache_write_fix(why, cache.nbytes())} to keep them", stacklevel=2)
        self._unwritable.add(cache.directory)
        return None

    def before_barrier(self, cache: Optional[BlendIndexCache], num_datasets: int,
                       what: str) -> bool:
        """Whether the builder rank builds this blend before the barrier, the others
        waiting to read it: a cached one whose (estimated) build fits what is left of
        `budget_s`. A longer one is built by every rank after the barrier (the others
        would time out waiting), the builder writing it for later runs."""
        if cache is None:
            return False
        if self.budget_s is None or cache.present():
            return True
        cost = estimated_build_s(num_datasets, cache.size)
        if cost <= self.budget_s:
            self.budget_s -= cost
            return True
        if self.log is not None:
            self.log(f" > {what}: about {cost:.0f} s to blend {cache.size} samples, longer than "
                     "the other ranks may wait (half of --distributed-timeout-minutes): every "
                     "rank builds them after the barrier; global rank 0 writes them to "
                     f"{cache.directory} for later runs")
        return False


class BlendedDataset:
    """Samples of several datasets interleaved by weight; items carry `dataset_idx`."""

    def __init__(self, datasets: List, weights: Sequence[float], size: int,
                 cache: Optional[BlendIndexCache] = None, may_build: bool = True,
                 on_build: Optional[Callable[[], None]] = None,
                 log: Optional[Callable[[str], None]] = None):
        """With `cache` (`blend_index_cache` of these weights and size) the indices are
        read from it, or built and (when `may_build`) written to it; a cache that cannot
        be written is warned about and the indices kept in memory. Without, they are
        built and kept in memory. `on_build` is called before the indices are built (not
        when a cache is read); `build_s` is then the seconds the build took, else None.
        `log` receives a progress line at most every PROGRESS_INTERVAL_S of a build."""
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.size = int(size)
        self.weights = weights = normalised_weights(weights)
        desc = "Blendable dataset\n\nDatasets:\n"
        for dataset in datasets:
            desc += dataset.desc + "\n\n"
        desc += f"Weights: {weights}\n"
        desc += f"Size: {size}\n"
        self.desc = desc
        self.build_s: Optional[float] = None
        self.cache_paths: Optional[Dict[str, str]] = None  # the cache set read or written
        self._on_build, self._log = on_build, log
        if cache is not None:
            self.dataset_index, self.dataset_sample_index = self._cached(cache, may_build)
        else:
            self.dataset_index, self.dataset_sample_index = self._build()
        self._check_members()

    def _build(self) -> Tuple[np.ndarray, np.ndarray]:
        if self._on_build is not None:
            self._on_build()
        start = time.time()
        progress = ProgressLine(self._log, self.size) if self._log is not None else None
        arrays = build_blending_indices(self.weights, self.size, progress)
        self.build_s = time.time() - start
        return arrays

    def _cached(self, cache: BlendIndexCache, may_build: bool) -> Tuple[np.ndarray, np.ndarray]:
        assert cache.size == self.size and np.array_equal(cache.weights, self.weights)
        found = cache.find()
        if found is None:
            arrays = self._build()
            if not may_build:  # the builder rank could not write it: built like it
                return arrays
            try:
                paths = cache.save(arrays)
            except OSError as e:
                warnings.warn(f"cannot write the blending index cache to {cache.directory} "
                              f"({e}): its {self.size} samples are built again at every start; "
                              f"{cache_write_fix(e, cache.nbytes())} to keep them", stacklevel=3)
                return arrays
            loaded = cache.load(paths)  # memory-mapped: the built copy is freed
            if loaded is None:
                return arrays
            found = paths, loaded
        self.cache_paths, arrays = found
        return arrays

    def __getstate__(self) -> dict:  # pickled for spawned loader workers: map the files again
        state = dict(self.__dict__, _on_build=None, _log=None)
        if self.cache_paths is not None:
            del state["dataset_index"], state["dataset_sample_index"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "dataset_index" not in state:
            listing = ", ".join(self.cache_paths.values())
            self.dataset_index = load_npy(self.cache_paths["index"], listing)
            self.dataset_sample_index = load_npy(self.cache_paths["sample_index"], listing)

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
