"""Checkpoints written by Megatron-LM itself load here (megatron/checkpoint_files.py).

A Megatron-LM 23.05 `model_optim_rng.pt` differs from this framework's in what it pickles
(`args` an argparse.Namespace holding a `ModelType` enum member and torch dtypes, the numpy
RNG state as a numpy array) and in shape (the model state nested as `language_model` ->
`embedding` / `encoder`, the consumed-sample counters in `args`, no `train_state`). The
tests rewrite a checkpoint of this framework into that form (`megatronize`, through
`tools/checkpoint_convert.py to-megatron`'s function, whose output is checked against the
reference's description) and check that training resumes from it exactly as from the
original, that tools reading checkpoints read it, and that anything else pickled is refused
without being run.
"""
from __future__ import annotations

import argparse
import enum
import os
import sys
import types

import numpy as np
import pytest
import torch

from megatron.arguments_checkpoint import read_checkpoint_args
from megatron.checkpoint_files import (
    ModelType,
    load_checkpoint_file,
    megatron_globals,
    megatron_payload,
    normalize_payload,
)
from megatron.checkpoint_model_args import checkpoint_arg_mismatches
from megatron.checkpoint_reshard import Layout, read_layout
from megatron.checkpoint_source import SourceCheckpoint
from megatron.checkpointing import checkpoint_name, describe_layout
from tests.test_exact_resume import K, N, _assert_exact, resume_scenario, run_pretrain
from tools import checkpoint_convert
from tools.checkpoint_convert import to_megatron


def _megatron_enum_module():
    """A module named as Megatron-LM's, so that pickle records `megatron.core.enums.ModelType`."""
    mod = types.ModuleType("megatron.core.enums")
    mod.ModelType = enum.Enum("ModelType", [("encoder_or_decoder", 1), ("encoder_and_decoder", 2)],
                              module="megatron.core.enums")
    return mod


def megatronize(path: str, monkeypatch) -> dict:
    """Rewrite one model_optim_rng.pt of this framework as Megatron-LM 23.05 writes it
    (`megatron_payload`, whose shape `test_the_export_has_megatron_lms_shape` checks
    against the reference), plus the `ModelType` member Megatron-LM keeps in its args."""
    state = torch.load(path, weights_only=True)
    train_state = state["train_state"]
    mod = _megatron_enum_module()
    out = megatron_payload(state)
    out["args"].model_type = mod.ModelType.encoder_or_decoder
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "megatron.core.enums", mod)
        torch.save(out, path)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(path, weights_only=True)  # what a plain weights_only load makes of it
    return train_state


@pytest.mark.parametrize("name,extra", [("fp32", []), ("bf16", ["--bf16"])])
def test_training_resumes_from_a_megatron_lm_checkpoint_exactly(tmp_path, monkeypatch, name,
                                                               extra):
    root = str(tmp_path / "ck")
    ref, _ = run_pretrain(extra)
    first, _ = run_pretrain(extra + ["--save", root, "--save-interval", str(K),
                                     "--exit-interval", str(K)])
    train_state = megatronize(checkpoint_name(root, K, 0, 0, 1), monkeypatch)
    resumed, tr = run_pretrain(extra + ["--load", root])
    _assert_exact(ref, first, resumed, name)
    assert train_state["consumed_train_samples"] == K * 8
    assert tr.state.consumed_train_samples == N * 8, "counters continue from Megatron's args"


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory):
    """A checkpoint at iteration K rewritten into Megatron-LM's form, and its original."""
    root = str(tmp_path_factory.mktemp("mlm") / "ck")
    run_pretrain(["--save", root, "--save-interval", str(K), "--exit-interval", str(K)])
    path = checkpoint_name(root, K, 0, 0, 1)
    original = torch.load(path, weights_only=True)
    with pytest.MonkeyPatch.context() as mp:
        megatronize(path, mp)
    return root, path, original


def test_the_file_reads_as_this_frameworks_payload(megatron_checkpoint):
    _, path, original = megatron_checkpoint
    state = load_checkpoint_file(path)
    assert isinstance(state["args"], dict) and state["args"]["model_type"] == 1
    assert state["args"]["params_dtype"] == "torch.float32"
    assert state["args"]["num_layers"] == original["args"]["num_layers"]
    assert state["model"].keys() == original["model"].keys()
    for key, tensor in original["model"].items():
        assert torch.equal(state["model"][key], tensor), key
    assert state["train_state"] == {k: original["train_state"][k] for k in state["train_state"]}
    np_state = state["rng_state"][0]["np_rng_state"]
    assert np.array_equal(np_state[1], original["rng_state"][0]["np_rng_state"][1].numpy())
    assert normalize_payload(original) is original, "this framework's payload passes as is"
    assert ModelType(1).name == "encoder_or_decoder"


def test_checkpoint_tools_read_it(megatron_checkpoint, tmp_path):
    root, _, original = megatron_checkpoint
    assert read_checkpoint_args(root)["hidden_size"] == original["args"]["hidden_size"]
    src = SourceCheckpoint(os.path.dirname(os.path.dirname(checkpoint_name(root, K, 0, 0, 1))))
    assert src.chunks(0, 0)[0].keys() == original["model"].keys()
    out = str(tmp_path / "tp2")
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", out,
                                    "--target-tensor-model-parallel-size", "2",
                                    "--target-pipeline-model-parallel-size", "1"]) == 0
    shards = [torch.load(checkpoint_name(out, K, t, 0, 1), weights_only=True) for t in (0, 1)]
    qkv = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    merged = torch.cat([s["model"][qkv] for s in shards], dim=0)
    assert torch.equal(merged, original["model"][qkv])


def strip_to_megatron_args(path: str, monkeypatch) -> None:
    """Drop from a Megatron-form file's `args` what Megatron-LM 23.05 never stores: this
    framework's extension flags and its own derived values (activation, micro-batches)."""
    from megatron.arguments_common import _unpack
    from megatron.arguments_table import EXTRA_GROUP

    ours = {_unpack(row, "")[4] for row in EXTRA_GROUP[1]} | {"activation", "num_micro_batches"}
    mod = _megatron_enum_module()
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "megatron.core.enums", mod)
        with torch.serialization.safe_globals(megatron_globals()):
            raw = torch.load(path, weights_only=True)
        raw["args"] = argparse.Namespace(**{k: v for k, v in vars(raw["args"]).items()
                                            if k not in ours})
        raw["args"].model_type = mod.ModelType.encoder_or_decoder
        torch.save(raw, path)


def test_tools_rebuild_the_model_from_megatron_lms_own_args(tmp_path, monkeypatch, capsys):
    """Megatron-LM 23.05's args lack this framework's flags (--normalization,
    --group-query-attention, ...) and derived values (the activation): they are read as
    Megatron-LM's behaviour (LayerNorm, no query groups, its fused tanh GeLU), so reshard,
    to-hf and generate.py rebuild the model (they stopped with "the checkpoint's args lack
    a value") and a run of another normalization or query groups is told which flag
    differs (the check skipped them, then the strict load listed unexpected keys)."""
    from megatron.hf_convert import load_full_checkpoint
    from tools.generate import load_model

    root = str(tmp_path / "ck")
    run_pretrain(["--save", root, "--save-interval", str(K), "--exit-interval", str(K)])
    path = checkpoint_name(root, K, 0, 0, 1)
    original = torch.load(path, weights_only=True)
    megatronize(path, monkeypatch)
    strip_to_megatron_args(path, monkeypatch)
    with monkeypatch.context() as m, torch.serialization.safe_globals(megatron_globals()):
        m.setitem(sys.modules, "megatron.core.enums", _megatron_enum_module())
        assert "normalization" not in vars(torch.load(path, weights_only=True)["args"])
    saved = load_checkpoint_file(path)["args"]
    assert saved["normalization"] == "LayerNorm" and saved["activation"] == "openai_gelu"
    run = dict(original["args"], normalization="RMSNorm", group_query_attention=True,
               num_query_groups=2)
    named = {m.name for m in checkpoint_arg_mismatches(saved, run)}
    assert named == {"--normalization", "query groups (--group-query-attention "
                                          "--num-query-groups)"}, "checked, not skipped"
    _, model_cfg, state, _ = load_full_checkpoint(root)
    assert model_cfg.activation == original["args"]["activation"] == "openai_gelu"
    assert model_cfg.normalization == "LayerNorm" and model_cfg.num_query_groups == 4
    assert all(torch.equal(state[k], v) for k, v in original["model"].items())
    model, _, iteration = load_model(root)
    assert iteration == K and model.config.position_embedding_type == "learned_absolute"
    out = checkpoint_convert.reshard(root, str(tmp_path / "tp2"), 2, 1)
    assert out["files"] == 2


class Gadget:
    """Not plain data: a checkpoint holding one must be refused, not unpickled."""

    def __reduce__(self):
        return (Gadget, ())


def test_other_pickled_objects_are_refused(tmp_path):
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": argparse.Namespace(num_layers=2), "checkpoint_version": 3.0,
                "gadget": Gadget()}, path)
    with pytest.raises(SystemExit, match=r"holds a pickled .*Gadget.*not plain data"):
        load_checkpoint_file(path)


def test_a_torch_without_safe_globals_names_the_version_it_needs(tmp_path, monkeypatch):
    """torch 2.4 (what requirements.txt allowed, and the Dockerfile's base image had) has
    no torch.serialization.safe_globals: reading a Megatron-LM checkpoint stopped with an
    AttributeError traceback from every rank."""
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": argparse.Namespace(num_layers=2), "checkpoint_version": 3.0}, path)
    monkeypatch.delattr(torch.serialization, "safe_globals")
    with pytest.raises(SystemExit) as exc:
        load_checkpoint_file(path)
    assert str(exc.value.code) == (
        f"error: checkpoint file {path} was written by Megatron-LM; reading it without "
        "running pickled code takes torch >= 2.6 (torch.serialization.safe_globals with "
        f"(object, name) pairs), and this is torch {torch.__version__}: upgrade torch "
        "(requirements.txt)")


def test_an_old_qkv_ordering_is_refused(tmp_path):
    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({"args": argparse.Namespace(num_layers=2), "checkpoint_version": 1.0,
                "model": {}}, path)
    with pytest.raises(SystemExit, match=r"checkpoint version 1.0 .* versions >= 2.0"):
        load_checkpoint_file(path)


def test_the_export_has_megatron_lms_shape(tmp_path, capsys):
    """`to-megatron` writes what reference section d.2 describes, pickling nothing that
    needs this framework (a plain torch.load with only argparse and numpy allowed reads
    it), and this framework reads the export back to the same payload."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "mlm")
    run_pretrain(["--bf16", "--save", root, "--save-interval", str(K), "--exit-interval", str(K)])
    capsys.readouterr()
    assert checkpoint_convert.main(["to-megatron", "--load", root, "--save", out]) == 0
    printed = capsys.readouterr()
    assert ("warning: the checkpoint's RNG states were saved by a CPU run; Megatron-LM "
            "restores CUDA generator states and stops on these: load the export with "
            "--no-load-rng" in printed.err)
    assert printed.out.rstrip().endswith(": 1 rank file"), printed.out
    path = checkpoint_name(out, K, 0, 0, 1)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == str(K)
    numpy_only = [g for g in megatron_globals() if g[0] is not ModelType]
    with torch.serialization.safe_globals(numpy_only):
        raw = torch.load(path, weights_only=True)
    args = raw["args"]
    assert isinstance(args, argparse.Namespace) and args.params_dtype is torch.bfloat16
    assert args.consumed_train_samples == K * 8 and "train_state" not in raw
    lm = raw["model"]["language_model"]
    assert set(raw["model"]) == {"language_model"}
    assert set(lm) == {"embedding", "encoder"}
    assert set(lm["embedding"]) == {"word_embeddings", "position_embeddings"}
    assert set(lm["embedding"]["word_embeddings"]) == {"weight"}
    assert "layers.0.input_layernorm.weight" in lm["encoder"]
    assert "layers.1.self_attention.query_key_value.weight" in lm["encoder"]
    assert "layers.1.mlp.dense_4h_to_h.weight" in lm["encoder"]
    assert "final_layernorm.weight" in lm["encoder"]
    assert isinstance(raw["rng_state"][0]["np_rng_state"][1], np.ndarray)
    assert set(raw["optimizer"]) >= {"optimizer", "fp32_from_fp16_params"}
    original = torch.load(checkpoint_name(root, K, 0, 0, 1), weights_only=True)
    back = load_checkpoint_file(path)
    assert back["model"].keys() == original["model"].keys()
    assert all(torch.equal(back["model"][k], v) for k, v in original["model"].items())
    assert back["train_state"] == {k: original["train_state"][k] for k in back["train_state"]}
    assert back["args"]["hidden_size"] == original["args"]["hidden_size"]


def test_rotary_plus_learned_positions_round_trip(tmp_path):
    """--use-rotary-position-embeddings alone (learned positions and rotary ones, as
    Megatron-LM 23.05 builds): resume gives the uninterrupted run's losses; the
    to-megatron export keeps the position table under Megatron's names, and with its args
    as Megatron writes them (add_position_embedding, use_rotary_position_embeddings, no
    position_embedding_type) --use-checkpoint-args rebuilds the model and resumes the same
    losses; to-hf refuses (no Hugging Face class has both)."""
    rope = ["--use-rotary-position-embeddings"]
    root, out = str(tmp_path / "ck"), str(tmp_path / "mlm")
    ref, first, resumed = resume_scenario(root, rope)
    _assert_exact(ref, first, resumed, "rope+learned")
    to_megatron(root, out)
    path = checkpoint_name(out, K, 0, 0, 1)
    numpy_only = [g for g in megatron_globals() if g[0] is not ModelType]
    with torch.serialization.safe_globals(numpy_only):
        raw = torch.load(path, weights_only=True)
    assert set(raw["model"]["language_model"]["embedding"]) == {"word_embeddings",
                                                                "position_embeddings"}
    assert raw["args"].add_position_embedding and raw["args"].use_rotary_position_embeddings
    del raw["args"].position_embedding_type  # a Megatron-LM 23.05 writer has none
    torch.save(raw, path)
    from_megatron, tr = run_pretrain(["--load", out, "--use-checkpoint-args"])
    assert tr.model.module.config.position_embedding_type == "rope+learned"
    assert from_megatron == {i: ref[i] for i in range(K + 1, N + 1)}
    with pytest.raises(SystemExit, match="neither GPT2LMHeadModel nor LlamaForCausalLM"):
        checkpoint_convert.main(["to-hf", "--load", root, "--output", str(tmp_path / "hf")])


# ------------------------------------------- Megatron-LM 23.04 distributed-optimizer layout
def to_23_04_layout(root: str, dp_size: int = 2) -> None:
    """Rearrange the Megatron-LM-form checkpoint at iteration K under `root` (pp 1) as
    Megatron-LM 23.04 wrote it with --use-distributed-optimizer (reference d.1): the payload
    without its optimizer and scheduler in mp_rank_XX/model_rng.pt, one
    mp_rank_XX_<dp rank>/optim.pt per data-parallel rank (dummy contents: never read), no
    model_optim_rng.pt or distrib_optim.pt."""
    iter_dir = os.path.dirname(os.path.dirname(checkpoint_name(root, K, 0, 0, 1)))
    for rank_dir in [d for d in os.listdir(iter_dir) if d.startswith("mp_rank_")]:
        path = os.path.join(iter_dir, rank_dir, "model_optim_rng.pt")
        with torch.serialization.safe_globals(megatron_globals()):
            state = torch.load(path, weights_only=True)
        optim = {k: state.pop(k) for k in ("optimizer", "opt_param_scheduler")}
        assert "rng_state" in state
        torch.save(state, os.path.join(iter_dir, rank_dir, "model_rng.pt"))
        os.remove(path)
        os.remove(os.path.join(iter_dir, rank_dir, "distrib_optim.pt"))
        for dp_rank in range(dp_size):
            os.makedirs(os.path.join(iter_dir, f"{rank_dir}_{dp_rank:03d}"))
            torch.save({"dummy": torch.zeros(1), "keys": sorted(optim)},
                       os.path.join(iter_dir, f"{rank_dir}_{dp_rank:03d}", "optim.pt"))


@pytest.fixture(scope="module")
def legacy_checkpoint(tmp_path_factory):
    """(a distributed-optimizer checkpoint of this framework at iteration K, the same in
    Megatron-LM 23.04's layout)."""
    base = tmp_path_factory.mktemp("mlm2304")
    root, legacy = str(base / "ck"), str(base / "legacy")
    run_pretrain(["--use-distributed-optimizer", "--save", root, "--save-interval", str(K),
                  "--exit-interval", str(K)])
    to_megatron(root, legacy)
    to_23_04_layout(legacy)
    assert sorted(os.listdir(os.path.join(legacy, f"iter_{K:07d}"))) == \
        ["mp_rank_00", "mp_rank_00_000", "mp_rank_00_001"]
    return root, legacy


def test_23_04_layout_optimizer_state_is_refused_with_the_fix(legacy_checkpoint):
    _, legacy = legacy_checkpoint
    with pytest.raises(SystemExit, match=r"iter_0000003 is a Megatron-LM 23.04-layout "
                       r"distributed-optimizer checkpoint .* optimizer state cannot be read "
                       r"here .* Pass --no-load-optim .* or --finetune"):
        run_pretrain(["--use-distributed-optimizer", "--load", legacy])


def test_23_04_layout_resumes_with_no_load_optim(legacy_checkpoint):
    """The weights, RNG states (dropout is on), iteration and consumed samples come from
    model_rng.pt: the losses are those of loading the original with --no-load-optim."""
    root, legacy = legacy_checkpoint
    flags = ["--use-distributed-optimizer", "--no-load-optim"]
    expected, _ = run_pretrain(flags + ["--load", root])
    resumed, tr = run_pretrain(flags + ["--load", legacy])
    assert sorted(resumed) == list(range(K + 1, N + 1))
    assert resumed == expected
    assert tr.state.iteration == N and tr.state.consumed_train_samples == N * 8
    fine, tr = run_pretrain(["--load", legacy, "--finetune"])  # from iteration 0
    assert sorted(fine) == list(range(1, N + 1)) and tr.state.iteration == N


def test_23_04_layout_model_is_read_by_the_tools(legacy_checkpoint, tmp_path, capsys):
    root, legacy = legacy_checkpoint
    iter_dir = os.path.join(legacy, f"iter_{K:07d}")
    original = torch.load(checkpoint_name(root, K, 0, 0, 1), weights_only=True)
    src = SourceCheckpoint(iter_dir)
    assert src.layout == Layout(1, 1, 1, None)  # the optim.pt directories are not pp ranks
    assert all(torch.equal(src.chunks(0, 0)[0][k], v) for k, v in original["model"].items())
    assert read_checkpoint_args(legacy)["hidden_size"] == original["args"]["hidden_size"]
    assert describe_layout(iter_dir).endswith("(found mp_rank_00)")
    capsys.readouterr()
    assert checkpoint_convert.main(["reshard", "--load", legacy, "--save", str(tmp_path / "tp2"),
                                    "--target-tensor-model-parallel-size", "2",
                                    "--target-pipeline-model-parallel-size", "1"]) == 0
    assert "23.04-layout distributed-optimizer checkpoint: its optimizer state" in \
        capsys.readouterr().out
    assert read_layout(str(tmp_path / "tp2" / f"iter_{K:07d}")) == Layout(2, 1, 1, None)


def test_to_megatron_warns_of_what_megatron_lm_23_05_cannot_build(tmp_path, capsys):
    """to-megatron wrote an RMSNorm / query-group model without a word, and Megatron-LM
    23.05 (which has neither, and replaces a SwiGLU --ffn-hidden-size off its rule) then
    refused the weights; the export still happens (later releases have the flags)."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "mlm")
    run_pretrain(["--normalization", "RMSNorm", "--group-query-attention",
                  "--num-query-groups", "2", "--save", root, "--save-interval", str(K),
                  "--exit-interval", str(K)])
    capsys.readouterr()
    assert checkpoint_convert.main(["to-megatron", "--load", root, "--save", out]) == 0
    err = capsys.readouterr().err
    assert ("warning: Megatron-LM 23.05 cannot build this model: --normalization RMSNorm (it "
            "has LayerNorm only); --group-query-attention --num-query-groups 2 (it has none)"
            in err)
    assert os.path.isfile(checkpoint_name(out, K, 0, 0, 1))
    gaps = checkpoint_convert.megatron_23_05_gaps
    assert gaps({"swiglu": True, "hidden_size": 4096, "ffn_hidden_size": 11008}) == [
        "--swiglu with --ffn-hidden-size 11008 (under --swiglu it replaces the size with 10880)"]
    assert gaps({"position_embedding_type": "rope", "rotary_base": 500000.0}) == [
        "--rotary-base 500000.0 (its rotary base is 10000)"]
    assert gaps({"normalization": "LayerNorm", "swiglu": True, "hidden_size": 96,
                 "ffn_hidden_size": 256, "position_embedding_type": "rope",
                 "rotary_base": 10000}) == []


def test_a_gpu_checkpoints_rng_streams_on_a_cpu_run(tmp_path, monkeypatch, capsys):
    """Megatron-LM saves the tensor-parallel RNG streams (`rng_tracker_states`) and
    `cuda_rng_state` as CUDA generator states (16 bytes). A CPU run (debugging a GPU
    checkpoint) set them into its CPU generator and stopped at the first attention dropout
    ("Expected a CPUGeneratorImplState of size 5056 but found ... 16"); now those streams
    start from --seed, a note says so, and the other RNG states are restored. A GPU run
    given a CPU run's streams is told the same (`set_rng_state`)."""
    from megatron.checkpoint_plain import get_rng_state, set_rng_state
    from megatron.core.tensor_parallel.random import RNGStatesTracker

    root = str(tmp_path / "ck")
    run_pretrain(["--save", root, "--save-interval", str(K), "--exit-interval", str(K)])
    path = checkpoint_name(root, K, 0, 0, 1)
    megatronize(path, monkeypatch)
    mod = _megatron_enum_module()
    with monkeypatch.context() as m, torch.serialization.safe_globals(megatron_globals()):
        m.setitem(sys.modules, "megatron.core.enums", mod)
        raw = torch.load(path, weights_only=True)
        cuda_state = torch.arange(16, dtype=torch.uint8)
        raw["rng_state"][0]["cuda_rng_state"] = cuda_state
        raw["rng_state"][0]["rng_tracker_states"] = {"model-parallel-rng": cuda_state}
        raw["args"].model_type = mod.ModelType.encoder_or_decoder
        torch.save(raw, path)
    capsys.readouterr()
    resumed, _ = run_pretrain(["--load", root])
    assert sorted(resumed) == list(range(K + 1, N + 1))
    assert ("the checkpoint's tensor-parallel RNG streams (model-parallel-rng) are CUDA "
            "generator states, which this run's CPU generator cannot take: they start from "
            "--seed" in capsys.readouterr().out)
    cuda_run = RNGStatesTracker("cpu")
    cuda_run.states = {"model-parallel-rng": cuda_state}  # a GPU run's tracker
    saved = get_rng_state(RNGStatesTracker("cpu"))
    saved["rng_tracker_states"] = {"model-parallel-rng": torch.get_rng_state()}
    note = set_rng_state(saved, cuda_run)
    assert "are CPU generator states, which this run's CUDA generator cannot take" in note
    assert torch.equal(cuda_run.states["model-parallel-rng"], cuda_state)


def test_rank_directories_of_an_earlier_save_at_a_larger_tp_are_not_read(megatron_checkpoint,
                                                                          tmp_path):
    """Megatron-LM saves into an existing iteration directory, so a tp 1 save over an
    earlier tp 2 save of that iteration leaves the old `mp_rank_01` beside the new
    `mp_rank_00` (or a user's empty `mp_rank_01`): Megatron-LM reads only the ranks its
    stored args name. The directories were taken for a tp 2 layout: the load stopped
    blaming the model flags (a query_key_value weight "holds shape (384, 64) but this
    model needs (192, 64)" for an empty `mp_rank_01`), the tools with a reshape
    RuntimeError."""
    import shutil

    from megatron.checkpoint_dirs import complete_layout

    root = str(tmp_path / "ck")
    shutil.copytree(megatron_checkpoint[0], root)
    iter_dir = os.path.dirname(os.path.dirname(checkpoint_name(root, K, 0, 0, 1)))
    stale = os.path.join(iter_dir, "mp_rank_01")
    os.makedirs(stale)
    with open(os.path.join(stale, "model_optim_rng.pt"), "wb") as f:
        f.write(b"an earlier save's rank 1, never to be read")
    assert read_layout(iter_dir).tp == 1
    src = SourceCheckpoint(iter_dir)
    assert src.layout.tp == 1
    assert src.chunks(0, 0)[0].keys() == megatron_checkpoint[2]["model"].keys()
    losses, tr = run_pretrain(["--load", root])
    assert tr.state.iteration == N and sorted(losses) == list(range(K + 1, N + 1))
    sizes = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    shutil.rmtree(stale)
    os.makedirs(os.path.join(iter_dir, "mp_rank_02"))  # a gap in the stored tp 2: refused
    with pytest.raises(SystemExit, match="incomplete: mp_rank_01 is missing"):
        complete_layout(iter_dir, sizes)


def test_rank_directories_of_both_naming_schemes_are_refused_naming_them(tmp_path):
    """A pp 1 save over a pp 2 save of the same iteration (Megatron-LM writes in place)
    leaves `mp_rank_00` beside `mp_rank_00_000`/`mp_rank_00_001`: the stale stage-0 file
    was read as the checkpoint's rank 0 and the pp 1 save was resharded from the pp 2 one."""
    from megatron.checkpoint_dirs import complete_layout

    iter_dir = tmp_path / "iter_0000010"
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_001"):
        (iter_dir / name).mkdir(parents=True)
    with pytest.raises(SystemExit) as err:
        complete_layout(str(iter_dir), {"tensor_model_parallel_size": 1,
                                        "pipeline_model_parallel_size": 1})
    message = str(err.value)
    assert f"checkpoint {iter_dir} holds rank directories of two saves: mp_rank_00 " \
           "(pipeline-model-parallel size 1) and mp_rank_00_000, mp_rank_00_001" in message
    assert "Move the directories of the save that is not wanted out of it" in message


def test_a_cpu_checkpoints_rng_state_on_a_cuda_run_says_the_cuda_generator_stays_seeded():
    """A CPU run saves no CUDA generator state (`cuda_rng_state` None). A GPU run resumed
    from it kept its CUDA generator -- the one hidden dropout draws from -- at its seeded
    state without a word; the only note named the tracker's streams and said that the
    other RNG states were restored. Now the note names the CUDA generator too; a CPU run
    given the same checkpoint restores everything and gets no note."""
    from megatron.checkpoint_plain import get_rng_state, set_rng_state
    from megatron.core.tensor_parallel.random import RNGStatesTracker

    cpu_run = RNGStatesTracker("cpu")
    cpu_run.add("model-parallel-rng", 1234 + 2718)
    saved = get_rng_state(cpu_run)
    saved["cuda_rng_state"] = None  # what a CPU run saves
    assert set_rng_state(saved, cpu_run) is None

    cuda_run = RNGStatesTracker("cuda")  # a GPU run's tracker (no CUDA call is made here)
    cuda_state = torch.arange(16, dtype=torch.uint8)
    cuda_run.states = {"model-parallel-rng": cuda_state}
    no_cuda = ("the checkpoint holds no CUDA generator state (saved by a CPU run): this "
               "run's CUDA generator, which draws the dropout masks outside tensor-parallel "
               "regions, is not restored and goes on from --seed")
    note = set_rng_state(dict(saved, rng_tracker_states={"model-parallel-rng": cuda_state}),
                         cuda_run)
    assert note == no_cuda + "; the other RNG states are restored"
    note = set_rng_state(saved, cuda_run)
    assert note.startswith(no_cuda + "; the checkpoint's tensor-parallel RNG streams "
                           "(model-parallel-rng) are CPU generator states")
    assert note.endswith("; the other RNG states are restored")
    assert note.count("the other RNG states are restored") == 1
    assert torch.equal(cuda_run.states["model-parallel-rng"], cuda_state)


def test_empty_tensor_parallel_rng_streams_in_a_checkpoint_are_named():
    """Megatron-LM counts a checkpoint's empty `rng_tracker_states` as a missing RNG state
    (facts d.3.7). They were skipped without a word, the other states restored: the
    attention-dropout stream went on from --seed unannounced. Now a note names them."""
    from megatron.checkpoint_plain import get_rng_state, set_rng_state
    from megatron.core.tensor_parallel.random import RNGStatesTracker

    run = RNGStatesTracker("cpu")
    run.add("model-parallel-rng", 1234 + 2718)
    seeded = run.get_states()["model-parallel-rng"]
    saved = dict(get_rng_state(run), rng_tracker_states={})
    note = set_rng_state(saved, run)
    assert note == ("the checkpoint holds no tensor-parallel RNG streams (empty "
                    "rng_tracker_states): this run's streams start from --seed (dropout "
                    "inside tensor-parallel regions draws other masks than the saving run's)"
                    "; the other RNG states are restored")
    assert torch.equal(run.get_states()["model-parallel-rng"], seeded)
