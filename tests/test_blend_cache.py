"""Blending indices are cached where the members' GPT indexes are (blend_cache.py): read
back byte for byte, keyed by exactly what determines them, built by one rank, and a long
build reports its progress."""
from __future__ import annotations

import errno
import os
import pickle
import re

import numpy as np
import pytest

from megatron.core.datasets import blend_cache, blend_lanes, blended
from megatron.core.datasets.blend_cache import blend_key
from megatron.core.datasets.blended import (
    BLENDING_INDEX_VERSION,
    BlendedDataset,
    ProgressLine,
    build_blending_indices,
    normalised_weights,
)
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from tests.dist_utils import run_distributed
from tests.test_gpt_dataset import make_corpus

SPLIT = "90,10,0"


def _corpora(tmp_path):
    (tmp_path / "data").mkdir(exist_ok=True)
    a, _ = make_corpus(tmp_path / "data" / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "data" / "b", [17] * 60, seed=2)
    c, _ = make_corpus(tmp_path / "data" / "c", [23] * 50, seed=3)
    return a, b, c


def _blend_files(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.startswith("blend-"))


def test_a_large_blend_is_cached_beside_the_data_and_read_back_byte_for_byte(
        tmp_path, monkeypatch):
    """Without --data-cache-path a blend of BLEND_CACHE_MIN_SAMPLES or more is written into
    `index-cache/` beside its first member's data (where the GPT indexes go); the next
    start reads it (memory-mapped) instead of building it, the very bytes a fresh build
    gives. A smaller blend is not cached (it builds in about a second)."""
    a, b, c = _corpora(tmp_path)
    monkeypatch.setattr(blended, "BLEND_CACHE_MIN_SAMPLES", 150)
    path, counts = ["0.2", a, "0.5", b, "0.3", c], [200, 20, 0]
    lines = []
    first, small, _ = build_train_valid_test_datasets(path, SPLIT, counts, 16, 7, log=lines.append)
    where = tmp_path / "data" / "index-cache"
    assert first.build_s is not None and first.cache_paths["key"].startswith(str(where))
    assert small.cache_paths is None  # 21 samples: kept in memory
    assert len(_blend_files(where)) == 3
    assert f" > blendable dataset indices written to {first.cache_paths['key'][:-4]}" \
           "{.dsc,_index.npy,_sample_index.npy}" in lines
    lines.clear()
    again = build_train_valid_test_datasets(path, SPLIT, counts, 16, 7, log=lines.append)[0]
    assert again.build_s is None and again.cache_paths == first.cache_paths
    assert isinstance(again.dataset_index, np.memmap)
    assert not [x for x in lines if x.startswith("> building indices for blendable datasets "
                                                 "... (--data-path (train)")], lines
    assert f" > blendable dataset indices read from {first.cache_paths['key'][:-4]}" \
           "{.dsc,_index.npy,_sample_index.npy}" in lines
    index, sample = build_blending_indices(normalised_weights([0.2, 0.5, 0.3]), len(first))
    assert again.dataset_index.tobytes() == index.tobytes()
    assert again.dataset_sample_index.tobytes() == sample.tobytes()
    assert [again[i]["text"].tolist() for i in range(len(again))] == \
        [first[i]["text"].tolist() for i in range(len(first))]


def test_the_key_names_the_exact_weights_the_size_and_the_builder_version():
    w = normalised_weights([1, 2, 3])
    key = blend_key(w, 1000, BLENDING_INDEX_VERSION)
    assert key == blend_key(w.copy(), 1000, BLENDING_INDEX_VERSION)
    last_bit = w.copy()
    last_bit[0] = np.nextafter(w[0], 1.0)
    others = [blend_key(last_bit, 1000, BLENDING_INDEX_VERSION),
              blend_key(w[[1, 0, 2]], 1000, BLENDING_INDEX_VERSION),
              blend_key(w, 1001, BLENDING_INDEX_VERSION),
              blend_key(w, 1000, BLENDING_INDEX_VERSION + 1)]
    assert len({key, *others}) == 5


def test_weights_that_print_alike_get_their_own_blend(tmp_path):
    """Megatron names a blend cache by its description, whose weights are printed to 8
    digits: `1 A 1 B` and `0.499999999999 A 0.500000000001 B` shared one name and the
    second run read the first's blend (which starts with A, the second's with B). The key
    holds the exact weights."""
    a, b, _ = _corpora(tmp_path)
    cache = str(tmp_path / "cache")
    equal = build_train_valid_test_datasets(["1", a, "1", b], SPLIT, [200, 0, 0], 16, 7, cache)
    close = build_train_valid_test_datasets(["0.499999999999", a, "0.500000000001", b], SPLIT,
                                            [200, 0, 0], 16, 7, cache)
    assert equal[0].dataset_index[0] == 0 and close[0].dataset_index[0] == 1
    for blend in (equal[0], close[0]):
        want = build_blending_indices(blend.weights, len(blend))[0]
        assert blend.dataset_index.tobytes() == want.tobytes()
    assert len(_blend_files(cache)) == 6


def _builds_once(rank, world_size, path, cache, barrier_timeout_s):
    import torch.distributed as dist

    from megatron.core.datasets import blended as module

    module.BLEND_CACHE_MIN_SAMPLES = 150
    builds = []
    real = module.build_blending_indices
    module.build_blending_indices = lambda *a, **k: builds.append(a[1]) or real(*a, **k)
    lines = []
    train, valid, _ = build_train_valid_test_datasets(
        path, SPLIT, [200, 20, 0], 16, 7, cache, is_builder_rank=rank == 0,
        barrier=dist.barrier, log=lines.append if rank == 0 else None,
        barrier_timeout_s=barrier_timeout_s)
    return {"builds": builds, "index": train.dataset_index.tobytes(),
            "paths": train.cache_paths, "memmap": isinstance(train.dataset_index, np.memmap),
            "valid": valid.dataset_index.tobytes(), "lines": lines}


@pytest.mark.parametrize("with_cache_dir", [False, True])
def test_two_ranks_build_a_cached_blend_once(tmp_path, with_cache_dir):
    """Global rank 0 builds and writes the blend before the barrier; rank 1 waits and
    reads the file (every rank built it after the barrier when no --data-cache-path was
    given). Rank 0 logs each blend once (with a cache dir it logged the ratios again after
    the barrier). The small validation blend is cached only in the cache dir; without
    one it stays in memory, built by both ranks."""
    a, b, c = _corpora(tmp_path)
    cache = str(tmp_path / "cache") if with_cache_dir else None
    out = run_distributed(_builds_once, 2, ["0.2", a, "0.5", b, "0.3", c], cache, 600.0)
    size = len(np.frombuffer(out[0]["index"], dtype=np.uint8))
    small = len(np.frombuffer(out[0]["valid"], dtype=np.uint8))
    assert sorted(out[0]["builds"]) == sorted([size, small])
    assert out[1]["builds"] == ([] if with_cache_dir else [small])
    assert out[0]["index"] == out[1]["index"] and out[0]["valid"] == out[1]["valid"]
    assert out[0]["paths"] == out[1]["paths"] and out[1]["memmap"]
    where = cache or str(tmp_path / "data" / "index-cache")
    assert out[1]["paths"]["key"].startswith(where)
    ratios = [x for x in out[0]["lines"] if x.startswith(" > blended dataset for")]
    assert len(ratios) == 2 and len(set(ratios)) == 2, out[0]["lines"]


def test_a_blend_too_long_to_wait_for_is_built_by_every_rank_and_written_once(tmp_path):
    """A blend whose build would outlast half the barrier's timeout (the other ranks'
    collective would time out waiting for global rank 0) is built by every rank after
    the barrier (rank 1 reads rank 0's files if they are there by then), rank 0 writing
    it; the next start reads it on both ranks."""
    a, b, c = _corpora(tmp_path)
    path = ["0.2", a, "0.5", b, "0.3", c]
    first = run_distributed(_builds_once, 2, path, None, 1e-4)
    size = len(np.frombuffer(first[0]["index"], dtype=np.uint8))
    assert size in first[0]["builds"] and first[0]["paths"] is not None
    # rank 1 built its own, or read rank 0's files when they were already written
    assert (size in first[1]["builds"]) == (first[1]["paths"] is None)
    assert first[0]["index"] == first[1]["index"]
    assert (" > --data-path (train): about 0 s to blend 203 samples, longer than the other ranks "
            "may wait (half of --distributed-timeout-minutes): every rank builds them after "
            "the barrier; global rank 0 writes them to "
            f"{tmp_path / 'data' / 'index-cache'} for later runs") in first[0]["lines"]
    again = run_distributed(_builds_once, 2, path, None, 1e-4)
    assert size not in again[0]["builds"] and size not in again[1]["builds"]
    assert again[1]["paths"] == first[0]["paths"] and again[1]["index"] == first[0]["index"]


def test_progress_comes_in_blocks_for_every_builder(monkeypatch):
    """Each builder (one, two, a few, many datasets) reports the samples built so far in
    blocks, increasing, up to all of them; the result is the same as without."""
    monkeypatch.setattr(blended, "_FLUSH", 1000)
    monkeypatch.setattr(blended, "_LOOP_CHUNK", 1000)
    monkeypatch.setattr(blend_lanes, "LANES", 1)  # one stretch of 1000 or so a batch
    monkeypatch.setattr(blend_lanes, "_STRETCH_MAX", 1000)
    for num in (2, 5, blended.LANES_MIN + 1):
        w = normalised_weights(np.arange(1, num + 1))
        seen = []
        got = build_blending_indices(w, 5500, seen.append)
        assert seen == sorted(seen) and seen[-1] == 5500 and len(seen) >= 3, (num, seen)
        for x, y in zip(got, build_blending_indices(w, 5500)):
            assert x.tobytes() == y.tobytes()


def test_the_progress_line_is_throttled_and_says_count_rate_and_time_left():
    lines = []
    clock = iter([0.0, 4.0, 11.0, 12.0, 25.0])
    progress = ProgressLine(lines.append, 1000, clock=lambda: next(clock))  # started at 0 s
    for done in (100, 300, 350, 700):  # at 4, 11, 12 and 25 s
        progress(done)
    assert lines == ["    blending indices: 300 of 1000 samples (30%), 0.00 M samples/s, "
                     "about 26 s left",
                     "    blending indices: 700 of 1000 samples (70%), 0.00 M samples/s, "
                     "about 11 s left"]


def test_a_long_build_logs_progress_on_the_builder_rank(tmp_path, monkeypatch):
    a, b, c = _corpora(tmp_path)
    monkeypatch.setattr(blended, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(blended, "_LOOP_CHUNK", 50)
    lines = []
    build_train_valid_test_datasets(["0.2", a, "0.5", b, "0.3", c], SPLIT, [200, 0, 0], 16, 7,
                                    log=lines.append)
    progress = [x for x in lines if x.startswith("    blending indices:")]
    assert len(progress) >= 3, lines
    assert all(re.fullmatch(r"    blending indices: \d+ of 203 samples \(\d+%\), [\d.]+ M "
                            r"samples/s, about \d+ s left", x) for x in progress), progress


def test_a_cached_blend_pickles_without_its_arrays(tmp_path):
    """Loader workers that are spawned get the blend pickled: a cached one maps its files
    again instead of carrying the arrays (and its log hooks, closures, do not go along)."""
    a, b, c = _corpora(tmp_path)
    train = build_train_valid_test_datasets(["0.2", a, "0.5", b, "0.3", c], SPLIT,
                                            [2000, 0, 0], 16, 7, str(tmp_path / "cache"),
                                            log=lambda line: None)[0]
    data = pickle.dumps(train)
    assert len(data) < len(pickle.dumps(np.array(train.dataset_sample_index)))
    copy = pickle.loads(data)
    assert copy.dataset_index.tobytes() == train.dataset_index.tobytes()
    assert copy[5]["text"].tolist() == train[5]["text"].tolist()


def test_a_blend_built_in_memory_is_unchanged(tmp_path):
    """No cache: the blend builds in memory, as before (the members are any datasets)."""
    class Member:
        desc = "member"

        def __len__(self):
            return 10_000

    blend = BlendedDataset([Member(), Member()], [1, 3], 1000)
    assert blend.cache_paths is None and blend.build_s is not None
    assert blend.dataset_index.tobytes() == \
        build_blending_indices(normalised_weights([1, 3]), 1000)[0].tobytes()


@pytest.mark.parametrize("error, fix", [
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "your disk quota there is full: free space "
     "within it (it needs 17.7 KiB), or pass --data-cache-path with a directory on a disk with "
     "room in your quota to keep them"),
    (PermissionError(errno.EACCES, "Permission denied"), "pass a writable --data-cache-path "
     "to keep them")])
def test_a_full_disk_while_writing_a_blend_says_to_free_space(tmp_path, monkeypatch, error,
                                                              fix):
    """The warning said 'pass a writable --data-cache-path' for a full disk or quota too."""
    a, b, _ = _corpora(tmp_path)

    def fail(path, array):
        raise error

    monkeypatch.setattr(blend_cache, "save_npy", fail)
    with pytest.warns(UserWarning, match="cannot write the blending index cache") as record:
        build_train_valid_test_datasets(["0.2", a, "0.5", b], SPLIT, [2000, 0, 0], 16, 7,
                                        str(tmp_path / "cache"), log=lambda line: None)
    texts = [str(w.message) for w in record if "blending index cache" in str(w.message)]
    assert len(texts) == 1 and texts[0].endswith(f"built again at every start; {fix}"), texts


def test_the_driver_gives_the_builder_the_barrier_timeout(tmp_path, monkeypatch):
    """build_datasets passes --distributed-timeout-minutes on: how long the other ranks'
    barrier waits for global rank 0's builds."""
    import dataclasses

    from megatron.core.datasets import gpt_dataset
    from megatron.data_loading import build_datasets
    from tests.gpt_helpers import tiny_config

    a, _, _ = _corpora(tmp_path)
    seen = {}
    monkeypatch.setattr(gpt_dataset, "build_train_valid_test_datasets",
                        lambda *args, **kwargs: seen.update(kwargs) or (None, None, None))
    config = tiny_config()
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, mock_data=False, data_path=[a]),
        parallel=dataclasses.replace(config.parallel, distributed_timeout_minutes=7))
    build_datasets(config, 0, 128)
    assert seen["barrier_timeout_s"] == 420.0
