"""Files a user may have downloaded or been handed (a checkpoint, a Hugging Face directory,
a dataset directory with its index cache, a YAML config) never run code when read: each
loading path is given a pickle whose unpickling would create a marker file, and must
refuse it with a message naming the file, and leave no marker."""
from __future__ import annotations

import argparse
import os
import pickle
import re
import shlex

import numpy as np
import pytest
import torch

from megatron.checkpoint_files import load_checkpoint_file
from megatron.checkpointing import read_checkpoint_file
from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
from megatron.hf_files import load_hf_checkpoint
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


def _write_rank_file(root, payload, **save_kw) -> str:
    """A checkpoint under `root` (tracker 1) whose one rank file holds `payload`."""
    path = os.path.join(root, "iter_0000001", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    torch.save(payload, path, **save_kw)
    return path


def _payloads(marker):
    """This framework's payload, Megatron-LM's (an argparse.Namespace: the allow-list's
    second attempt) with the gadget inside the Namespace, and the legacy (non-zip) format."""
    for kind in PAYLOADS:
        gadget = kind(marker)
        yield {"model": {"w": torch.zeros(2)}, "x": gadget}, {}
        yield {"args": argparse.Namespace(num_layers=2, x=gadget),
               "checkpoint_version": 3.0}, {}
        yield {"x": gadget}, {"_use_new_zipfile_serialization": False}


def _readers():
    from megatron.checkpoint_reshard import load_shard

    return [read_checkpoint_file,  # training --load, distrib_optim.pt, generate, the server
            load_shard,  # reshard / checkpoint_util: memory-mapped
            load_checkpoint_file]  # checkpoint_convert to-megatron


@pytest.mark.parametrize("reader", range(3))
def test_checkpoint_files_refuse_pickled_code(tmp_path, marker, reader):
    read = _readers()[reader]
    for i, (payload, kw) in enumerate(_payloads(marker)):
        path = _write_rank_file(str(tmp_path / f"ck{i}"), payload, **kw)
        with pytest.raises(SystemExit) as exc:
            read(path)
        text = str(exc.value.code)
        assert re.search(rf"{re.escape(path)} holds a pickled (posix\.system|io\.open), "
                         "which is not plain data", text), text
        assert "weights_only` set to `False`" not in text  # torch's advice is not ours


def test_generation_refuses_a_checkpoint_with_pickled_code(tmp_path, marker):
    """tools/generate.py and the text generation server load through the same reader."""
    from tools.generate import load_model

    root = str(tmp_path / "ck")
    path = _write_rank_file(root, {"args": argparse.Namespace(num_layers=2),
                                   "checkpoint_version": 3.0, "x": RunsCommand(marker)})
    with pytest.raises(SystemExit, match=rf"{path} holds a pickled posix\.system"):
        load_model(root, None, torch.device("cpu"), torch.float32)


def test_a_raw_pickle_is_not_called_damaged_with_torchs_advice(tmp_path, marker):
    path = _write_rank_file(str(tmp_path / "ck"), {})
    with open(path, "wb") as f:
        pickle.dump(RunsCommand(marker), f)
    with pytest.raises(SystemExit) as exc:
        read_checkpoint_file(path)
    assert "weights_only" not in str(exc.value.code), exc.value.code


@pytest.mark.parametrize("kind", PAYLOADS)
def test_hugging_face_bin_weights_refuse_pickled_code(tmp_path, marker, kind):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}')
    torch.save({"w": torch.zeros(2), "x": kind(marker)}, hf / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin holds a pickled .*not only "
                                         r"tensors.*not loaded"):
        load_hf_checkpoint(str(hf))


def test_from_hf_cli_refuses_it(tmp_path, marker, capsys):
    from tools import checkpoint_convert

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}')
    torch.save({"x": RunsCommand(marker)}, hf / "pytorch_model.bin")
    with pytest.raises(SystemExit) as exc:
        checkpoint_convert.main(["from-hf", "--input", str(hf), "--save",
                                 str(tmp_path / "out")])
    assert str(exc.value.code).startswith(f"error: --input {hf}/pytorch_model.bin holds a "
                                          "pickled posix.system")


def test_yaml_config_tags_are_not_constructed(tmp_path, marker):
    from megatron.arguments import ArgumentsError, parse_args

    path = tmp_path / "run.yaml"
    path.write_text(f"num-layers: !!python/object/apply:os.system [touch {marker}]\n")
    with pytest.raises(ArgumentsError, match="not valid YAML"):
        parse_args(["--config", str(path)])


def _alias_bomb(levels: int) -> str:
    """A 'billion laughs' config: each anchor a list of nine aliases of the one before."""
    nodes = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    nodes += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "data-path: [" + ", ".join(nodes) + "]\n"


@pytest.mark.parametrize("text", [_alias_bomb(7), "data-path: &a [x, *a]\n"],
                         ids=["nested", "self-referring"])
def test_yaml_config_alias_bombs_are_refused_naming_the_file(tmp_path, text):
    from megatron.arguments import ArgumentsError, parse_args

    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    with pytest.raises(ArgumentsError) as err:
        parse_args(["--config", str(path)])
    assert f"--config {path}: its YAML aliases" in err.value.message
    assert "100000 values" in err.value.message


def test_yaml_config_a_few_aliases_still_work(tmp_path):
    from megatron.arguments import parse_args

    path = tmp_path / "shared.yaml"
    path.write_text("lr: &lr 0.0003\nmin-lr: *lr\n")
    args = parse_args(["--config", str(path)])[0]
    assert args.lr == args.min_lr == 0.0003


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


@pytest.mark.parametrize("form", ["pickle", "object_array"])
def test_blend_cache_files_are_never_unpickled(tmp_path, marker, form):
    """A blend's cache is a function of its key alone: a file under its name that is not
    its integers (here a pickle, or an .npy of objects) is passed over with a warning, never
    unpickled, and the blend written again in its place."""
    a, _ = make_corpus(tmp_path / "a", [30] * 40, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 60, seed=2)
    cache = tmp_path / "cache"
    args = (["0.3", a, "0.7", b], "90,10,0", [200, 20, 0], 16, 7, str(cache))
    train = build_train_valid_test_datasets(*args)[0]
    want = np.array(train.dataset_index)
    path = train.cache_paths["index"]
    if form == "pickle":
        _replace_with_pickle(path, RunsCommand(marker))
    else:
        np.save(path, np.array([RunsCommand(marker), 1], dtype=object), allow_pickle=True)
    why = "not a .npy array file" if form == "pickle" else "holds Python objects"
    with pytest.warns(UserWarning, match=rf"ignoring the blending index cache .*{path}: {why}"):
        again = build_train_valid_test_datasets(*args)[0]
    np.testing.assert_array_equal(again.dataset_index, want)
    np.testing.assert_array_equal(np.load(path, allow_pickle=False), want)


def test_an_object_array_in_the_cache_is_refused(tmp_path, marker):
    """An .npy of dtype object is pickled data too (its elements are unpickled)."""
    (tmp_path / "data").mkdir()
    prefix, _ = make_corpus(tmp_path / "data" / "c", [20] * 30)
    train, _, _ = build_train_valid_test_datasets([prefix], "98,2,0", [10, 2, 0], 8, 1)
    path = train.cache_paths["sample"]
    np.save(path, np.array([RunsCommand(marker), 1], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=rf"{path} is not an array of integers"):
        build_train_valid_test_datasets([prefix], "98,2,0", [10, 2, 0], 8, 1)
