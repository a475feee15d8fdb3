"""A data script written for Megatron-LM 23.05 (`from megatron.data import indexed_dataset`)
runs unchanged: it builds, merges and reads `.bin/.idx` files with Megatron's names and
signatures, and the bytes are the format's worked example."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.core.datasets import indexed_dataset as core_indexed
from megatron.data import indexed_dataset
from megatron.data.indexed_dataset import MMapIndexedDataset, make_builder, make_dataset
from tests.test_indexed_dataset import EXAMPLE_BIN, EXAMPLE_IDX


def _build(prefix: str, docs, vocab_size=50257):
    """As a 23.05 script does it: one add_item per sentence (a torch tensor), then
    end_document; GPT-2's vocabulary gives uint16."""
    builder = make_builder(indexed_dataset.data_file_path(prefix), impl="mmap",
                           vocab_size=vocab_size)
    for doc in docs:
        for sentence in doc:
            builder.add_item(torch.IntTensor(sentence))
        builder.end_document()
    builder.finalize(indexed_dataset.index_file_path(prefix))
    return builder


def test_a_ported_script_writes_megatrons_bytes_and_reads_them_back(tmp_path):
    prefix = str(tmp_path / "my-gpt2_text_document")
    _build(prefix, [[[10, 11, 12]], [[20, 21]]])
    assert (tmp_path / "my-gpt2_text_document.bin").read_bytes() == EXAMPLE_BIN
    assert (tmp_path / "my-gpt2_text_document.idx").read_bytes() == EXAMPLE_IDX
    ds = MMapIndexedDataset(prefix, skip_warmup=True)  # 23.05's signature
    assert isinstance(ds, core_indexed.MMapIndexedDataset)
    assert len(ds) == 2 and ds.sizes.tolist() == [3, 2] and ds.doc_idx.tolist() == [0, 1, 2]
    assert ds[0].tolist() == [10, 11, 12] and ds.get(0, 1, 2).tolist() == [11, 12]
    assert [s.tolist() for s in ds[0:2]] == [[10, 11, 12], [20, 21]]
    for impl in ("mmap", "infer"):
        again = make_dataset(prefix, impl, skip_warmup=True)
        assert again.sizes.tolist() == [3, 2]
    assert indexed_dataset.infer_dataset_impl(prefix) == "mmap"
    assert indexed_dataset.dataset_exists(prefix, "mmap")


def test_merge_file_like_tools_merge_datasets(tmp_path):
    a, b, out = (str(tmp_path / n) for n in ("a", "b", "merged"))
    _build(a, [[[1, 2], [3]], [[4]]])
    _build(b, [[[5, 6, 7]]])
    builder = make_builder(indexed_dataset.data_file_path(out), impl="mmap", vocab_size=50257)
    for prefix in (a, b):
        builder.merge_file_(prefix)
    builder.finalize(indexed_dataset.index_file_path(out))
    ds = MMapIndexedDataset(out)
    assert ds.doc_idx.tolist() == [0, 2, 3, 4]
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4], [5, 6, 7]]


def test_builder_class_default_dtype_is_megatrons_int64(tmp_path):
    builder = indexed_dataset.MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"))
    builder.add_item(torch.tensor([1, 2]))
    builder.end_document()
    builder.finalize(str(tmp_path / "x.idx"))
    assert MMapIndexedDataset(str(tmp_path / "x")).dtype == np.int64
    assert make_builder(str(tmp_path / "y.bin"), "mmap", 70000).dtype == np.int32


def test_what_is_not_done_here_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="only the mmap format is written.*impl='mmap'"):
        make_builder(str(tmp_path / "x.bin"), "lazy")
    with pytest.raises(ValueError, match="'mmpa' is not one of lazy, cached, mmap"):
        make_dataset(str(tmp_path / "x"), "mmpa")
    with pytest.raises(ValueError, match="x.idx: no such file"):  # Megatron returns None
        make_dataset(str(tmp_path / "x"), "mmap", skip_warmup=True)
    assert indexed_dataset.infer_dataset_impl(str(tmp_path / "x")) is None
