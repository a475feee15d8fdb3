"""Megatron-LM 23.05's `megatron.data.indexed_dataset` names, for ported data scripts.

`MMapIndexedDataset(path, skip_warmup=...)` and the builder are the classes of
`megatron.core.datasets.indexed_dataset` (same files, same methods: `sizes`, `doc_idx`,
`get(i, offset, length)`, `ds[i]`, `len(ds)`; `add_item`, `add_doc`, `end_document`,
`merge_file_`, `finalize`). Differences, on purpose: `make_dataset` raises ValueError
naming the missing files where Megatron prints and returns None, and only the mmap format is
written (Megatron-LM 23.05 trains only on it); legacy `lazy`/`cached` indexes still read.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from megatron.core.datasets.indexed_dataset import (
    LEGACY_MAGIC,
    MAGIC,
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    best_dtype,
    data_file_path,
    index_file_path,
)

__all__ = [
    "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "make_builder", "make_dataset",
    "dataset_exists", "infer_dataset_impl", "get_available_dataset_impl",
    "index_file_path", "data_file_path",
]

_IMPLS = ("lazy", "cached", "mmap")


class MMapIndexedDatasetBuilder(IndexedDatasetBuilder):
    """Megatron's builder name; its default dtype is int64, as in Megatron."""

    def __init__(self, out_file: str, dtype=np.int64):
        super().__init__(out_file, dtype)


def get_available_dataset_impl() -> List[str]:
    return list(_IMPLS)


def _check_impl(impl: str, allowed) -> None:
    if impl not in allowed:
        raise ValueError(f"dataset impl {impl!r} is not one of {', '.join(allowed)}")


def infer_dataset_impl(path: str) -> Optional[str]:
    """'mmap' or 'cached' (a legacy index) from the `.idx` magic; None when unknown."""
    if not MMapIndexedDataset.exists(path):
        return None
    with open(index_file_path(path), "rb") as f:
        magic = f.read(len(MAGIC))
    if magic == MAGIC:
        return "mmap"
    return "cached" if magic[:len(LEGACY_MAGIC)] == LEGACY_MAGIC else None


def make_builder(out_file: str, impl: str, vocab_size: Optional[int] = None):
    """A builder writing `out_file` (the `.bin`) in the smallest dtype for `vocab_size`."""
    _check_impl(impl, _IMPLS)
    if impl != "mmap":
        raise ValueError(f"dataset impl {impl!r}: only the mmap format is written here "
                         "(Megatron-LM 23.05 trains only on it); pass impl='mmap'")
    return MMapIndexedDatasetBuilder(out_file, dtype=best_dtype(vocab_size))


def make_dataset(path: str, impl: str, skip_warmup: bool = False) -> MMapIndexedDataset:
    """The dataset at prefix `path` (`.idx` of the mmap or the legacy format); 'infer'
    reads the format from the file. Missing files raise ValueError naming them."""
    _check_impl(impl, _IMPLS + ("infer",))
    return MMapIndexedDataset(path, skip_warmup=skip_warmup)


def dataset_exists(path: str, impl: str) -> bool:
    _check_impl(impl, _IMPLS)
    return MMapIndexedDataset.exists(path)
