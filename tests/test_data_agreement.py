"""Dataset errors under several ranks: every rank stops together, the report printed once.

build_datasets used to raise SystemExit on each failing rank by itself: every rank printed
the same error, and a rank that failed alone (an index cache directory on a node-local
disk, which only global rank 0's node sees) left the others waiting in their next
collective until the timeout.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.data_loading import build_datasets
from tests.dist_utils import run_distributed
from tests.gpt_helpers import tiny_config


def _write_corpus(prefix: str) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in range(12):
        builder.add_item(np.arange(doc, doc + 20) % 100)
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _build_worker(rank, world_size, prefix, cache_dirs, unreadable=None):
    """build_datasets with this rank's --data-cache-path; what it raised. `unreadable`:
    "open" or "mmap" of the `.bin` fails as it would without read permission."""
    import torch.distributed as dist

    if unreadable is not None:
        _make_bin_unreadable(unreadable)
    config = tiny_config(world_size=world_size, mbs=1, gbs=world_size)
    data = dataclasses.replace(config.data, mock_data=False, data_path=[prefix], split="1",
                               data_cache_path=cache_dirs[rank])
    config = dataclasses.replace(config, data=data)
    group = dist.new_group(backend="gloo")
    try:
        build_datasets(config, rank, 128, group)
    except SystemExit as e:
        return {"code": e.code, "report": getattr(e, "report", None)}
    return {"code": None, "report": None}


def _make_bin_unreadable(how: str) -> None:
    """Opening (the error names the file, as open's does) or mapping (mmap's names none)
    a `.bin` raises PermissionError: the tests run as root, who may read any file."""
    import builtins

    from megatron.core.datasets import indexed_dataset

    def fake_open(path, *args, **kwargs):
        if str(path).endswith(".bin"):
            raise PermissionError(13, "Permission denied", path)
        return builtins.open(path, *args, **kwargs)

    def fake_mmap(fileno, *args, **kwargs):
        if indexed_dataset.os.readlink(f"/proc/self/fd/{fileno}").endswith(".bin"):
            raise PermissionError(13, "Permission denied")
        return real_mmap(fileno, *args, **kwargs)

    if how == "open":
        indexed_dataset.open = fake_open
    else:
        real_mmap = indexed_dataset.mmap.mmap
        indexed_dataset.mmap.mmap = fake_mmap


@pytest.mark.parametrize("how", ["open", "mmap"])
def test_an_unreadable_data_file_stops_every_rank_with_one_report(tmp_path, how):
    """A .bin the ranks may not read (an OSError, not a missing file) is the same one-line
    report naming the file and the error, not an uncaught traceback on every rank."""
    prefix = str(tmp_path / "corpus")
    _write_corpus(prefix)
    results = run_distributed(_build_worker, 2, prefix, [str(tmp_path / "cache")] * 2, how)
    report = results[0]["report"]
    assert results[0]["code"] == report and results[1] == results[0] | {"code": 1}, results
    assert report == ("error: could not build the datasets: [Errno 13] Permission denied: "
                      f"'{prefix}.bin'"), report


@pytest.mark.parametrize("case", ["node_local_cache", "builder_fails", "all_fail"])
def test_a_data_error_stops_every_rank_with_one_report(tmp_path, case):
    prefix = str(tmp_path / "data" / "corpus")
    (tmp_path / "data").mkdir()
    _write_corpus(prefix)
    (tmp_path / "a_file").write_text("")
    cache_dirs = {  # per rank
        "node_local_cache": [str(tmp_path / "node0"), str(tmp_path / "node1")],
        "builder_fails": [str(tmp_path / "a_file")] * 2,
        "all_fail": [str(tmp_path / "cache")] * 2,
    }[case]
    if case == "all_fail":
        prefix = str(tmp_path / "data" / "nothing")
    results = run_distributed(_build_worker, 2, prefix, cache_dirs)
    report = results[0]["report"]
    assert results[0]["code"] == report and results[1]["code"] == 1, results
    assert results[1]["report"] == report
    assert report.count("error: could not build the datasets") == 1, report
    if case == "node_local_cache":  # rank 0 built into its own disk; rank 1 cannot see it
        assert report.startswith("rank 1 (of 2): error: could not build the datasets: index "
                                 f"files {tmp_path / 'node1'}/"), report
        assert (f"{tmp_path / 'node1'} must be a directory that every node sees (shared "
                "storage, not a node-local disk such as /tmp); pass a --data-cache-path that "
                "all nodes share") in report
    elif case == "builder_fails":  # rank 1's missing files follow from rank 0's failure
        assert report.startswith("rank 0 (of 2): error: could not build the datasets: cannot "
                                 "write the dataset index cache"), report
        assert "missing on this rank" not in report
    else:  # the same error on every rank: no rank list
        assert report.startswith("error: could not build the datasets: "
                                 f"{prefix}.idx: no such file"), report
