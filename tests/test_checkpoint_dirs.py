"""A --load that points somewhere inside a checkpoint, at a file, or at a Hugging Face model
directory (megatron/checkpoint_dirs.misplaced_load_message): training, the zero-shot
evaluation and every conversion tool stop with the directory to pass instead, quoted for
the shell when it has a space. Training started from random weights for all but the
iteration directory (Megatron-LM's missing-tracker warning), and the tools said only that
no tracker file was there."""
from __future__ import annotations

import os
import shlex

import pytest
import torch

from megatron.checkpoint_dirs import (
    checkpoint_name,
    missing_tracker_message,
    refuse_untracked_checkpoints,
)
from tools import checkpoint_util


@pytest.fixture()
def ckpt(tmp_path):
    """A checkpoint directory with a space in its path (iteration 4, pp 2) and a Hugging
    Face model directory."""
    root = str(tmp_path / "my runs" / "gpt")
    for pp_rank in (0, 1):
        path = checkpoint_name(root, 4, 0, pp_rank, 2)
        os.makedirs(os.path.dirname(path))
        torch.save({"args": {}, "iteration": 4}, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    return root, str(hf)


def _refusal(path: str) -> str:
    with pytest.raises(SystemExit) as err:
        refuse_untracked_checkpoints(path)
    assert missing_tracker_message(path) in str(err.value)
    return str(err.value)


def test_a_missing_load_with_an_unexpanded_tilde_names_the_fix(tmp_path, monkeypatch):
    """tools/generate.py --load "~/ckpt" (quoted) said only that nothing is there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/me")
    assert missing_tracker_message("~/ckpt").endswith(
        "holds no iter_XXXXXXX or release directory; '~' was not expanded to a home directory "
        "(the shell does that only for an unquoted ~ starting a word, not in --flag=~/... or "
        "a --config file): write /home/me/ckpt, or ./~/ckpt for a directory really named '~'")


def test_a_rank_directory_or_a_checkpoint_file_names_the_checkpoint_directory(ckpt):
    root, _ = ckpt
    rank_dir = os.path.dirname(checkpoint_name(root, 4, 0, 1, 2))
    fix = f"--load {shlex.quote(root)}"
    assert fix == f"--load '{root}'"
    assert "is one rank's directory inside a checkpoint" in _refusal(rank_dir)
    assert _refusal(rank_dir).endswith(fix)
    message = _refusal(checkpoint_name(root, 4, 0, 0, 2))
    assert "is a file inside a checkpoint" in message and message.endswith(fix)
    iter_dir = os.path.dirname(rank_dir)
    with pytest.raises(SystemExit, match="iteration directory"):
        refuse_untracked_checkpoints(iter_dir)
    assert missing_tracker_message(iter_dir).endswith(f"{fix} --iteration 4")


def test_another_file_or_a_hugging_face_directory_is_refused(ckpt, tmp_path):
    _, hf = ckpt
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    assert "is a file; --load takes the directory --save wrote" in _refusal(str(notes))
    message = _refusal(hf)
    assert "is a Hugging Face model directory" in message
    assert f"from-hf --input {hf} --save DIR" in message
    refuse_untracked_checkpoints(str(tmp_path / "new"))  # a first launch: no error
    with pytest.raises(SystemExit, match="--load-dir .* is a Hugging Face model directory"):
        checkpoint_util.main(["--model-type", "GPT", "--load-dir", hf,
                              "--save-dir", str(tmp_path / "out")])


def test_an_iteration_directory_without_rank_directories_names_the_other_checkpoints(ckpt):
    """The tracker names an iteration whose mp_rank_* directories are gone (emptied, a
    partial copy): the error names the checkpoints that remain and the tracker line that
    resumes from one (it said only "not a checkpoint")."""
    from megatron.checkpoint_dirs import complete_layout

    root, _ = ckpt
    empty = os.path.join(root, "iter_0000008")
    os.makedirs(empty)
    with pytest.raises(SystemExit) as err:
        complete_layout(empty)
    message = str(err.value)
    assert f"{empty} holds no mp_rank_* directories" in message
    assert "the checkpoints under" in message and "iter_0000004" in message
    assert "printf 4 >" in message


def test_the_parent_of_a_checkpoint_directory_names_the_directory_below(ckpt, tmp_path):
    """--load one level too high (the directory holding the run's checkpoint directory)
    started from random weights with Megatron-LM's missing-tracker warning; a new or empty
    directory, or one holding other things, still starts from scratch."""
    root, _ = ckpt
    parent = os.path.dirname(root)
    message = _refusal(parent)
    assert f"{root} below it has one" in message
    assert message.endswith(f"--load {shlex.quote(root)} (or another --load to start from "
                            "scratch)"), message
    other = tmp_path / "fresh"
    (other / "logs").mkdir(parents=True)
    refuse_untracked_checkpoints(str(other))  # nothing to refuse
    refuse_untracked_checkpoints(str(tmp_path / "new"))


def test_save_spelled_in_other_case_is_still_the_load_directory(tmp_path, monkeypatch):
    """On macOS (a case-insensitive file system) `--load runs/ckpt --save runs/CKPT` is one
    directory: the conversions compared the paths' text, and said only that --save holds a
    checkpoint, so that the --overwrite they suggested replaced the source."""
    from megatron.checkpoint_dirs import same_dir
    from tools import checkpoint_convert

    load, save = tmp_path / "ckpt", tmp_path / "CKPT"
    load.mkdir()
    (load / "latest_checkpointed_iteration.txt").write_text("4")
    real_stat = os.stat

    def case_insensitive_stat(path, *args, **kwargs):  # as APFS finds CKPT
        text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else path
        if isinstance(text, str) and text.startswith(str(save)):
            path = str(load) + text[len(str(save)):]
        return real_stat(path, *args, **kwargs)

    assert not same_dir(str(load), str(save))  # this case-sensitive file system
    monkeypatch.setattr(os, "stat", case_insensitive_stat)
    assert same_dir(str(load), str(save)) and same_dir(str(load), str(load) + "/")
    assert not same_dir(str(load), str(tmp_path / "new")) and not same_dir(None, str(load))
    with pytest.raises(SystemExit, match=f"--save must differ from --load .*: {save} and "
                                         f"{load} name one directory"):
        checkpoint_convert.reshard(str(load), str(save), 1, 1, overwrite=True)
    with pytest.raises(SystemExit, match="--save must differ from --load"):
        checkpoint_convert.to_megatron(str(load), str(save), overwrite=True)
    with pytest.raises(SystemExit, match=f"--save-dir {save} is --load-dir"):
        checkpoint_util.check_save_dir(str(load), str(save))
    assert os.listdir(tmp_path) == ["ckpt"]  # nothing written
    assert os.listdir(load) == ["latest_checkpointed_iteration.txt"]
