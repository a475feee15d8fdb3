"""The GPT dataset over Megatron `.bin/.idx` data (`GPTDataset`: samples through the index
of gpt_index.py) and the train/valid/test builder over single or blended prefixes."""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.core.datasets.blended import BlendPlan
from megatron.core.datasets.gpt_index import (
    BUILD_LOG_MIN_ENTRIES,
    IndexBuildLog,
    build_index_arrays,
    describe,
    index_mismatch,
)
from megatron.core.datasets.index_cache import (
    MissingIndexCacheError,
    StaleIndexCacheError,
    find_or_build_cache,
    load_arrays,
    stale_caches_error,
)
from megatron.core.datasets.indexed_dataset import (
    MMapIndexedDataset,
    check_token_ids,
    needs_id_scan,
)
from megatron.core.datasets.splits import get_train_valid_test_split, split_with_documents


class BadTokenError(ValueError):
    """A sample read holds a token id outside the model's padded vocabulary."""


class GPTDataset:
    """Samples of `seq_length + 1` tokens from the `documents` of `indexed_dataset`."""

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray,
                 indexed_dataset: MMapIndexedDataset, num_samples: int, seq_length: int,
                 seed: int, split_string: str, cache_dir: Optional[str] = None,
                 may_build: bool = True, vocab_size: Optional[int] = None,
                 on_build: Optional[Callable[[], None]] = None,
                 log: Optional[Callable[[str], None]] = None):
        """`on_build` is called before the index is built (not when a cache is used);
        `index_build_s` is then the seconds the build took, else None. `log` receives
        the lines of a large build (`IndexBuildLog`)."""
        documents = np.asarray(documents, dtype=np.int32)
        n_seq = len(indexed_dataset.sizes)
        if n_seq == 0:
            raise ValueError(f"{data_prefix}: holds no non-empty documents (0 sequences); "
                             "preprocess text that is not empty (check --json-keys)")
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= n_seq:
            raise ValueError(f"{data_prefix}: documents must be a non-empty subset of "
                             f"[0, {n_seq})")
        self.name = name
        self.data_prefix = data_prefix
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.desc = describe(data_prefix, name, num_samples, seq_length, seed, split_string)
        self.desc_hash = hashlib.md5(self.desc.encode("utf-8")).hexdigest()
        # The .idx puts sizes at byte 34, so the mapped array is unaligned and numpy gathers
        # from it 2-3x slower: building and checking gather it once per doc_idx entry (over
        # 100M times at scale). An aligned copy costs 4 bytes a sequence, for this call only.
        sizes = np.require(indexed_dataset.sizes, requirements="A")
        self.num_samples = num_samples  # as asked: with `tokens_per_epoch`, its `index_layout`
        self.tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
        what = (f"the {name} dataset of {data_prefix} (documents {documents.min()}.."
                f"{documents.max()})")
        if self.tokens_per_epoch == 0:
            raise ValueError(f"{what}: all its documents are empty (0 tokens); preprocess "
                             "non-empty text or adjust --split")

        self.index_build_s = None

        def build():
            if on_build is not None:
                on_build()
            progress = None
            if log is not None:
                shown = "validation" if name == "valid" else name
                progress = IndexBuildLog(log, f"the {shown} dataset of {data_prefix}",
                                         len(documents), self.tokens_per_epoch, num_samples,
                                         seq_length)
                if progress.entries + progress.rows < BUILD_LOG_MIN_ENTRIES:
                    progress = None
                else:
                    progress.announce()
            start = time.time()
            arrays = build_index_arrays(documents, sizes, num_samples, seq_length, seed,
                                        progress)
            self.index_build_s = time.time() - start
            return arrays

        def check(arrays):
            return index_mismatch(arrays, documents, sizes, num_samples, seq_length)

        self.cache_paths, arrays = find_or_build_cache(self.desc, data_prefix, cache_dir, build,
                                                       may_build, check, what)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def _load(self) -> None:
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_arrays(self.cache_paths)

    def __getstate__(self) -> dict:  # pickled for spawned loader workers: reload the maps
        return {k: v for k, v in self.__dict__.items()
                if k not in ("doc_idx", "sample_idx", "shuffle_idx")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load()

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} outside [0, {len(self)}) of {self.name} dataset")
        j = int(self.shuffle_idx[idx])
        doc_f, off_f = (int(v) for v in self.sample_idx[j])
        doc_l, off_l = (int(v) for v in self.sample_idx[j + 1])
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            parts = [get(int(self.doc_idx[doc_f]), offset=off_f, length=off_l - off_f + 1)]
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset=off_f)]
            parts += [get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l)]
            parts.append(get(int(self.doc_idx[doc_l]), length=off_l + 1))
        text = np.concatenate(parts).astype(np.int64)
        if self.vocab_size is not None and (text.max() >= self.vocab_size or text.min() < 0):
            self._bad_token(idx, text, doc_f, doc_l)
        return {"text": text}

    def _bad_token(self, idx: int, text: np.ndarray, doc_f: int, doc_l: int) -> None:
        """BadTokenError for sample `idx` holding an id outside [0, vocab_size): the opening
        check samples only part of each `.bin`, and such an id would index past the
        embedding (a CUDA device-side assert, or with tensor parallelism a silent zero row)."""
        bad = int(text.max()) if text.max() >= self.vocab_size else int(text.min())
        docs = sorted({int(self.doc_idx[d]) for d in range(doc_f, doc_l + 1)})
        raise BadTokenError(
            f"{self.data_prefix}.bin: token id {bad} in sample {idx} of the {self.name} dataset "
            f"(sequence(s) {', '.join(map(str, docs))}) is outside the padded vocabulary of "
            f"{self.vocab_size} ids: the data was tokenized with another vocabulary than this "
            "run's. Pass the --tokenizer-type and --vocab-file (or --vocab-size) it was "
            "preprocessed with")


class _Builder:
    """Opens each prefix once and builds single or blended datasets (each dataset once: a
    second pass reuses them). With `defer_blends`, blends that `blend_plan` keeps from
    before the barrier (in memory, or too long to wait for) are left out (None): every rank
    builds its own, and the builder rank builds them in a second pass after the barrier,
    beside the others rather than before them."""

    def __init__(self, split: str, seq_length: int, seed: int, cache_dir: Optional[str],
                 may_build: bool, vocab_size: Optional[int] = None,
                 log: Optional[Callable[[str], None]] = None,
                 tokenizer_vocab_size: Optional[int] = None, others_wait: bool = False):
        self.split, self.seq_length, self.seed = split, seq_length, seed
        self.cache_dir, self.may_build = cache_dir, may_build
        self.vocab_size, self.log = vocab_size, log
        self.others_wait, self._announced = others_wait, False
        self.defer_blends = False
        self.skip_splits: frozenset = frozenset()  # split names not built (None)
        self.blend_plan = BlendPlan(cache_dir, may_build, log)
        self._datasets: Dict[tuple, GPTDataset] = {}
        self._blends: Dict[tuple, object] = {}
        self._split_logged: set = set()
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self._opened: Dict[str, MMapIndexedDataset] = {}
        # prefix -> token_id_range of its .bin: filled by the scans, or given (another rank's)
        self.token_ranges: Dict[str, Tuple[int, int, int]] = {}
        # datasets whose index cache is stale: collected, raised together by `_build_all`
        self.stale: List[StaleIndexCacheError] = []

    def indexed(self, prefix: str) -> MMapIndexedDataset:
        """The dataset at `prefix`, opened once; its ids checked against `vocab_size` (its
        `.bin` scanned unless `token_ranges` has its range)."""
        if prefix not in self._opened:
            dataset = MMapIndexedDataset(prefix)
            if self.vocab_size is not None:
                if prefix not in self.token_ranges and needs_id_scan(
                        dataset.dtype, self.vocab_size, self.tokenizer_vocab_size):
                    self.token_ranges[prefix] = dataset.token_id_range()  # kept if it fails
                check_token_ids(dataset, self.vocab_size,
                                tokenizer_vocab_size=self.tokenizer_vocab_size,
                                id_range=self.token_ranges.get(prefix))
            self._opened[prefix] = dataset
        return self._opened[prefix]

    def _announce_build(self) -> None:
        """Say once, before the first index is built, that this rank builds (and that the
        others wait: they print nothing until it is done)."""
        if self.log is not None and not self._announced:
            waiting = "; the other ranks wait for it" if self.others_wait else ""
            self.log(f" > building the missing dataset indices on global rank 0{waiting} ...")
        self._announced = True

    def dataset(self, name: str, prefix: str, documents: np.ndarray, num_samples: int):
        """The GPTDataset, or None when its index cache is stale (kept in `self.stale`).
        After a stale one, the caches of the others are only looked at (and checked), none
        is built: the run stops, with every stale cache named (`_build_all`)."""
        key = (name, prefix, int(documents[0]) if len(documents) else -1, len(documents),
               num_samples)
        if key in self._datasets:
            return self._datasets[key]
        checking_only = bool(self.stale)
        try:
            ds = GPTDataset(name, prefix, documents, self.indexed(prefix), num_samples,
                            self.seq_length, self.seed, self.split, self.cache_dir,
                            self.may_build and not checking_only, self.vocab_size,
                            on_build=self._announce_build, log=self.log)
        except StaleIndexCacheError as e:
            self.stale.append(e)
            return None
        except MissingIndexCacheError:
            if checking_only:
                return None
            raise
        if self.log is not None:  # how often the documents repeat: an epoch count
            epochs = len(ds.doc_idx) // max(len(documents), 1)
            shown = "validation" if name == "valid" else name
            where = os.path.dirname(ds.cache_paths["desc"])
            index = (f"index built into {where} in {ds.index_build_s:.2f} s"
                     if ds.index_build_s is not None else f"index read from {where}")
            self.log(f"    {shown} dataset of {prefix}: {len(ds)} samples of {self.seq_length} "
                     f"tokens, {epochs} epoch(s) over {len(documents)} documents ({index})")
        self._datasets[key] = ds
        return ds

    def split_datasets(self, prefix: str, num_samples: Sequence[int]) -> list:
        """train/valid/test GPTDatasets over the split ranges of one prefix (None if empty)."""
        bounds = get_train_valid_test_split(self.split, len(self.indexed(prefix).sizes))
        if self.log is not None and prefix not in self._split_logged:
            self._split_logged.add(prefix)
            self.log(f" > dataset split of {prefix} ({bounds[3]} documents, --split "
                     f"{self.split!r}):")
            for i, name in enumerate(("train", "validation", "test")):
                self.log(f"    {name}: document indices in [{bounds[i]}, {bounds[i + 1]}) total "
                         f"of {bounds[i + 1] - bounds[i]} documents")
        out = []
        for i, name in enumerate(("train", "valid", "test")):
            if bounds[i + 1] > bounds[i] and name not in self.skip_splits:
                documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int32)
                out.append(self.dataset(name, prefix, documents, num_samples[i]))
            else:
                out.append(None)
        return out

    def blend(self, datasets: list, weights: Sequence[float], size: int, what: str):
        from megatron.core.datasets.blended import BlendedDataset

        if any(d is None for d in datasets) and self.stale:
            return None  # a member's cache is stale: `_build_all` raises that
        if any(d is None for d in datasets):  # (check_splits found it first)
            raise ValueError(f"{what}: a blended dataset has no document in this split")
        if (what, size) in self._blends:
            return self._blends[(what, size)]
        cache = self.blend_plan.cache(datasets[0].data_prefix, weights, size)
        if self.defer_blends and not self.blend_plan.before_barrier(cache, len(datasets),
                                                                    what):
            return None

        def announce():
            if self.log is not None:  # Megatron-LM's line, then what it is building
                self.log(f"> building indices for blendable datasets ... ({what}: "
                         f"{len(datasets)} datasets, {size} samples)")

        blend = BlendedDataset(datasets, weights, size, cache, self.may_build,
                               on_build=announce, log=self.log)
        if self.log is not None:
            self.log(f" > blended dataset for {what}: {size} samples; sample ratios:")
            for d, (w, achieved) in enumerate(zip(blend.weights, blend.achieved_weights())):
                self.log(f"   dataset {d}, input: {w:g}, achieved: {achieved:g}")
            if blend.build_s is not None:
                self.log(f"> elapsed time for building blendable dataset indices: "
                         f"{blend.build_s:.2f} (sec)")
            if blend.cache_paths is not None:
                done = "written to" if blend.build_s is not None else "read from"
                files = blend.cache_paths["key"][:-len(".dsc")]
                self.log(f" > blendable dataset indices {done} "
                         f"{files}{{.dsc,_index.npy,_sample_index.npy}}")
        self._blends[(what, size)] = blend
        return blend

    def whole(self, name: str, data_path: Sequence[str], num_samples: int):
        """One dataset using all documents of `data_path` (one prefix or a weighted list)."""
        from megatron.core.datasets.blended import parse_weighted_prefixes, per_dataset_num_samples

        prefixes, weights = parse_weighted_prefixes(data_path)
        if len(data_path) == 1:
            n_seq = len(self.indexed(prefixes[0]).sizes)
            return self.dataset(name, prefixes[0], np.arange(n_seq, dtype=np.int32), num_samples)
        counts = per_dataset_num_samples(num_samples, weights)
        members = [self.dataset(name, p, np.arange(len(self.indexed(p).sizes), dtype=np.int32), c)
                   for p, c in zip(prefixes, counts)]
        return self.blend(members, weights, sum(counts), f"--{name}-data-path")


def _check_train_data(builder: _Builder, data_prefix, train_path, num_train: int) -> None:
    """When training asks for samples, stop before any index is built if the train split
    would have no documents, naming the paths, their document counts and the fix."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    if num_train <= 0:
        return
    if not data_prefix and train_path is None:
        raise ValueError(f"training asks for {num_train} samples but no train data is given "
                         "(--valid-data-path/--test-data-path without --train-data-path); pass "
                         "--train-data-path or --data-path, or --skip-train to only evaluate")
    prefixes = parse_weighted_prefixes(data_prefix or train_path)[0]
    counts = {p: len(builder.indexed(p).sizes) for p in prefixes}
    listing = ", ".join(f"{p}: {n} documents" for p, n in counts.items())
    if not any(counts.values()):
        raise ValueError(f"no non-empty documents to train on ({listing}); preprocess text that "
                         "is not empty (check --json-keys)")
    if data_prefix:
        bounds = [get_train_valid_test_split(builder.split, n) for n in counts.values()]
        if all(b[1] == b[0] for b in bounds):
            raise ValueError(f"--split {builder.split!r} gives the train split no documents "
                             f"({listing}); give train a positive share, e.g. --split "
                             "969,30,1, or pass --skip-train to only evaluate")


def _check_split_bounds(builder: _Builder, data_prefix) -> None:
    """--split cuts every --data-path prefix (`get_train_valid_test_split` raises its
    ValueError), checked whatever the run reads: a run that only evaluates cuts them too."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    for prefix in parse_weighted_prefixes(data_prefix)[0] if data_prefix else []:
        get_train_valid_test_split(builder.split, len(builder.indexed(prefix).sizes))


def _check_blend_splits(builder: _Builder, data_prefix, num_samples) -> None:
    """A --data-path blend needs every weighted dataset in each split the run reads (n_k >
    0: a split asked for no samples is not blended): name each dataset --split leaves
    without a document there. Megatron-LM stops on an assertion when it blends such a
    split. Reads the indexes' sizes only; nothing is built."""
    from megatron.core.datasets.blended import parse_weighted_prefixes

    if not data_prefix or len(data_prefix) == 1:
        return
    prefixes = parse_weighted_prefixes(data_prefix)[0]
    docs = {p: len(builder.indexed(p).sizes) for p in prefixes}
    hollow = [p for p in prefixes if docs[p] == 0]
    if hollow and len(hollow) < len(prefixes) and any(n > 0 for n in num_samples):
        verb = "holds" if len(hollow) == 1 else "hold"
        raise ValueError(f"--data-path: {', '.join(hollow)} {verb}"
                         " no non-empty document (0 sequences in the .idx), so no --split can "
                         "give the blend its weight there; leave it out of --data-path, or "
                         "preprocess it again from input with text under --json-keys")
    bounds = {p: get_train_valid_test_split(builder.split, n) for p, n in docs.items()}
    for k, name in enumerate(("train", "valid", "test")):
        empty = [p for p in prefixes if bounds[p][k + 1] == bounds[p][k]]
        if num_samples[k] > 0 and empty and len(empty) < len(prefixes):
            listing = ", ".join(f"{p} ({docs[p]} documents)" for p in empty)
            raise ValueError(f"--data-path ({name}): --split {builder.split!r} leaves this split "
                             f"no documents of {listing}, so the blend cannot give it its "
                             "weight (Megatron-LM stops here too); raise that share of --split "
                             "until every weighted dataset gets a document"
                             f"{_blend_split_example(builder.split, docs, num_samples, k)}, "
                             "or leave the small dataset out of --data-path")


def _blend_split_example(split: str, docs: Dict[str, int], num_samples, k: int) -> str:
    """` (e.g. --split ...)`: a --split giving every dataset of the blend a document in each
    of validation and test the run reads (`split_with_documents`), for an empty validation
    or test split (k 1 or 2); "" where there is none."""
    fix = None
    if k > 0 and min(docs.values()) >= 2:
        fix = split_with_documents(split, sorted(set(docs.values())),
                                   valid=num_samples[1] > 0, test=num_samples[2] > 0)
    return f" (e.g. --split {fix})" if fix else ""


def check_splits(data_prefix: Optional[Sequence[str]], split: str,
                 train_valid_test_num_samples: Sequence[int],
                 train_data_path: Optional[Sequence[str]] = None) -> None:
    """The document checks the dataset builder makes before it builds anything (ValueError
    with its message): --split cuts every --data-path prefix, a run that trains has train
    documents, a --data-path blend has documents of every weighted dataset in each split
    it reads. For `--dry-run`: opens the indexes only."""
    builder = _Builder(split, 1, 1, None, False)
    num_samples = [int(n) for n in train_valid_test_num_samples]
    _check_split_bounds(builder, data_prefix)
    _check_train_data(builder, data_prefix, train_data_path, num_samples[0])
    _check_blend_splits(builder, data_prefix, num_samples)


def _build_all(builder: _Builder, data_prefix, num_samples, paths) -> tuple:
    """The three datasets; one error naming every dataset whose index cache is stale."""
    datasets = _build_datasets(builder, data_prefix, num_samples, paths)
    if builder.stale:
        raise stale_caches_error(builder.stale)
    return datasets


def _build_datasets(builder: _Builder, data_prefix, num_samples, paths) -> tuple:
    from megatron.core.datasets.blended import parse_weighted_prefixes, per_dataset_num_samples

    _check_split_bounds(builder, data_prefix)
    _check_train_data(builder, data_prefix, paths[0], num_samples[0])
    _check_blend_splits(builder, data_prefix, num_samples)
    if data_prefix:
        prefixes, weights = parse_weighted_prefixes(data_prefix)
        if len(data_prefix) == 1:
            return tuple(builder.split_datasets(prefixes[0], num_samples))
        per = [per_dataset_num_samples(n, weights) for n in num_samples]  # [split][dataset]
        members = [builder.split_datasets(p, [per[k][i] for k in range(3)])
                   for i, p in enumerate(prefixes)]
        out = []
        for k, name in enumerate(("train", "valid", "test")):
            parts = [m[k] for m in members]
            # a split the run never reads (no evaluation: 0 samples) need not blend
            unread = name in builder.skip_splits or (
                num_samples[k] == 0 and any(p is None for p in parts))
            out.append(None if unread or all(p is None for p in parts) else
                       builder.blend(parts, weights, sum(per[k]), f"--data-path ({name})"))
        return tuple(out)
    return tuple(None if path is None or name in builder.skip_splits
                 else builder.whole(name, path, num_samples[k])
                 for k, (name, path) in enumerate(zip(("train", "valid", "test"), paths)))


def build_train_valid_test_datasets(data_prefix: Optional[Sequence[str]], split: str,
                                    train_valid_test_num_samples: Sequence[int],
                                    seq_length: int, seed: int, cache_dir: Optional[str] = None,
                                    train_data_path: Optional[Sequence[str]] = None,
                                    valid_data_path: Optional[Sequence[str]] = None,
                                    test_data_path: Optional[Sequence[str]] = None, *,
                                    is_builder_rank: bool = True,
                                    barrier: Optional[Callable[[], None]] = None,
                                    vocab_size: Optional[int] = None,
                                    log: Optional[Callable[[str], None]] = None,
                                    tokenizer_vocab_size: Optional[int] = None,
                                    barrier_timeout_s: Optional[float] = None,
                                    share: Optional[Callable[[Any], Any]] = None,
                                    skip_splits: Sequence[str] = ()) -> tuple:
    """(train, valid, test) datasets, each GPTDataset, BlendedDataset or None.

    `data_prefix` is `--data-path`: one prefix (split by `split`) or `w1 p1 w2 p2 ...`
    (each prefix split alike; member i of split k asks ceil(n_k * w_i * 1.005) samples).
    Without it, `--train/valid/test-data-path` each use all documents of their files.

    Multi-process use: every rank calls this with the same arguments; the builder rank
    (global rank 0) builds missing cache files first, then all ranks meet in `barrier()`
    (e.g. `torch.distributed.barrier`; one call per rank), then the others load the files.
    A non-builder rank that finds a GPT index file missing raises ValueError. A blend's
    indices are cached beside the first member's GPT index (`blended.BlendPlan`); one
    kept in memory (small, or its cache unwritable) is built by every rank after the barrier,
    and so is one whose build would take more than half of `barrier_timeout_s` (how long
    `barrier()` waits; those blends together), the builder rank writing it for later runs.

    `vocab_size` (the model's padded vocabulary) has every opened `.bin` checked for ids
    outside it (`check_token_ids`: a bounded sample), and every sample read (a ValueError
    naming the file and the sequences, instead of an embedding lookup past the table).
    `tokenizer_vocab_size` (the run's tokenizer's, unpadded): a sampled id in the padding
    rows past it is warned (data made with another tokenizer). `share(value)` (with
    `barrier`; collective, e.g. a broadcast from global rank 0) returns the builder rank's
    `value` on every rank: it hands the others the id ranges the builder sampled, so that
    each `.bin` is scanned once per run, not once per rank, and every rank reaches the
    same verdict. `log` (e.g. a rank-0 print) receives,
    on the builder rank, each blend's requested and achieved ratios. With `train` samples
    asked for (n_train > 0) a train split without documents is an error. `skip_splits`
    (names of "train", "valid", "test"): splits the run never reads, left None with no
    index built (their --split document ranges are still checked and printed).
    """
    if not data_prefix and not any((train_data_path, valid_data_path, test_data_path)):
        raise ValueError("no data: pass --data-path, or --train-data-path/--valid-data-path/"
                         "--test-data-path (or --mock-data)")
    num_samples = [int(n) for n in train_valid_test_num_samples]
    paths = (train_data_path, valid_data_path, test_data_path)
    result, error, builder = None, None, None
    if is_builder_rank:
        builder = _Builder(split, seq_length, seed, cache_dir, True, vocab_size, log,
                           tokenizer_vocab_size, others_wait=barrier is not None)
        builder.defer_blends = barrier is not None  # in-memory blends: built by all at once
        builder.skip_splits = frozenset(skip_splits)
        if barrier_timeout_s is not None:
            builder.blend_plan.budget_s = barrier_timeout_s / 2
        try:
            result = _build_all(builder, data_prefix, num_samples, paths)
        except Exception as e:  # reach the barrier anyway so the other ranks do not hang
            error = e
    if barrier is not None:
        barrier()
    token_ranges = builder.token_ranges if builder is not None else {}
    if share is not None:
        token_ranges = share(token_ranges)
    if error is not None:
        raise error
    if builder is not None and builder.defer_blends:
        builder.defer_blends = False
        result = _build_all(builder, data_prefix, num_samples, paths)
    if result is None:
        builder = _Builder(split, seq_length, seed, cache_dir, False, vocab_size)
        builder.skip_splits = frozenset(skip_splits)
        builder.token_ranges.update(token_ranges or {})
        result = _build_all(builder, data_prefix, num_samples, paths)
    return result
