"""Files a user may have downloaded or been handed (a checkpoint, a Hugging Face directory,
a dataset directory with its index cache, a YAML config) never run code when read: each
loading path is given a pickle whose unpickling would create a marker file, and must
refuse it with a message naming the file, and leave no marker."""
from __future__ import annotations

import os
import pickle
import shlex

import numpy as np
import pytest

from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from tests.test_gpt_dataset import make_corpus


class RunsCommand:
    """Unpickled, runs `touch marker` through os.system (what an attacker would pickle;
    torch's weights_only loader blocks its module outright)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


class OpensFile:
    """Unpickled, creates `marker` through builtins.open (a global torch does not block by
    module, only by not allow-listing it)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


PAYLOADS = [RunsCommand, OpensFile]


@pytest.fixture
def marker(tmp_path):
    path = str(tmp_path / "MARKER")
    yield path
    assert not os.path.exists(path), "the payload ran"


def _replace_with_pickle(path: str, payload) -> None:
    with open(path, "wb") as f:
        pickle.dump(payload, f)


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("key", ["doc", "shuffle"])
def test_index_cache_files_are_never_unpickled(tmp_path, marker, kind, key):
    """A dataset directory shared with its index-cache/ (or a --data-cache-path others can
    write) may hold any file under a cache name: np.load(allow_pickle=True) ran it."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    train, _, _ = build_train_valid_test_datasets([prefix], "98,2,0", [10, 2, 0], 8, 1)
    path = train.cache_paths[key]
    assert path.startswith(str(tmp_path / "data" / "index-cache"))
    _replace_with_pickle(path, kind(marker))
    with pytest.raises(ValueError, match=rf"index cache file {path} is not an array of "
                                         r"integers.*not loaded.*delete it"):
        build_train_valid_test_datasets([prefix], "98,2,0", [10, 2, 0], 8, 1)


def test_blend_cache_files_are_never_unpickled(tmp_path, marker):
    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2)
    cache = tmp_path / "cache"
    args = (["0.3", a, "0.7", b], "90,10,0", [200, 20, 0], 16, 7, str(cache))
    build_train_valid_test_datasets(*args)
    name = next(n for n in os.listdir(cache) if n.endswith("_index.npy"))
    _replace_with_pickle(str(cache / name), RunsCommand(marker))
    with pytest.raises(ValueError, match=rf"{cache / name} is not an array of integers"):
        build_train_valid_test_datasets(*args)


def test_an_object_array_in_the_cache_is_refused(tmp_path, marker):
    """An .npy of dtype object is pickled data too (its elements are unpickled)."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    train, _, _ = build_train_valid_test_datasets([prefix], "98,2,0", [10, 2, 0], 8, 1)
    path = train.cache_paths["sample"]
    np.save(path, np.array([RunsCommand(marker), 1], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=rf"{path} is not an array of integers"):
        build_train_valid_test_datasets([prefix], "98,2,0", [10, 2, 0], 8, 1)
