"""The first minutes of a large run: global rank 0 builds the GPT index while the others wait.

At hundreds of millions of samples the build takes minutes. It printed nothing meanwhile,
and the other ranks waited in a barrier bounded by --distributed-timeout-minutes: a build
that outlasted it ended a healthy run in the watchdog ("ranks that did not arrive: [0]").
"""
from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest

from megatron.core.datasets import gpt_dataset
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.index_build_wait import IndexBuildWait
from tests.dist_utils import run_distributed
from tests.gpt_helpers import tiny_config


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


class _Killed(BaseException):
    """Stands for global rank 0's end in the middle of its build."""


def _slow_build_worker(rank, world_size, prefix, cache, delay_s, builder_dies):
    """build_datasets under a watchdog of 1 s (--distributed-timeout-minutes, scaled
    down) with global rank 0's build slowed by `delay_s`; with `builder_dies` rank 0
    sends no heartbeat and leaves during its build. What each rank ended with."""
    import torch.distributed as dist

    from megatron import index_build_wait
    from megatron.data_loading import build_datasets
    from megatron.watchdog import build_watchdog, close_current

    index_build_wait.HEARTBEAT_S = index_build_wait.POLL_S = 0.1
    real = gpt_dataset.build_index_arrays

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        if builder_dies:
            raise _Killed()
        return real(*args, **kwargs)

    gpt_dataset.build_index_arrays = slow
    if builder_dies and rank == 0:
        IndexBuildWait.start = lambda self: None
    config = tiny_config(world_size=world_size, mbs=1, gbs=world_size)
    data = dataclasses.replace(config.data, mock_data=False, data_path=[prefix], split="1",
                               data_cache_path=cache)
    parallel = dataclasses.replace(config.parallel, distributed_timeout_minutes=1 / 60)
    config = dataclasses.replace(config, data=data, parallel=parallel)
    group = dist.new_group(backend="gloo")
    build_watchdog(1.0)
    began = time.monotonic()
    try:
        datasets = build_datasets(config, rank, 128, group)
        return {"samples": len(datasets["train"]), "took": time.monotonic() - began}
    except _Killed:
        return {"killed": True}
    except SystemExit as e:
        return {"exit": str(e.code), "took": time.monotonic() - began}
    finally:
        close_current()


def test_a_build_longer_than_the_timeout_is_waited_for(tmp_path):
    """Rank 0's build outlasts the timeout (a watchdog of 1 s) several times over: the
    other rank waits for it (rank 0's heartbeat comes) and both have their datasets."""
    prefix = _corpus(str(tmp_path / "corpus"))
    out = run_distributed(_slow_build_worker, 2, prefix, str(tmp_path / "cache"), 4.0, False)
    assert out[0]["samples"] == out[1]["samples"] > 0, out
    assert out[1]["took"] >= 4.0, out


def test_a_builder_that_stops_beating_ends_the_wait_naming_it(tmp_path):
    """Rank 0 stops in its build (no heartbeat): rank 1 leaves with a message naming
    global rank 0 soon after the bound (1 s here), not at the end of rank 0's 8 s."""
    prefix = _corpus(str(tmp_path / "corpus"))
    out = run_distributed(_slow_build_worker, 2, prefix, str(tmp_path / "cache"), 8.0, True)
    assert out[0] == {"killed": True}
    message = out[1]["exit"]
    assert message.startswith("error: [rank 1] stopped waiting for global rank 0 to build the "
                              "dataset index files: its heartbeat stopped "), message
    assert "global rank 0's output says why" in message and out[1]["took"] < 6, out


class _Store:
    """A store whose calls fail as a store whose host is gone does."""

    def add(self, key, value):
        if key.endswith("/heartbeat"):
            raise RuntimeError("Connection reset by peer\nmore")
        return 1

    def check(self, keys):
        return False


def test_a_store_gone_with_rank_0_ends_the_wait_naming_it():
    wait = IndexBuildWait(_Store(), 1, 60.0, lambda: None)
    with pytest.raises(SystemExit, match=r"global rank 0 to build the dataset index files: the "
                       r"job's store stopped answering \(Connection reset by peer\): global "
                       r"rank 0 hosted it"):
        wait.barrier()


def test_a_failure_rank_0_recorded_ends_the_wait():
    import torch.distributed as dist

    from megatron.rank_failure import FAILURES_KEY

    store = dist.HashStore()
    store.set(f"{FAILURES_KEY}/1", "0\t\tValueError: bad")
    with pytest.raises(SystemExit, match="a rank recorded a failure"):
        IndexBuildWait(store, 1, 60.0, lambda: None).barrier()


def test_a_waiting_rank_looks_soon_then_backs_off(monkeypatch):
    """A cached index is done at once: the first look comes after 50 ms, not a whole
    poll interval (2 s more start-up on every rank but 0), then the wait backs off."""
    import torch.distributed as dist

    store, sleeps = dist.HashStore(), []
    wait = IndexBuildWait(store, 1, 60.0, lambda: None, poll_s=2.0)

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 8:
            store.set(wait.done_key, b"1")

    monkeypatch.setattr(time, "sleep", sleep)
    wait.barrier()
    assert sleeps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
