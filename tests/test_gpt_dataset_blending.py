"""Blending (megatron/core/datasets/blended.py) vs a loop-based reference written from the
Megatron 23.05 facts: the greedy blending indices, samples per dataset, blended datasets
built by the builder."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from megatron.core.datasets.blended import BlendedDataset, build_blending_indices
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from tests.test_gpt_dataset import make_corpus


def ref_blending(weights, size):
    counts = [0] * len(weights)
    index, sample = [], []
    for s in range(size):
        x = float(max(s, 1))
        errors = [w * x - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))
        index.append(d)
        sample.append(counts[d])
        counts[d] += 1
    return np.array(index), np.array(sample)


def _assert_blend_matches_reference(w, size: int) -> np.ndarray:
    """build_blending_indices(w, size) equals the reference greedy element for element,
    with Megatron's dtypes; the dataset index returned."""
    index, sample = build_blending_indices(w, size)
    r_index, r_sample = ref_blending(list(w), size)
    np.testing.assert_array_equal(index, r_index)
    np.testing.assert_array_equal(sample, r_sample)
    assert index.dtype == np.uint8 and sample.dtype == np.int64
    return index


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.3, 0.7], [0.123, 0.877], [1.0, 3.0],
                                     [0.2, 0.3, 0.5], [5, 1, 1, 2, 3]])
def test_blending_indices_match_reference(weights):
    w = np.array(weights, dtype=np.float64)
    w /= w.sum()
    size = 3000
    index = _assert_blend_matches_reference(w, size)
    np.testing.assert_allclose(np.bincount(index, minlength=len(w)) / size, w, atol=2 / size)


def test_blending_two_datasets_large_random():
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = rng.random(2)
        w /= w.sum()
        _assert_blend_matches_reference(w, 20000)


@pytest.mark.parametrize("num", [32, 40, 61, 254])
def test_blending_many_datasets_matches_reference(monkeypatch, num):
    """From LANES_MIN datasets the lanes builder: exact, ties included (integer weights
    repeat; a weight 0), across many lanes (short stretches: their seams are where the
    sample indices are numbered)."""
    from megatron.core.datasets import blend_lanes, blended

    assert blended.LANES_MIN <= 32
    monkeypatch.setattr(blend_lanes, "_STRETCH_MAX", 101)
    monkeypatch.setattr(blend_lanes, "_BURN_PER_DATASET", 1)
    w = np.random.default_rng(num).integers(0, 6, num).astype(np.float64)
    w[0] = 0.0
    w /= w.sum()
    _assert_blend_matches_reference(w, 5000)


def test_blending_many_datasets_is_not_a_loop_over_them():
    """A blend of 200 datasets costs about what one of 50 does (a Python loop over the
    datasets per sample grew with their number: minutes more for a large corpus of many
    shards). Measured against that loop on the same input, best of two."""
    import time

    from megatron.core.datasets import blended

    w = np.random.default_rng(3).random(200)
    w /= w.sum()
    size = 60000

    def best(fn):  # CPU time of this process: a busy machine does not stretch it
        times = []
        for _ in range(2):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return min(times)

    loop = best(lambda: blended._blending_loop(w, size, np.zeros(200, dtype=np.int64), 0,
                                               np.zeros(size, np.uint8), np.zeros(size, np.int64)))
    ours = best(lambda: build_blending_indices(w, size))
    assert ours < 0.5 * loop, (ours, loop)


@pytest.mark.parametrize("num", [3, 200])
def test_samples_needed_per_dataset(monkeypatch, num):
    """1 + the largest sample taken from each dataset, 0 for one never picked, across
    blocks; what the blend checks its members against."""
    from megatron.core.datasets import blended

    monkeypatch.setattr(blended, "_FLUSH", 251)
    rng = np.random.default_rng(num)
    index = rng.integers(0, num - 1, 7000).astype(np.uint8)  # the last one never picked
    sample = rng.integers(0, 10**6, 7000)
    want = [int(sample[index == d].max()) + 1 if (index == d).any() else 0 for d in range(num)]
    assert blended.samples_needed(index, sample, num).tolist() == want


def test_a_blend_member_too_small_for_its_picks_is_named(tmp_path):
    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2)
    train, _, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "1", [100, 0, 0], 16, 7)
    members = train.datasets
    size = int(len(members[1]) / 0.7) + 20  # b's 70%: more than it has
    assert 0.3 * size < len(members[0])
    with pytest.raises(ValueError, match=rf"blended dataset 1 has {len(members[1])} samples but "
                                         r"the blend needs \d+"):
        BlendedDataset(members, [0.3, 0.7], size)


def test_checking_a_blend_of_many_datasets_is_one_pass():
    """The members' sample counts come from one pass over the blend (it made one per
    dataset: minutes on every rank for a large blend of hundreds of shards). Both are
    timed in this process's CPU time, not wall time: on a busy machine (CI's `-n 2` on
    two cores, other jobs) a time slice lost during the short pass made it look slow."""
    import time

    from megatron.core.datasets import blended

    size, num = 4_000_000, 200
    rng = np.random.default_rng(0)
    index = rng.integers(0, num, size).astype(np.uint8)
    sample = rng.integers(0, 10**6, size)
    start = time.process_time()
    blended.samples_needed(index, sample, num)
    ours = time.process_time() - start
    start = time.process_time()
    for d in range(num):
        int(sample[index == d].max())
    per_dataset = time.process_time() - start
    assert ours < 0.5 * per_dataset, (ours, per_dataset)


def test_blended_datasets(tmp_path):
    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2)
    cache = str(tmp_path / "cache")
    train, valid, test = build_train_valid_test_datasets(["0.3", a, "0.7", b], "90,10,0",
                                                         [200, 20, 0], 16, 7, cache)
    assert test is None
    n_a, n_b = math.ceil(200 * 0.3 * 1.005), math.ceil(200 * 0.7 * 1.005)
    assert len(train) == n_a + n_b
    assert train.datasets[0].desc.startswith(f"GPT Dataset\n\nData prefix {a}\n")
    assert "Number of samples %d\n" % n_a in train.datasets[0].desc
    np.testing.assert_allclose(train.achieved_weights(), [0.3, 0.7], atol=0.01)
    for i in (0, 1, 2, 57, len(train) - 1):
        item = train[i]
        d = item["dataset_idx"]
        member = train.datasets[d][int(train.dataset_sample_index[i])]
        np.testing.assert_array_equal(item["text"], member["text"])
    assert any(name.endswith("_sample_index.npy") for name in os.listdir(cache))
    with pytest.raises(IndexError):
        train[len(train)]
    # separate paths: split ignored, all documents used; a weighted list blends.
    tr, va, te = build_train_valid_test_datasets(None, "969,30,1", [50, 10, 5], 16, 7, cache,
                                                 train_data_path=["1", a, "1", b],
                                                 valid_data_path=[b], test_data_path=None)
    assert isinstance(tr, BlendedDataset) and te is None
    assert len(va.doc_idx) % 60 == 0 and va.name == "valid"
