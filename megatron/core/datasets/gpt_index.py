"""GPT samples over Megatron `.bin/.idx` data, with Megatron 23.05's sample order.

For a document set (sequence ids of the split), `T` tokens per epoch, sequence length `S`
and `n` requested samples:

* epochs `E` = smallest E >= 1 with (E*T - 1) // S >= n;
* one `np.random.RandomState(seed)` shuffles, in this order, the document order
  (`doc_idx`: documents repeated E times; when the last epoch would contribute fewer than
  80% of an epoch's samples it is shuffled separately from the first E-1 epochs) and then
  the sample order (`shuffle_idx`; split the same way);
* `sample_idx[i] = (position in doc_idx, token offset)` where sample i starts (int32;
  int64 past 2**31 doc_idx entries); sample i covers S+1 tokens, sharing its last token
  with sample i+1.

The three arrays are cached as `.npy` files named by the md5 of the dataset description
(`<H>.dsc`, `<H>_doc_idx.npy`, `<H>_sample_idx.npy`, `<H>_shuffle_idx.npy`), looked up in
`<dirname(prefix)>/index-cache/` then `cache_dir`, and built into the last of those when
missing (index_cache.py). A cached set is used only if `index_mismatch` finds it fits the
documents it is loaded for: the description does not name the document range, so other
data can share its name. Building is vectorised numpy (a 10-billion-token index takes
seconds).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import numpy as np

LAST_EPOCH_FRACTION = 0.80


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E >= 1 with (E * T - 1) // S >= n."""
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset's documents hold no tokens; cannot cut samples from it")
    return max(1, (num_samples * seq_length + tokens_per_epoch) // tokens_per_epoch)


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int,
                        num_epochs: int) -> bool:
    """Whether the last epoch is shuffled on its own (it contributes < 80% of an epoch)."""
    if num_epochs == 1:
        return False
    from_prev = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last = num_samples - from_prev
    per_epoch = (tokens_per_epoch - 1) // seq_length
    assert 0 <= last <= per_epoch + 1, (last, per_epoch)
    return last < int(LAST_EPOCH_FRACTION * per_epoch)


def index_layout(tokens_per_epoch: int, seq_length: int, num_samples: int) -> Tuple[int, bool]:
    """(epochs, last epoch shuffled apart) of the index over `num_samples` samples. The three
    index arrays depend on these besides the documents, lengths and seed: two sample counts
    with the same layout read the samples in the same order, others in another order."""
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    return epochs, separate_last_epoch(tokens_per_epoch, seq_length, num_samples, epochs)


def same_layout_range(tokens_per_epoch: int, seq_length: int,
                      num_samples: int) -> Tuple[int, int]:
    """[lo, hi]: the sample counts whose index has the layout of `num_samples`'s."""
    t, s = tokens_per_epoch, seq_length
    epochs, separate = index_layout(t, s, num_samples)
    lo, hi = -(-(epochs - 1) * t // s), (epochs * t - 1) // s
    if epochs > 1:  # the last epoch is apart below `cut` samples
        cut = ((epochs - 1) * t - 1) // s + int(LAST_EPOCH_FRACTION * ((t - 1) // s))
        lo, hi = (lo, min(hi, cut - 1)) if separate else (max(lo, cut), hi)
    return lo, hi


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last: bool) -> np.ndarray:
    """Documents repeated per epoch and shuffled (int32); last epoch apart if asked (the
    first E-1 epochs and the last are shuffled in place in the one array, no copy)."""
    documents = np.asarray(documents, dtype=np.int32)
    doc_idx = np.tile(documents, num_epochs)
    split = len(doc_idx) - len(documents) if separate_last and num_epochs > 1 else len(doc_idx)
    rng.shuffle(doc_idx[:split])
    if split < len(doc_idx):
        rng.shuffle(doc_idx[split:])
    return doc_idx


_SAMPLE_CHUNK = 1 << 22  # doc_idx entries whose samples build_sample_idx places per pass
# The largest doc_idx position an int32 sample_idx holds (Megatron 23.05's dtype).
INT32_MAX_POSITION = int(np.iinfo(np.int32).max)


def sample_idx_dtype(num_doc_idx: int) -> type:
    """int32 (Megatron's) while every position of a doc_idx of `num_doc_idx` entries fits,
    else int64. Past 2**31 entries (documents x epochs: 300M documents read 8 times) an
    int32 position wraps negative (as in Megatron 23.05's helper) and the index reads other
    documents; here the cache check then refused the index just built as another run's."""
    return np.int32 if num_doc_idx - 1 <= INT32_MAX_POSITION else np.int64


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                     num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """[(E*T-1)//S + 1, 2] (doc_idx position, offset) where each sample starts; int32, or
    int64 when doc_idx positions exceed it (`sample_idx_dtype`).

    Sample i starts at token i*S of the concatenated document stream; that token lies in
    the document that spans it (so a boundary on a document's last token stays in that
    document, and empty documents are skipped). One sequential pass along doc_idx,
    `_SAMPLE_CHUNK` documents at a time: the document from token `start` to `end` holds
    the samples ceil(start/S) .. ceil(end/S)-1, written as runs (np.repeat) -- no binary
    search per sample, and no array besides the result longer than a chunk.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.empty((num_samples + 1, 2), dtype=sample_idx_dtype(len(doc_idx)))
    sizes = np.asarray(sizes)
    carry = 0  # tokens before this chunk's documents
    for k0 in range(0, len(doc_idx), _SAMPLE_CHUNK):
        lengths = sizes[doc_idx[k0:k0 + _SAMPLE_CHUNK]].astype(np.int64)
        ends = np.cumsum(lengths)
        ends += carry
        starts = ends - lengths
        carry = int(ends[-1])
        first = -(-starts // seq_length)  # first sample starting at or after each start
        counts = -(-ends // seq_length) - first  # samples starting inside each document
        i0, n = int(first[0]), int(counts.sum())
        rows = sample_idx[i0:i0 + n]
        rows[:, 0] = np.repeat(np.arange(k0, k0 + len(lengths), dtype=np.int64), counts)
        rows[:, 1] = (np.arange(i0, i0 + n, dtype=np.int64) * seq_length
                      - np.repeat(starts, counts))
    sample_idx[0] = (0, 0)  # Megatron's helper starts at (0, 0) even before empty documents
    return sample_idx


def build_shuffle_idx(num_samples: int, total_size: int,
                      rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, num_samples) then, shuffled apart, of [num_samples, total_size).
    Both parts are shuffled in place in the one array (no concatenated copy)."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    shuffle_idx = np.arange(total_size, dtype=dtype)
    rng.shuffle(shuffle_idx[:num_samples])
    if num_samples < total_size:
        rng.shuffle(shuffle_idx[num_samples:])
    return shuffle_idx


def build_index_arrays(documents: np.ndarray, sizes: np.ndarray, num_samples: int,
                       seq_length: int, seed: int,
                       progress: Optional[Callable[[str], None]] = None
                       ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) exactly as Megatron 23.05 builds them.
    `progress(phase)` is called as each array is done ("doc_idx", "sample_idx",
    "shuffle_idx")."""
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, num_epochs)
    done = progress if progress is not None else (lambda phase: None)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate)
    done("doc_idx")
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    done("sample_idx")
    total = sample_idx.shape[0] - 1
    first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    shuffle_idx = build_shuffle_idx(first, total, rng)
    done("shuffle_idx")
    return doc_idx, sample_idx, shuffle_idx


# An index of at least this many doc_idx entries and samples together (a few seconds of
# building, minutes at hundreds of millions) is announced, and each of its three arrays
# logged as it is done, with the time the rest should take.
BUILD_LOG_MIN_ENTRIES = 1 << 24


class IndexBuildLog:
    """The lines a large GPT index build gives `log` (see BUILD_LOG_MIN_ENTRIES): what is
    built (`start`), then, as a `progress` for `build_index_arrays`, each array done with
    the time taken and an estimate of the time left (shuffling an entry and placing the
    samples of one cost about alike; measured on the doc_idx shuffle)."""

    def __init__(self, log: Callable[[str], None], what: str, documents: int, tokens: int,
                 num_samples: int, seq_length: int, clock: Callable[[], float] = time.monotonic):
        self.log, self.what, self.clock = log, what, clock
        self.epochs, self.separate = index_layout(tokens, seq_length, num_samples)
        self.documents, self.num_samples, self.seq_length = documents, num_samples, seq_length
        self.entries = self.epochs * documents
        self.rows = (self.epochs * tokens - 1) // seq_length
        self.start = self.last = clock()
        self.per_entry = 0.0

    def announce(self) -> None:
        apart = ", the last shuffled apart" if self.separate else ""
        self.log(f"    building the index of {self.what}: {self.num_samples} samples of "
                 f"{self.seq_length} tokens asked, {self.rows} cut from {self.epochs} "
                 f"epoch(s) over {self.documents} documents{apart} ...")
        self.start = self.last = self.clock()

    def __call__(self, phase: str) -> None:
        now = self.clock()
        took, self.last = now - self.last, now
        if phase == "doc_idx":
            self.per_entry = took / max(self.entries, 1)
            count, left = f"{self.entries} entries", 0.8 * self.entries + self.rows
        elif phase == "sample_idx":
            count, left = f"{self.rows + 1} rows", self.rows
        else:
            count, left = f"{self.rows} samples", 0
        rest = f", about {self.per_entry * left:.0f} s left" if left else "; writing the files"
        self.log(f"      {phase}: {count} in {took:.1f} s ({now - self.start:.0f} s so far)"
                 f"{rest}")


def describe(data_prefix: str, name: str, num_samples: int, seq_length: int, seed: int,
             split_string: str) -> str:
    """The exact description text whose md5 names the cache files."""
    return ("GPT Dataset\n\n"
            f"Data prefix {data_prefix}\n"
            f"Dataset name {name}\n"
            f"Number of samples {num_samples}\n"
            f"Sequence length {seq_length}\n"
            f"Random seed {seed}\n"
            f"Split {split_string}\n")


_CHUNK = 1 << 22  # rows per pass of the cache check: bounded memory for any index size


def _chunks(array: np.ndarray):
    for start in range(0, len(array), _CHUNK):
        yield start, array[start:start + _CHUNK]


def _moments(values: np.ndarray) -> Tuple[int, int]:
    """(sum, sum of squares) of integer ids, wrapping modulo 2**64 (equal multisets give
    equal results; a wrap on both sides keeps that)."""
    v = values.astype(np.uint64)
    with np.errstate(over="ignore"):
        return int(v.sum(dtype=np.uint64)), int((v * v).sum(dtype=np.uint64))


def _doc_idx_mismatch(doc_idx: np.ndarray, documents: np.ndarray, epochs: int) -> Optional[str]:
    if doc_idx.ndim != 1 or len(doc_idx) != epochs * len(documents):
        return (f"doc_idx has {len(doc_idx)} entries, not {epochs} epochs x "
                f"{len(documents)} documents")
    lo, hi = int(documents.min()), int(documents.max())
    first, last, total, squares = hi, lo, 0, 0
    for _, part in _chunks(doc_idx):
        first, last = min(first, int(part.min())), max(last, int(part.max()))
        s1, s2 = _moments(part)
        total, squares = (total + s1) % 2**64, (squares + s2) % 2**64
    if first < lo or last > hi:
        return f"doc_idx holds documents {first}..{last}, outside this dataset's {lo}..{hi}"
    want1, want2 = _moments(documents)
    if (total, squares) != (want1 * epochs % 2**64, want2 * epochs % 2**64):
        return f"doc_idx does not hold each of the {len(documents)} documents {epochs} times"
    return None


def _sample_idx_mismatch(sample_idx: np.ndarray, doc_idx: np.ndarray,
                         sizes: np.ndarray) -> Optional[str]:
    previous = 0
    for _, part in _chunks(sample_idx):
        pos, off = part[:, 0].astype(np.int64), part[:, 1].astype(np.int64)
        if pos.min() < previous or pos.max() >= len(doc_idx) or np.any(np.diff(pos) < 0):
            return "sample_idx positions are not ordered positions of doc_idx"
        previous = int(pos[-1])
        lengths = sizes[doc_idx[pos]]
        if off.min() < 0 or np.any((off >= lengths) & (off > 0)):
            return "sample_idx offsets lie beyond the sizes of their documents"
    return None


def _sample_starts_mismatch(sample_idx: np.ndarray, doc_idx: np.ndarray, sizes: np.ndarray,
                            seq_length: int) -> Optional[str]:
    """Whether row i of sample_idx is where token i*S of the document stream (the sizes of
    doc_idx's documents, concatenated) lies: inside a document (offset < its size), row 0
    at (0, 0). Catches data preprocessed again with the same documents and nearly the same
    tokens, whose stale rows would cut samples of other lengths or overlapping ones. Runs
    along doc_idx and sample_idx (positions already checked to be ordered) in blocks of
    `_CHUNK` entries: memory bounded whatever the index size."""
    row, buf, k, carry = 0, np.empty((0, 2), dtype=np.int64), 0, 0
    for first, part in _chunks(doc_idx):
        lengths = sizes[part].astype(np.int64)
        ends = carry + np.cumsum(lengths)
        stop = first + len(part)
        while True:
            if k == len(buf):
                buf, k = np.asarray(sample_idx[row:row + _CHUNK], dtype=np.int64), 0
                if len(buf) == 0:
                    break
            take = int(np.searchsorted(buf[k:, 0], stop, side="left"))
            if take:
                p, off = buf[k:k + take, 0] - first, buf[k:k + take, 1]
                want = np.arange(row, row + take, dtype=np.int64) * seq_length
                ok = (ends[p] - lengths[p] + off == want) & (off >= 0) & (off < lengths[p])
                if row == 0:  # Megatron's helper starts at (0, 0) even before an empty document
                    ok[0] = buf[k, 0] == 0 and buf[k, 1] == 0
                if not ok.all():
                    bad = row + int(np.argmin(ok))
                    return (f"sample_idx row {bad} does not start at token {bad * seq_length} "
                            "of the documents' current sizes")
                row, k = row + take, k + take
            if k < len(buf):
                break
        carry = int(ends[-1]) if len(ends) else carry
    return None


def _shuffle_idx_mismatch(shuffle_idx: np.ndarray, total: int, first: int) -> Optional[str]:
    """Whether shuffle_idx is Megatron's: a permutation of samples [0, first) followed by
    one of [first, total) (the last epoch shuffled apart; `first == total`: one
    permutation). A set with a sample twice would read it twice an epoch and skip
    another, silently. Each block of `_CHUNK` entries is checked against its range and
    marked in a map of one byte per sample (100 MB, about 1 s, for 100M samples)."""
    if shuffle_idx.shape != (total,):
        return f"shuffle_idx has shape {shuffle_idx.shape}, not ({total},)"
    want = (f"a permutation of the {total} samples" if first == total else
            f"a permutation of samples 0..{first - 1} then one of {first}..{total - 1} (the "
            "last epoch shuffled apart)")
    seen = np.zeros(total, dtype=bool)
    for lo, hi in ((0, first), (first, total)):
        for start, part in _chunks(shuffle_idx[lo:hi]):
            if int(part.min()) < lo or int(part.max()) >= hi:
                return (f"shuffle_idx is not {want}: its entries {lo + start}.."
                        f"{lo + start + len(part) - 1} hold samples {int(part.min())}.."
                        f"{int(part.max())}")
            seen[part.astype(np.intp)] = True  # (as intp: twice as fast as uint32)
    missing = total - int(np.count_nonzero(seen))
    if missing:
        return (f"shuffle_idx is not {want}: it never reads {missing} of them and reads "
                "others more than once (damaged, or written by another tool)")
    return None


def index_mismatch(arrays: Tuple[np.ndarray, np.ndarray, np.ndarray], documents: np.ndarray,
                   sizes: np.ndarray, num_samples: int, seq_length: int) -> Optional[str]:
    """Why cached (doc_idx, sample_idx, shuffle_idx) cannot be the index of `documents`
    (None when they can). Checked: doc_idx has E entries per document (E the epochs these
    documents need), all within the documents' range, with their sum and sum of squares;
    sample_idx has (E*T-1)//S + 1 rows whose positions lie in doc_idx, in order, and row i
    lies at token i*S of doc_idx's documents at their current sizes; shuffle_idx is a
    permutation of the (E*T-1)//S samples (of the first E-1 epochs' samples, then of the
    last epoch's, when that is shuffled apart). Passes over the arrays in blocks of
    `_CHUNK` rows (memory bounded whatever the index size, but for one byte per sample
    to mark those shuffle_idx holds): this catches an index built for another document
    range or for data since preprocessed again to other sizes, even by a token, and a
    damaged shuffle_idx. Data whose sizes did not change keeps its index (the arrays
    depend on the sizes only)."""
    doc_idx, sample_idx, shuffle_idx = arrays
    sizes = np.asarray(sizes)
    tokens = int(sizes[documents].sum(dtype=np.int64))
    epochs = num_epochs_needed(tokens, seq_length, num_samples)
    total = (epochs * tokens - 1) // seq_length
    problem = _doc_idx_mismatch(doc_idx, documents, epochs)
    if problem:
        return problem
    if sample_idx.shape != (total + 1, 2):
        return (f"sample_idx has shape {sample_idx.shape}, not ({total + 1}, 2) for "
                f"{tokens} tokens x {epochs} epochs in samples of {seq_length}")
    problem = (_sample_idx_mismatch(sample_idx, doc_idx, sizes)
               or _sample_starts_mismatch(sample_idx, doc_idx, sizes, seq_length))
    if problem:
        return problem
    separate = separate_last_epoch(tokens, seq_length, num_samples, epochs)
    first = ((epochs - 1) * tokens - 1) // seq_length if separate else total
    return _shuffle_idx_mismatch(shuffle_idx, total, first)
