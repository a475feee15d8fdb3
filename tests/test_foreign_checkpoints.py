"""--load given the checkpoint a user happens to have, written by another program
(megatron/checkpoint_foreign.py; the stand-ins are in tests/foreign_checkpoints.py): one
line naming what it looks like, why it is not read and the command that converts it.

Before, training started from random weights on a NeMo, DeepSpeed or nanoGPT directory or
on Hugging Face weights without config.json (Megatron's missing-tracker warning), and the
tools said only that no tracker file was there; a single such file was 'a file'; a
Megatron-Core distributed checkpoint was 'not a checkpoint'; Megatron-Core's parameter names
in 23.05's layout gave every missing and unexpected key (and the advice to change the model
flags); Megatron-DeepSpeed's tracker was 'fix the tracker file'. The Hugging Face model
directory itself, iteration and rank directories, a directory with iteration directories
and no tracker, and a tracker naming a missing iteration are tests/test_checkpoint_dirs.py's
and tests/test_checkpointing.py's.
"""
from __future__ import annotations

import argparse
import enum
import os
import subprocess
import sys
import types

import pytest
import torch

from megatron.checkpoint_dirs import missing_tracker_message, refuse_untracked_checkpoints
from megatron.checkpoint_files import load_checkpoint_file
from megatron.checkpoint_reshard import inspect_checkpoint, locate_iteration
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.core.parallel_state import ParallelState
from tests import foreign_checkpoints as fc
from tools import checkpoint_util

FROM_HF = "python tools/checkpoint_convert.py from-hf --input"


def _ps1():
    return ParallelState.build(world_size=1, rank=0, create_groups=False)


def _refusal(path) -> str:
    """The message every --load reader gives for `path` (no tracker there): training and
    tasks/main.py (`refuse_untracked_checkpoints`), generate.py and checkpoint_convert.py
    (`missing_tracker_message`), checkpoint_util.py (--load-dir): the same line."""
    path = str(path)
    with pytest.raises(SystemExit) as err:
        refuse_untracked_checkpoints(path)
    text = str(err.value)
    assert text.startswith(f"error: --load {path} ") and "\n" not in text, text
    assert text == f"error: {missing_tracker_message(path)}"
    with pytest.raises(SystemExit) as err:
        checkpoint_util.check_load_dir(path)
    assert str(err.value) == text.replace("--load", "--load-dir"), err.value
    with pytest.raises(SystemExit, match="^error: --load "):  # no fresh start in training
        load_checkpoint(path, _ps1())
    return text


@pytest.mark.parametrize("kind", ["weights-only", "file"])
def test_hugging_face_weights_without_config_json_or_as_one_file(tmp_path, kind):
    hf = fc.hf_dir(tmp_path / "hf", "weights-only" if kind == "weights-only" else "safetensors")
    if kind == "weights-only":
        text = _refusal(hf)
        assert "holds Hugging Face weights (model.safetensors) but no config.json" in text
    else:
        text = _refusal(hf / "model.safetensors")
        assert "is a Hugging Face weights file" in text and "its config.json" in text
    assert text.endswith(f"{FROM_HF} {hf} --save DIR (GPT-2 and Llama models), then --load DIR")


@pytest.mark.parametrize("kind", ["sharded-safetensors", "sharded-bin", "bin"])
def test_sharded_hugging_face_directories_are_named_as_such(tmp_path, kind):
    text = _refusal(fc.hf_dir(tmp_path / "hf", kind))
    assert "is a Hugging Face model directory (config.json and weights)" in text
    file = tmp_path / "hf" / ("pytorch_model.bin.index.json" if kind == "sharded-bin"
                              else "model.safetensors.index.json" if kind.startswith("sharded")
                              else "pytorch_model.bin")
    assert "is a Hugging Face weights file" in _refusal(file)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_megatron_core_distributed_checkpoint(tmp_path, backend):
    root = fc.dist_checkpoint(tmp_path / "ck", backend)
    iter_dir = root / "iter_0000100"
    expected = (f"{iter_dir} is a Megatron-Core distributed checkpoint (--ckpt-format "
                f"{backend}: metadata.json, common.pt")
    readers = [lambda: load_checkpoint(str(root), _ps1()),  # training (through its layout)
               lambda: inspect_checkpoint(locate_iteration(str(root))[0])]  # the tools
    for read in readers:
        with pytest.raises(SystemExit) as err:
            read()
        text = str(err.value)
        assert text.startswith(f"error: {expected}"), text
        assert "--ckpt-convert-format torch output keeps Megatron-Core's parameter names" in text
        assert f"{FROM_HF} HF_DIR --save DIR" in text
    text = _refusal(iter_dir)  # the iteration directory itself
    assert "is a Megatron-Core distributed checkpoint" in text
    assert "takes the directory above" not in text
    assert "is a file of a checkpoint: " in _refusal(iter_dir / "common.pt")


@pytest.mark.parametrize("moe", [False, True])
def test_megatron_core_names_in_the_2305_layout(tmp_path, moe):
    root = fc.mcore_legacy(tmp_path / "ck", moe=moe)
    path = root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(SystemExit) as err:
        load_checkpoint_file(str(path))
    text = str(err.value)
    assert text.startswith(f"error: checkpoint file {path} holds a Megatron-Core GPTModel "
                           "(parameter names such as "), text
    assert "Missing key" not in text and len(text) < 1000, text
    if moe:
        assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight" in text
        assert text.endswith("have no counterpart here (MIGRATING.md, Known gaps), so its "
                             "weights cannot be used here")
    else:
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in text
        assert f"{FROM_HF} HF_DIR --save DIR" in text
    from tools.generate import load_model

    for read in (lambda: load_model(str(root)), lambda: load_checkpoint(str(root), _ps1())):
        with pytest.raises(SystemExit) as again:
            read()
        assert str(again.value) == text


def test_a_training_run_names_megatron_core_names_not_every_key(tmp_path, capsys):
    import pretrain_gpt
    from tests.test_flag_audit import TINY

    root = fc.mcore_legacy(tmp_path / "ck")
    with pytest.raises(SystemExit) as err:
        pretrain_gpt.main(TINY + ["--train-iters", "1", "--load", str(root)])
    text = str(err.value)
    assert "holds a Megatron-Core GPTModel" in text and "Unexpected key" not in text, text
    assert "Run with the model flags" not in text


def test_later_legacy_norm_names(tmp_path):
    names = [n.replace("input_layernorm", "input_norm") for n in fc._layer_names_2305(1)]
    root = fc.megatron_layout(tmp_path / "ck", {n: torch.zeros(2) for n in names})
    with pytest.raises(SystemExit, match="whose norms are named input_norm / "
                                         r"post_attention_norm / final_norm \(language_model"):
        inspect_checkpoint(str(root / "iter_0000002"))


@pytest.mark.parametrize("kind", ["ckpt", "tp2", "dist", "nemo2", "file"])
def test_nemo_models(tmp_path, kind):
    if kind == "file":
        path, evidence = fc.nemo_file(tmp_path / "gpt.nemo"), "a .nemo archive"
    elif kind == "nemo2":
        path, evidence = fc.nemo2_dir(tmp_path / "nemo"), "NeMo 2: context/, weights/"
    else:
        path = fc.nemo_dir(tmp_path / "nemo", kind)
        evidence = "model_config.yaml, " + {"ckpt": "model_weights.ckpt", "tp2":
                                            "mp_rank_00/model_weights.ckpt",
                                            "dist": "model_weights"}[kind]
    text = _refusal(path)
    assert f"is a NeMo model ({evidence}), not a Megatron-LM checkpoint" in text
    assert "`nemo llm export` with target=hf" in text and f"{FROM_HF} HF_DIR" in text


def test_deepspeed_checkpoints(tmp_path):
    root = fc.deepspeed_dir(tmp_path / "ds")
    step = root / "global_step50"
    text = _refusal(root)
    assert ("is a DeepSpeed checkpoint (latest -> global_step50/ with "
            "mp_rank_00_model_states.pt, zero_pp_rank_0_mp_rank_00_optim_states.pt") in text
    assert f"deepspeed_to_megatron.py --input_folder {step} --output_folder DIR" in text
    assert f"{root}/zero_to_fp32.py gathers its weights" in text
    assert "is a DeepSpeed checkpoint" in _refusal(step)
    assert "is a file of a checkpoint: " in _refusal(step / "mp_rank_00_model_states.pt")


def test_megatron_deepspeed_tracker_names_its_global_step(tmp_path):
    """Megatron-DeepSpeed writes latest_checkpointed_iteration.txt beside DeepSpeed's files:
    the tracker is right, the layout is DeepSpeed's (was: 'fix the tracker file')."""
    root = str(fc.deepspeed_dir(tmp_path / "ds", megatron_tracker=True))
    for read in (lambda: load_checkpoint(root, _ps1()), lambda: locate_iteration(root)):
        with pytest.raises(SystemExit) as err:
            read()
        text = str(err.value)
        assert text.startswith(f"error: {root}/latest_checkpointed_iteration.txt names 50, "
                               f"but there is no {root}/iter_0000050: {root} is a DeepSpeed "
                               "checkpoint"), text
        assert "fix the tracker" not in text


def test_nanogpt(tmp_path):
    out = fc.nanogpt_dir(tmp_path / "out")
    text = _refusal(out)
    assert "is a nanoGPT checkpoint (ckpt.pt: model, model_args, iter_num)" in text
    assert "GPT2LMHeadModel" in text and f"{FROM_HF} HF_DIR" in text
    assert "is a nanoGPT checkpoint (model, model_args" in _refusal(out / "ckpt.pt")


@pytest.mark.parametrize("model", ["gpt2", "llama", "other"])
def test_pytorch_lightning_checkpoints(tmp_path, model):
    """A Lightning *.ckpt (found through its pickle's key names, never unpickled), alone, in
    checkpoints/ or in the version directory: training started from random weights on the
    directories, and the file was 'a file'."""
    version = fc.lightning_dir(tmp_path / "version_0", model)
    ckpt = version / "checkpoints" / "epoch=3-step=1200.ckpt"
    what = ("is a PyTorch Lightning checkpoint ({}state_dict, pytorch-lightning_version, "
            "epoch, global_step), not a Megatron-LM one, and no converter here reads it; ")
    for path, where in ((ckpt, ""), (ckpt.parent, "epoch=3-step=1200.ckpt: "),
                        (version, "checkpoints/epoch=3-step=1200.ckpt: ")):
        text = _refusal(path)
        assert f"--load {path} {what.format(where)}" in text, text
        assert text.endswith(f"{FROM_HF} HF_DIR --save DIR (GPT-2 and Llama models), then "
                             "--load DIR")
    shape = {"gpt2": "GPT-2-shaped names (model.transformer.h.0.attn.c_attn.weight, as Hugging "
                     "Face's GPT2LMHeadModel and nanoGPT name them): the closest converter is "
                     "from-hf",
             "llama": "Llama-shaped names (model.model.layers.0.self_attn.q_proj.weight, as "
                      "Hugging Face's LlamaForCausalLM names them)",
             "other": "names are of no model a converter here reads"}[model]
    assert shape in text, text


def test_a_rank_file_alone_and_the_recipe_it_is_given(tmp_path):
    """One model_optim_rng.pt copied out of its checkpoint: the message's commands make a
    directory that loads (as a release checkpoint: its weights, iteration 0)."""
    state = {"model": {"w": torch.ones(2)}, "args": {}, "checkpoint_version": 3.0}
    save_checkpoint(str(tmp_path / "ck"), 3, state, _ps1())
    lone = tmp_path / "model_optim_rng.pt"
    os.rename(tmp_path / "ck" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", lone)
    text = _refusal(lone)
    assert "is one rank's model file of a Megatron-LM-layout checkpoint" in text
    recipe = text.split("): ", 1)[1].split(", then --load DIR")[0]
    new = tmp_path / "new"
    subprocess.run(recipe.replace("DIR", str(new)), shell=True, check=True)
    iteration, state = load_checkpoint(str(new), _ps1())
    assert iteration == 0 and torch.equal(state["model"]["w"], torch.ones(2))


def test_a_class_of_a_later_megatron_lm_is_named_as_such(tmp_path, monkeypatch):
    """A later release pickles classes 23.05 never did (its AttnBackend enum in `args`): not
    unpickled, and named as a later release's instead of as code that could run."""
    mod = types.ModuleType("megatron.core.transformer.enums")
    mod.AttnBackend = enum.Enum("AttnBackend", [("auto", 5)],
                                module="megatron.core.transformer.enums")
    path = tmp_path / "model_optim_rng.pt"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "megatron.core.transformer.enums", mod)
        torch.save({"args": argparse.Namespace(attention_backend=mod.AttnBackend.auto),
                    "checkpoint_version": 3.0, "model": {}}, path)
    with pytest.raises(SystemExit) as err:
        load_checkpoint_file(str(path))
    text = str(err.value)
    assert "holds a pickled megatron.core.transformer.enums.AttnBackend" in text, text
    assert "written by a later release" in text and "could run any code" not in text


def test_an_empty_directory_still_starts_from_scratch_in_training(tmp_path, capsys):
    """Megatron's behaviour for a first launch (--load and --save the same new directory)."""
    (tmp_path / "empty").mkdir()
    assert load_checkpoint(str(tmp_path / "empty"), _ps1()) is None
    assert "will start from random" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["dist", "nemo"])
def test_two_ranks_print_it_once(tmp_path, kind):
    from tests.test_agreed_exit import BASE, launch_two

    path = (fc.dist_checkpoint(tmp_path / "ck") if kind == "dist"
            else fc.nemo_dir(tmp_path / "nemo"))
    codes, out = launch_two(BASE + ["--load", str(path)], tmp_path)
    assert codes == [1, 1], (codes, out)
    what = "is a Megatron-Core distributed checkpoint" if kind == "dist" else "is a NeMo model"
    assert out.count(what) == 1 and out.count("error:") == 1, out
    assert "Traceback" not in out, out

