"""Megatron's mmap indexed dataset: a `.bin` of token ids and an `.idx` describing it.

`.idx` layout (little-endian; see README.md beside this file):

    magic b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 N | u64 K
    | int32 sizes[N] | int64 pointers[N] (byte offsets into .bin) | int64 doc_idx[K]

`.bin` is the raw concatenation of all sequences in that dtype. `doc_idx[d]` is the first
sequence of document d; it starts with 0 and ends with N.

The reader maps both files and hands out numpy views into them (no copies). It checks
magic, version, dtype code, the `.idx` size implied by its header and the `.bin` size
implied by `sizes`; a bad file raises ValueError naming the file and the problem. Each
read first checks that neither file has been cut short since it was mapped
(DataFileChangedError, naming it): a read past a file's new end would kill the process
with SIGBUS.

Older Megatron-LM releases also wrote a legacy index (`--dataset-impl lazy|cached`):

    magic b"TNTIDX\x00\x00" | u64 version=1 | u64 dtype code | u64 element size | u64 n
    | u64 s | u64 K | int64 dim_offsets[n+1] | int64 data_offsets[n+1] (in elements)
    | int64 sizes[s] | int64 doc_idx[K]

over the same kind of `.bin`. Such an index is read too (token sequences only: one
dimension per item, integer dtypes) and turned into the sizes / byte pointers / doc_idx
arrays above, so the rest of the reader does not know which format it came from.
"""
from __future__ import annotations

import glob
import mmap
import os
import shutil
import struct
import warnings
from array import array
from typing import Iterable, Optional, Tuple, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype code + 8 N + 8 K
TOKEN_SCAN_BYTES = 1 << 20  # bytes of a .bin sampled by check_token_ids (once per file and run)
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
LEGACY_MAGIC = b"TNTIDX\x00\x00"
LEGACY_HEADER_SIZE = 56  # 8 magic + 8 version + 8 code + 8 element size + 8 n + 8 s + 8 K
LEGACY_TOKEN_CODES = (1, 2, 3, 4, 5, 8)  # integer dtypes: token ids


def dtype_code(dtype) -> int:
    """Megatron's one-byte code of a numpy dtype."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in a Megatron .bin; use one of "
                     f"{sorted(np.dtype(d).name for d in DTYPE_CODES.values())}")


def best_dtype(vocab_size: Optional[int]):
    """uint16 when every id fits (vocab_size < 65500, Megatron's rule), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def write_index(idx_path: str, dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write an `.idx` for sequences of `sizes` tokens; pointers are derived from sizes."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= itemsize
    with open(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.astype("<i4", copy=False).tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(doc_idx.astype("<i8", copy=False).tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams sequences into `bin_path`; `finalize(idx_path)` writes the index.

    Sizes and document starts are kept as compact int arrays (4 + 8 bytes per entry), never
    the token data, so memory stays small whatever the corpus size.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)
        self._bin_path = bin_path
        self._data = open(bin_path, "wb")
        self._sizes = array("i")
        self._doc_idx = array("q", [0])

    @property
    def dtype(self):
        return self._dtype

    def _write(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.dtype != self._dtype:
            arr = arr.astype(self._dtype)
        self._data.write(np.ascontiguousarray(arr).tobytes(order="C"))
        return int(arr.size)

    def add_item(self, tokens) -> None:
        """Append one sequence (list, numpy array or torch tensor of ids)."""
        if hasattr(tokens, "numpy"):
            tokens = tokens.numpy()
        self._sizes.append(self._write(tokens))

    def end_document(self) -> None:
        """Close the current document: the next sequence starts a new one."""
        self._doc_idx.append(len(self._sizes))

    def add_doc(self, tokens, lengths: Iterable[int]) -> None:
        """Append one document made of sequences of `lengths` tokens (sum == len(tokens))."""
        lengths = list(lengths)
        written = self._write(tokens)
        if written != sum(lengths):
            raise ValueError(f"add_doc: {written} tokens but lengths sum to {sum(lengths)}")
        self._sizes.extend(lengths)
        self._doc_idx.append(len(self._sizes))

    def add_batch(self, tokens: np.ndarray, sizes: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Append many documents at once: all their tokens, every sequence size, and the
        number of sequences of each document (0 for an empty document)."""
        self._write(tokens)
        start = len(self._sizes)
        self._sizes.frombytes(np.asarray(sizes, dtype=np.int32).tobytes())
        ends = start + np.cumsum(np.asarray(seqs_per_doc, dtype=np.int64))
        self._doc_idx.frombytes(ends.astype(np.int64).tobytes())

    def merge_file_(self, prefix: str) -> None:
        """Append the dataset at `prefix` (its .bin is copied, its doc_idx shifted)."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self._dtype:
            raise ValueError(f"cannot merge {prefix} (dtype {other.dtype.name}) into a "
                             f"{self._dtype.name} dataset")
        offset = len(self._sizes)
        self._sizes.frombytes(np.asarray(other.sizes, dtype=np.int32).tobytes())
        shifted = np.asarray(other.doc_idx[1:], dtype=np.int64) + offset
        self._doc_idx.frombytes(shifted.tobytes())
        del other
        with open(data_file_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._data, length=16 << 20)

    def close(self) -> None:
        """Close the .bin without writing an index (the build is abandoned)."""
        self._data.close()

    def finalize(self, idx_path: str) -> None:
        """Close the .bin and write the .idx."""
        self._data.close()
        write_index(idx_path, self._dtype, np.frombuffer(self._sizes, dtype=np.int32),
                    np.frombuffer(self._doc_idx, dtype=np.int64))


def _read_header(idx_path: str, idx_size: int, buf) -> tuple:
    if idx_size < HEADER_SIZE:
        raise ValueError(f"{idx_path}: truncated index: {idx_size} bytes, the header alone is "
                         f"{HEADER_SIZE}")
    if bytes(buf[:9]) != MAGIC:
        raise ValueError(f"{idx_path}: bad magic {bytes(buf[:9])!r}, expected {MAGIC!r} (mmap) "
                         f"or {LEGACY_MAGIC!r} (legacy); not a Megatron index")
    version, code, n, k = struct.unpack("<QBQQ", bytes(buf[9:HEADER_SIZE]))
    if version != VERSION:
        raise ValueError(f"{idx_path}: index version {version}, only {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path}: unknown dtype code {code}; valid codes are "
                         f"{sorted(DTYPE_CODES)}")
    expected = HEADER_SIZE + 12 * n + 8 * k
    if idx_size != expected:
        kind = "truncated" if idx_size < expected else "oversized"
        raise ValueError(f"{idx_path}: {kind} index: {idx_size} bytes, its header (N={n} "
                         f"sequences, {k} doc_idx entries) implies {expected}")
    return np.dtype(DTYPE_CODES[code]), n, k


def _read_legacy_index(idx_path: str, buf) -> tuple:
    """(dtype, sizes int32 [N], byte pointers int64 [N], doc_idx int64 [K]) of a legacy
    TNTIDX index; ValueError naming the file for anything but 1-D integer sequences."""
    size = len(buf)
    if size < LEGACY_HEADER_SIZE:
        raise ValueError(f"{idx_path}: truncated legacy index: {size} bytes, the header alone "
                         f"is {LEGACY_HEADER_SIZE}")
    version, code, element_size, n, s, k = struct.unpack("<QQQQQQ", bytes(buf[8:56]))
    if version != VERSION:
        raise ValueError(f"{idx_path}: legacy index version {version}, only {VERSION} is "
                         "supported")
    if code not in LEGACY_TOKEN_CODES or np.dtype(DTYPE_CODES[code]).itemsize != element_size:
        raise ValueError(f"{idx_path}: legacy index of dtype code {code} (element size "
                         f"{element_size}): token ids need an integer code of "
                         f"{list(LEGACY_TOKEN_CODES)} with its own element size")
    expected = LEGACY_HEADER_SIZE + 8 * (2 * (n + 1) + s + k)
    if size != expected:
        kind = "truncated" if size < expected else "oversized"
        raise ValueError(f"{idx_path}: {kind} legacy index: {size} bytes, its header (n={n} "
                         f"items, {s} sizes, {k} doc_idx entries) implies {expected}")
    longs = np.frombuffer(buf, dtype="<i8", offset=LEGACY_HEADER_SIZE)
    dim_offsets, data_offsets = longs[:n + 1], longs[n + 1:2 * n + 2]
    sizes, doc_idx = longs[2 * n + 2:2 * n + 2 + s], longs[2 * n + 2 + s:]
    if s != n or np.any(np.diff(dim_offsets) != 1):
        raise ValueError(f"{idx_path}: legacy index with multi-dimensional items ({s} sizes "
                         f"for {n} items); only token sequences (one dimension) can be read")
    if n and (data_offsets[0] != 0 or np.any(np.diff(data_offsets) != sizes)):
        raise ValueError(f"{idx_path}: corrupt legacy index: data offsets do not match sizes")
    dtype = np.dtype(DTYPE_CODES[code])
    return (dtype, sizes.astype(np.int32), data_offsets[:-1] * dtype.itemsize,
            np.array(doc_idx))


def missing_dataset_hint(prefix: str) -> str:
    """'; <the fix>' for a dataset prefix whose `.bin` or `.idx` is missing, or '': the
    prefix given with its .bin/.idx suffix or a trailing '.' or '/' (shell completion),
    preprocess_data.py's --output-prefix given instead of the
    `<output-prefix>_<key>_document` it wrote, or a `.bin` without its `.idx` (which both
    tools write last)."""
    if prefix.endswith((".bin", ".idx")):
        return f"; a dataset is named by its prefix without .bin/.idx: pass {prefix[:-4]}"
    trimmed = prefix.rstrip("./")
    if trimmed and trimmed != prefix and MMapIndexedDataset.exists(trimmed):
        return (f"; {trimmed}.bin/.idx exist: a dataset is named by its prefix without a "
                f"trailing '.' or '/' (shell completion stops at '{trimmed}.'): pass {trimmed}")
    if os.path.isfile(data_file_path(prefix)) and not os.path.isfile(index_file_path(prefix)):
        return ("; the .bin is there but not its .idx, which preprocess_data.py and "
                "merge_datasets.py write last: that run did not finish, or the copy is "
                "incomplete")
    found = sorted(path[:-len(".idx")] for path in glob.glob(glob.escape(prefix) + "_*.idx")
                   if path.endswith(("_document.idx", "_sentence.idx")))
    if not found:
        return ""
    shown = " or ".join(found[:3]) + (f" (or {len(found) - 3} more)" if len(found) > 3 else "")
    return (f"; preprocess_data.py names its output <output-prefix>_<json key>_document "
            f"(_sentence with --split-sentences): pass {shown}")


class DataFileChangedError(ValueError):
    """A mapped `.bin`/`.idx` became shorter while the run read it."""


class _MappedFile:
    """A read-only map of a whole file (`view`; empty for an empty file) that can tell
    whether the file has since been cut short: a read of a mapped page past a file's new
    end kills the process with SIGBUS, no Python error (a DataLoader worker's death is
    reported by torch as a shared-memory shortage)."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        self._map: Optional[mmap.mmap] = None
        self.view = memoryview(b"")
        if size:
            try:
                with open(path, "rb") as f:  # the map keeps its own descriptor
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:  # mmap's errors name no file
                e.filename = e.filename or path
                raise
            self.view = memoryview(self._map)

    def check_unchanged(self) -> None:
        """DataFileChangedError when the file is now shorter than it was when mapped (one
        fstat of the mapped file: a file deleted but not rewritten still reads fine)."""
        now = self._map.size() if self._map is not None else self.size
        if now < self.size:
            raise DataFileChangedError(
                f"{self.path} is now {now} bytes, {self.size} when this run opened it: it "
                "was truncated or rewritten while the run read it (reading past its new end "
                "would kill the process). Restore the .bin/.idx pair preprocessing wrote "
                "(or pass --data-path of an intact copy) and resume from the last checkpoint")


class MMapIndexedDataset:
    """Read-only view of `<prefix>.bin/.idx`; `ds[i]` is sequence i as a numpy view."""

    def __init__(self, prefix: str, skip_warmup: bool = False):
        # skip_warmup: Megatron-LM 23.05's argument, accepted as is: nothing is read ahead
        # here (pages of the maps are read when used), so there is nothing to skip.
        self._prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such file (dataset prefix {prefix!r})"
                                 f"{missing_dataset_hint(prefix)}")
        idx_size = os.path.getsize(idx_path)
        self._idx_map = _MappedFile(idx_path, idx_size)
        buf = self._idx_map.view
        if bytes(buf[:8]) == LEGACY_MAGIC:
            self._dtype, self._sizes, self._pointers, self._doc_idx = _read_legacy_index(
                idx_path, buf)
            n, k = len(self._sizes), len(self._doc_idx)
        else:
            self._dtype, n, k = _read_header(idx_path, idx_size, buf)
            self._sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
            self._pointers = np.frombuffer(buf, dtype="<i8", count=n,
                                           offset=HEADER_SIZE + 4 * n)
            self._doc_idx = np.frombuffer(buf, dtype="<i8", count=k,
                                          offset=HEADER_SIZE + 12 * n)
        self._check_index(idx_path, n, k)
        # EOD tokens in the .bin that its index does not count (Megatron's --append-eod bug)
        self.uncounted_eods = 0
        bin_size = os.path.getsize(bin_path)
        self._check_bin(bin_path, bin_size)
        self._bin_map = _MappedFile(bin_path, bin_size)
        self._bin = self._bin_map.view

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def bin_nbytes(self) -> int:
        """Size of the `.bin` in bytes."""
        return len(self._bin)

    def __getstate__(self) -> dict:  # memory maps are not picklable: reopen by prefix
        return {"prefix": self._prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def _check_index(self, idx_path: str, n: int, k: int) -> None:
        if k < 1 or self._doc_idx[0] != 0 or self._doc_idx[-1] != n:
            first = int(self._doc_idx[0]) if k else None
            last = int(self._doc_idx[-1]) if k else None
            raise ValueError(f"{idx_path}: corrupt doc_idx: must start at 0 and end at N={n}, "
                             f"got first={first}, last={last} ({k} entries)")
        if n and (self._sizes.min() < 0 or self._pointers[0] != 0):
            raise ValueError(f"{idx_path}: corrupt index: negative sizes or pointers[0] != 0")
        if n and self._pointers[-1] != (self._sizes[:-1].sum(dtype=np.int64)
                                         * self._dtype.itemsize):
            raise ValueError(f"{idx_path}: corrupt index: pointers do not match sizes")

    def _check_bin(self, bin_path: str, bin_size: int) -> None:
        n_tokens = int(self._sizes.sum(dtype=np.int64))
        expected = n_tokens * self._dtype.itemsize
        if bin_size == expected:
            return
        if bin_size > expected:
            # Megatron 23.06 `--append-eod` wrote one uncounted EOD per non-empty document.
            docs = int(np.count_nonzero(np.diff(self._doc_idx)))
            if bin_size == expected + docs * self._dtype.itemsize:
                self.uncounted_eods = docs
                warnings.warn(f"{bin_path} holds one token per document more than its index "
                              "counts: written by Megatron's preprocess_data.py --append-eod "
                              "(off-by-one bug); it is read exactly as Megatron reads it")
                return
        kind = "truncated" if bin_size < expected else "oversized"
        raise ValueError(f"{bin_path}: {kind} data file: {bin_size} bytes, the index "
                         f"({len(self._sizes)} sequences, {n_tokens} tokens of "
                         f"{self._dtype.name}) implies {expected}"
                         f"{self._other_dtype_hint(bin_size, n_tokens) or self._REWRITE_HINT}")

    _REWRITE_HINT = ("; the .bin and .idx are not one preprocessing run's output (a copy "
                     "cut short, or one of them written again): copy both files again, or "
                     "rerun tools/preprocess_data.py for this prefix")

    def _other_dtype_hint(self, bin_size: int, n_tokens: int) -> str:
        """'; ...' when the .bin holds exactly the index's tokens in another dtype: the
        .idx names another dtype than the .bin was written in (the builders pick uint16 or
        int32 from the vocabulary size), not a damaged .bin."""
        fits = sorted({np.dtype(d).name for d in DTYPE_CODES.values()
                       if n_tokens and np.dtype(d).itemsize * n_tokens == bin_size})
        if not fits:
            return ""
        return (f"; it holds exactly that many tokens of {' or '.join(fits)}: the .idx says "
                f"{self._dtype.name}, another dtype than the .bin was written in (the tools "
                "pick uint16 or int32 from the vocabulary size); use the .idx written with "
                "this .bin")

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        """int32 [N]: tokens per sequence."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """int64 [N]: byte offset of each sequence in the .bin."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """int64 [docs + 1]: first sequence of each document, then N."""
        return self._doc_idx

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx: Union[int, slice]):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices with step {step} are not supported; use step 1")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` as a read-only view."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} outside [0, {n})")
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {idx} "
                             f"of {size} tokens")
        start = int(self._pointers[idx]) + offset * self._dtype.itemsize
        self._idx_map.check_unchanged()
        self._bin_map.check_unchanged()
        return np.frombuffer(self._bin, dtype=self._dtype, count=length, offset=start)

    def token_id_range(self, max_bytes: int = TOKEN_SCAN_BYTES) -> Tuple[int, int, int]:
        """(smallest id, largest id, bytes read) over at most `max_bytes` of the `.bin`:
        all of it when small, else four evenly spaced windows (start to end). Bounded so
        that opening a large dataset does not pay for a full scan; ids outside the windows
        are not seen. (0, -1, 0) for an empty file."""
        itemsize = self._dtype.itemsize
        total = len(self._bin) // itemsize
        if total == 0:
            return 0, -1, 0
        window = max(1, max_bytes // (4 * itemsize))
        if total <= 4 * window:
            starts = [0]
            window = total
        else:
            starts = np.linspace(0, total - window, 4).astype(np.int64).tolist()
        lo, hi = None, None
        for start in starts:
            ids = np.frombuffer(self._bin, dtype=self._dtype, count=window,
                                offset=int(start) * itemsize)
            lo = ids.min() if lo is None else min(lo, ids.min())
            hi = ids.max() if hi is None else max(hi, ids.max())
        return int(lo), int(hi), len(starts) * window * itemsize

    @staticmethod
    def exists(prefix: str) -> bool:
        """True when both `<prefix>.idx` and `<prefix>.bin` exist."""
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def needs_id_scan(dtype: np.dtype, vocab_size: int,
                  tokenizer_vocab_size: Optional[int] = None) -> bool:
    """Whether `check_token_ids` must read ids of a `.bin` of `dtype`: False when every
    value the dtype holds is an id below both sizes (uint16 under a 65536-id vocabulary)."""
    limit = vocab_size if tokenizer_vocab_size is None else min(vocab_size, tokenizer_vocab_size)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    return not (info is not None and info.min >= 0 and info.max < limit)


def _warn_dtype_narrower_than_tokenizer(dataset: MMapIndexedDataset,
                                        tokenizer_vocab_size: Optional[int]) -> None:
    """Warn when the `.bin`'s integer dtype cannot hold every id of the run's tokenizer
    (uint16 under a vocabulary of more than 65536 ids): no tool writes that for such a
    tokenizer (they pick int32 from 65500 ids), so the data was tokenized with a smaller
    vocabulary than this run's, and every id it holds is valid here: no scan can tell."""
    dtype = np.dtype(dataset.dtype)
    if tokenizer_vocab_size is None or dtype.kind not in "iu":
        return
    top = int(np.iinfo(dtype).max)
    if top >= tokenizer_vocab_size - 1:
        return
    warnings.warn(f"{data_file_path(dataset.prefix)}: its ids are {dtype.name} (at most {top}) "
                  f"but this run's tokenizer has {tokenizer_vocab_size} ids; "
                  "preprocess_data.py writes int32 for a vocabulary of 65500 ids or more, so "
                  "the data was tokenized with another, smaller vocabulary (or its ids were "
                  "cut to fit). Pass the --tokenizer-type and files it was preprocessed with, "
                  "or preprocess it again with this run's tokenizer")


def check_token_ids(dataset: MMapIndexedDataset, vocab_size: int,
                    max_bytes: int = TOKEN_SCAN_BYTES,
                    tokenizer_vocab_size: Optional[int] = None,
                    id_range: Optional[Tuple[int, int, int]] = None) -> None:
    """Raise ValueError when `dataset` holds an id outside [0, vocab_size) (the model's
    padded vocabulary), naming the file, the id and the size. Free when the dtype cannot
    hold such an id; otherwise a bounded sample (`max_bytes`, 1 MiB by default: the whole
    file when smaller) is scanned, so a large dataset costs milliseconds and a bad id
    outside the sample is missed. An id in [tokenizer_vocab_size, vocab_size) -- a padding
    row, which the run's tokenizer never produces -- is a warning: the model runs, but the
    data was made with another tokenizer (SentencePieceTokenizer's <EOD> under
    GPTSentencePieceTokenizer, say).

    `id_range`: the dataset's `token_id_range(max_bytes)` when it is known already (one
    rank's scan of the file, handed to the others), so that nothing is read here."""
    _warn_dtype_narrower_than_tokenizer(dataset, tokenizer_vocab_size)
    if not needs_id_scan(dataset.dtype, vocab_size, tokenizer_vocab_size):
        return
    limit = vocab_size if tokenizer_vocab_size is None else min(vocab_size, tokenizer_vocab_size)
    if id_range is None:
        id_range = dataset.token_id_range(max_bytes)
    lo, hi, scanned = id_range
    whole = scanned >= dataset.bin_nbytes
    where = "in it" if whole else f"in the {scanned / 2**20:.1f} MiB of it sampled"
    if lo >= 0 and hi < limit:
        return
    if lo >= 0 and hi < vocab_size:
        warnings.warn(f"{data_file_path(dataset.prefix)}: token id {hi} {where} is past the "
                      f"{tokenizer_vocab_size} ids of this run's tokenizer (a padding row of "
                      f"the model's {vocab_size}, which the tokenizer never produces): the data "
                      "was likely preprocessed with another tokenizer, e.g. "
                      "SentencePieceTokenizer (which appends <EOD> and other ids after the "
                      "model's pieces) where the run uses GPTSentencePieceTokenizer. Pass the "
                      "--tokenizer-type and files it was preprocessed with")
        return
    bad = hi if hi >= vocab_size else lo
    raise ValueError(f"{data_file_path(dataset.prefix)}: token id {bad} {where} is outside the "
                     f"padded vocabulary of {vocab_size} ids: the data was tokenized with "
                     "another vocabulary than this run's. Pass the --tokenizer-type and "
                     "--vocab-file (or --vocab-size) it was preprocessed with")
