"""The first minutes of a large run: global rank 0 builds the GPT index while the others wait.

At hundreds of millions of samples the build takes minutes. It printed nothing meanwhile,
and the other ranks waited in a barrier bounded by --distributed-timeout-minutes: a build
that outlasted it ended a healthy run in the watchdog ("ranks that did not arrive: [0]").
"""
from __future__ import annotations

import re

import numpy as np

from megatron.core.datasets import gpt_dataset
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def _corpus(prefix: str, docs: int = 40) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in range(docs):
        builder.add_item(np.arange(doc, doc + 30) % 100)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_a_large_build_says_what_it_builds_and_each_array_with_the_time_left(
        tmp_path, monkeypatch):
    """A large build (here: the threshold lowered) is announced with its dataset, samples
    and epochs, then each of its three arrays as it is done; a cached index says nothing
    of the kind, and a small build (the default threshold) keeps the log short."""
    prefix = _corpus(str(tmp_path / "corpus"))
    args = ([prefix], "90,10,0", [500, 10, 0], 16, 1234, str(tmp_path / "cache"))
    monkeypatch.setattr(gpt_dataset, "BUILD_LOG_MIN_ENTRIES", 1)
    lines = []
    train, _, _ = build_train_valid_test_datasets(*args, log=lines.append)
    epochs = len(train.doc_idx) // 36
    start = lines.index(f"    building the index of the train dataset of {prefix}: 500 samples "
                        f"of 16 tokens asked, {len(train)} cut from {epochs} epoch(s) over 36 "
                        "documents, the last shuffled apart ...")
    assert re.fullmatch(rf"      doc_idx: {epochs * 36} entries in \d+\.\d s \(\d+ s so far\), "
                        r"about \d+ s left", lines[start + 1]), lines[start + 1]
    assert re.fullmatch(rf"      sample_idx: {len(train) + 1} rows in \d+\.\d s \(\d+ s so far"
                        r"\), about \d+ s left", lines[start + 2]), lines[start + 2]
    assert re.fullmatch(rf"      shuffle_idx: {len(train)} samples in \d+\.\d s \(\d+ s so "
                        r"far\); writing the files", lines[start + 3]), lines[start + 3]
    assert lines[start + 4].startswith(f"    train dataset of {prefix}: ")
    assert any(x.startswith("    building the index of the validation dataset") for x in lines)
    lines.clear()
    build_train_valid_test_datasets(*args, log=lines.append)
    assert not any("building the index" in x for x in lines), lines
    monkeypatch.undo()
    lines.clear()
    build_train_valid_test_datasets(*args[:-1], str(tmp_path / "other"), log=lines.append)
    assert not any("building the index" in x for x in lines), lines
