"""The blend's index builders against the plain greedy (`_blending_loop`), bit for bit:
the guessed-and-repaired blocks (3 to LANES_MIN - 1 datasets, here forced up to 254)
and the lanes of blend_lanes.py (from LANES_MIN, here forced down to 3), over weights a user
gives."""
import numpy as np
import pytest

from megatron.core.datasets import blend_lanes, blended
from megatron.core.datasets.blended import (
    build_blending_indices,
    normalised_weights,
    parse_weighted_prefixes,
)


def _reference(w: np.ndarray, size: int):
    index, sample = np.zeros(size, np.uint8), np.zeros(size, np.int64)
    blended._blending_loop(w, size, np.zeros(len(w), dtype=np.int64), 0, index, sample)
    return index, sample


def _weights(kind: str, num: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "equal":  # every step a tie
        return normalised_weights(np.ones(num))
    if kind == "integers":  # repeated values: many ties
        return normalised_weights(rng.integers(1, 4, num))
    if kind == "tiny_and_zero":
        w = rng.random(num)
        w[rng.choice(num, max(1, num // 3), replace=False)] = 0.0
        w[rng.choice(np.flatnonzero(w), 1)] = 1e-12
        return normalised_weights(w)
    if kind == "binary":  # exact binary fractions: exact ties between different weights
        w = np.ones(num)
        w[rng.choice(num, num // 3, replace=False)] = 2.0
        w[np.argmax(w)] += 2.0 ** np.ceil(np.log2(w.sum())) - w.sum()  # sum a power of 2
        return normalised_weights(w)
    if kind == "data_path":  # --data-path 0.3 a 0.2 b 0.2 c 0.15 d 0.1 e 0.05 f ...
        base = ["0.3", "0.2", "0.2", "0.15", "0.1", "0.05"]
        args = [x for i in range(num) for x in (base[i % 6], f"shard{i}")]
        return normalised_weights(parse_weighted_prefixes(args)[1])
    return normalised_weights(rng.random(num))


def _assert_same(got, want, what):
    for g, r, name in zip(got, want, ("dataset index", "sample index")):
        assert g.dtype == r.dtype and g.tobytes() == r.tobytes(), (
            f"{what}: {name} differs first at {int(np.flatnonzero(g != r)[0])}")


@pytest.mark.parametrize("num", [3, 5, 24, 100, 254])
@pytest.mark.parametrize("kind", ["random", "equal", "integers", "tiny_and_zero", "data_path"])
def test_blocks_of_guesses_match_the_greedy(monkeypatch, num, kind):
    """Small blocks (many seams), every number of datasets through the guessing builder."""
    monkeypatch.setattr(blended, "_ROTATE_CAP", 4096)
    monkeypatch.setattr(blended, "LANES_MIN", 255)
    rng = np.random.default_rng(num * 7 + len(kind))
    w = _weights(kind, num, rng)
    size = 30000 if num <= 24 else 6000
    _assert_same(build_blending_indices(w, size), _reference(w, size), f"{num} {kind}")


@pytest.mark.parametrize("num", [3, 5, 24, 100, 254])
def test_the_builder_chosen_by_count_matches_the_greedy(num):
    rng = np.random.default_rng(num)
    for kind in ("random", "data_path", "tiny_and_zero"):
        w = _weights(kind, num, rng)
        size = 50000 if num <= 5 else 5000
        _assert_same(build_blending_indices(w, size), _reference(w, size), f"{num} {kind}")


@pytest.mark.parametrize("num", [3, 24, 40, 100, 254])
@pytest.mark.parametrize("kind", ["random", "equal", "integers", "tiny_and_zero", "data_path",
                                  "binary"])
def test_lanes_match_the_greedy(monkeypatch, num, kind):
    """Many short lanes (many seams) whose burns are too short for some to meet the true
    counts (the plain greedy repairs those), every number of datasets, odd sizes."""
    monkeypatch.setattr(blended, "LANES_MIN", 3)
    monkeypatch.setattr(blend_lanes, "_STRETCH_MAX", 97)
    monkeypatch.setattr(blend_lanes, "_BURN_PER_DATASET", 1)
    monkeypatch.setattr(blend_lanes, "_MEET_EVERY", 7)
    monkeypatch.setattr(blend_lanes, "_NUMBERED", 1000)  # sample indices numbered in pieces
    rng = np.random.default_rng(num * 11 + len(kind))
    w = _weights(kind, num, rng)
    size = 30011 if num <= 24 else 8009
    _assert_same(build_blending_indices(w, size), _reference(w, size), f"{num} {kind}")


def test_lanes_that_never_meet_the_true_counts_are_rebuilt(monkeypatch):
    """Guessed counts far off (every lane's): the plain greedy rebuilds the stretches, and
    the burns grow; the result is still the greedy's."""
    monkeypatch.setattr(blend_lanes, "_STRETCH_MAX", 300)
    monkeypatch.setattr(blend_lanes, "_BURN_PER_DATASET", 1)
    monkeypatch.setattr(blend_lanes._Groups, "guessed_totals",
                        lambda self, starts: np.zeros((len(starts), self.count), np.int64))
    rng = np.random.default_rng(9)
    w = _weights("random", 40, rng)
    _assert_same(build_blending_indices(w, 20000), _reference(w, 20000), "far off")


def test_failing_guesses_fall_back_to_the_loop_exactly(monkeypatch):
    """One repair round per block: blocks keep little, the plain loop takes over in turns."""
    monkeypatch.setattr(blended, "_ROTATE_ROUNDS", 1)
    monkeypatch.setattr(blended, "_ROTATE_LOOP", 777)
    rng = np.random.default_rng(5)
    for num in (3, 7, 16):
        w = _weights("random", num, rng)
        _assert_same(build_blending_indices(w, 20000), _reference(w, 20000), f"{num}")


def test_unnormalised_and_all_zero_weights_match_the_greedy():
    for w in ([1.0, 2.0, 3.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0], [0.0, 0.5, 0.5]):
        w = np.array(w)
        _assert_same(build_blending_indices(w, 3000), _reference(w, 3000), f"{w}")
