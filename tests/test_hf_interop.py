"""Hugging Face interop (`checkpoint_convert.py to-hf` / `from-hf`): models trained here
export to GPT2LMHeadModel / LlamaForCausalLM with the same logits, HF models import into
any tp/pp layout (exact tensors back on re-export) and keep training.

Tolerance: fp32 on CPU, max |logit difference| < 1e-4 (measured: 0.0 on these tiny models).
Tests that load models with transformers skip when it is absent. The tokenizer across
the conversions: tests/test_hf_tokenizers.py.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys

import pytest
import torch

from megatron import hf_convert, hf_files, hf_interop
from megatron.arguments import parse_and_validate
from tests.dist_utils import run_distributed
from tests.gpt_helpers import cli_trainer, train_steps
from tools import checkpoint_convert

safetensors = pytest.importorskip("safetensors", reason="the HF export writes safetensors")

TOL = 1e-4
VOCAB = 100  # NullTokenizer --vocab-size 100: 101 real ids, padded to 128 (256 at tp 2)
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 "
        "--train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
        "--hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization --save-interval 100 --num-workers 0")
LLAMA = ("--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
         "--disable-bias-linear --rotary-base 500")
TOKENS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [100, 0, 1, 2, 7, 9, 99,
                                                                     50, 51, 52, 53, 54]])


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is an optional dependency")


def _cli(*argv) -> int:
    """`tools/checkpoint_convert.py ARGV` in this process; its exit status."""
    return checkpoint_convert.main([str(a) for a in argv])


def _hf_logits(hf_dir, tokens=TOKENS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), **hf_convert.dtype_kwarg(torch.float32)).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _ours_logits(model, tokens=TOKENS) -> torch.Tensor:
    """Logits of this rank's model (vocab-parallel shard [b, s, V/tp]), eval mode."""
    model.eval()
    with torch.no_grad():
        return model(tokens).float()


def _train(save_dir, extra, world_size=1, rank=0, steps=2, load=None, vocab_size_fn=None):
    """Train a tiny model `steps` steps (optionally from --load, loaded as pretrain() does),
    save it; returns (trainer, losses, logits of TOKENS before training)."""
    from megatron.trainer_checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
    from megatron.training import data_iterator

    argv = f"{TINY} --save {save_dir} {extra}".split() + (["--load", str(load)] if load else [])
    cfg, rt, tr = cli_trainer(argv, world_size, rank, vocab_size_fn=vocab_size_fn)
    if load:
        load_trainer_checkpoint(tr)
    before = _ours_logits(tr.model.module)
    tr.model.module.train()
    losses = train_steps(tr, data_iterator(cfg, rt, "train", 0), steps)
    save_trainer_checkpoint(tr)
    return tr, losses, before


# ---------------------------------------------------------------------- mapping
def test_qkv_layout_family_detection_and_errors(tmp_path):
    argv = f"{TINY} --num-attention-heads 8 --hidden-size 64 {LLAMA} --num-query-groups 2"
    cfg = parse_and_validate(argv.split(), world_size=1, env={}, cuda_available=False)
    m = cfg.model
    n, g, d = m.num_attention_heads, m.num_query_groups, m.kv_channels
    rows = torch.arange((n + 2 * g) * d)  # row r of the fused weight, per group [q q q q k v]
    q, k, v = hf_interop.split_qkv(rows, m)
    assert q[:d].tolist() == list(range(d)) and k[:d].tolist() == list(range(4 * d, 5 * d))
    assert v[d:2 * d].tolist() == list(range(11 * d, 12 * d))  # group 1's v block
    assert torch.equal(hf_interop.fuse_qkv(q, k, v, m), rows)
    assert hf_interop.detect_family(m) == "llama"
    with pytest.raises(ValueError, match="cannot export as gpt2: normalization RMSNorm"):
        hf_interop.to_hf_state_dict({}, m, "gpt2", 101)
    gpt = parse_and_validate(TINY.split(), world_size=1, env={}, cuda_available=False).model
    assert hf_interop.detect_family(gpt) == "gpt2"
    both = parse_and_validate(TINY.split() + ["--use-rotary-position-embeddings"], world_size=1,
                              env={}, cuda_available=False).model
    with pytest.raises(ValueError, match="rotary positions together .* neither GPT2LMHeadModel"):
        hf_interop.detect_family(both)
    with pytest.raises(ValueError, match="vocab size 500 outside"):
        hf_interop.to_hf_state_dict({}, gpt, "gpt2", 500)
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        hf_interop.megatron_flags_from_hf({"model_type": "bert"})
    qwen2 = {"model_type": "qwen2", "max_position_embeddings": 64, "sliding_window": 8,
             "num_hidden_layers": 2, "max_window_layers": 1}
    assert hf_interop.sliding_window_note(qwen2, 64) is None  # use_sliding_window off
    slides = {**qwen2, "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding_window 8 is shorter than --seq-length 64"):
        hf_interop.sliding_window_note(slides, 64)
    # layers from max_window_layers on slide: none of 2 when it is 2; nor without a layer_type
    assert hf_interop.sliding_window_note({**slides, "max_window_layers": 2}, 64) is None
    assert hf_interop.sliding_window_note({**slides, "layer_types": ["full_attention"]}, 64) is None
    assert "up to 16 tokens" in hf_interop.sliding_window_note(
        {"model_type": "mistral", "max_position_embeddings": 64, "sliding_window": 16}, 16)
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        hf_interop.megatron_flags_from_hf({"model_type": "llama",
                                           "rope_parameters": {"rope_type": "llama3"}})
    # transformers reads a config's rope_scaling over its rope_parameters
    with pytest.raises(ValueError, match="rope_scaling rope_type 'linear'"):
        hf_interop.megatron_flags_from_hf({
            "model_type": "llama", "rope_parameters": {"rope_type": "default"},
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(SystemExit, match="no config.json there"):
        _cli("from-hf", "--input", tmp_path, "--save", tmp_path / "ck")


def test_ours_to_hf_to_ours_without_transformers(tmp_path, monkeypatch):
    """Export then import (tp 2 x pp 2): every tensor comes back, padding rows copies of the
    last real row (as Megatron-LM's converters pad)."""
    _train(tmp_path / "ck", "--apply-layernorm-1p --untie-embeddings-and-output-weights", steps=1)
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf") == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["vocab_size"] == VOCAB + 1
    # biases and the default GeLU: Megatron-LM's fused bias-GeLU, the tanh form
    assert cfg["tie_word_embeddings"] is False and cfg["activation_function"] == "gelu_new"
    # sharded output (tiny shard limit) replaces the single file; --verify needs transformers
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit, match="--verify needs the transformers package"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf", "--verify",
             "--max-shard-size-gb", 1e-5, "--overwrite")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "back",
                "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2) == 0
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "release"
    _, _, orig, _ = hf_convert.load_full_checkpoint(str(tmp_path / "ck"))
    args, model, back, it = hf_convert.load_full_checkpoint(str(tmp_path / "back"))
    assert it == 0 and model.padded_vocab_size == 256 and args["tensor_model_parallel_size"] == 1
    for key, value in orig.items():
        if "layernorm" in key:  # 1p weights (gamma - 1) come back as plain gamma
            value = value + 1 if key.endswith("weight") else value
        got = back[key]
        if got.shape[0] == 256:  # vocabulary rows: 101 real, then the last one repeated
            assert torch.equal(got[VOCAB + 1:], got[VOCAB].expand(256 - VOCAB - 1, -1))
            got, value = got[:VOCAB + 1], value[:VOCAB + 1]
        assert torch.equal(got, value), key
    # weights saved from the base model (no "transformer." prefix, with mask buffers) map
    # the same; a tensor the mapping does not use is an error, not silently dropped
    _, hf = hf_files.load_hf_checkpoint(str(tmp_path / "hf"))
    base = {k.removeprefix("transformer."): v for k, v in hf.items()}
    base["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    assert hf_interop.from_hf_state_dict(base, model, "gpt2").keys() == back.keys()
    with pytest.raises(ValueError, match=r"does not use \(transformer.h.1.attn.q_norm.weight\)"):
        hf_interop.from_hf_state_dict({**base, "h.1.attn.q_norm.weight": torch.ones(8)},
                                      model, "gpt2")


@pytest.mark.parametrize("family, edit, named", [
    ("llama", {"intermediate_size": 48}, "model.layers.0.mlp.gate_proj.weight [64, 32] "
                                        "(config.json: [48, 32])"),
    ("llama", {"head_dim": 16}, "model.layers.0.self_attn.q_proj.weight [32, 32] "
                                "(config.json: [64, 32])"),
    ("llama", {"vocab_size": 90}, "model.embed_tokens.weight [101, 32] (config.json: [90, 32])"),
    ("gpt2", {"n_positions": 8}, "transformer.wpe.weight [16, 32] (config.json: [8, 32])")])
def test_from_hf_refuses_weights_that_do_not_match_config_json(tmp_path, family, edit, named):
    """Weights and a config.json of another shape: an error naming the tensors, and no
    checkpoint written (before: a reshape traceback, or a checkpoint that failed to load,
    or -- a smaller vocab_size -- a model with rows past its vocabulary)."""
    flags = f"{TINY} {LLAMA if family == 'llama' else ''} --ffn-hidden-size 64"
    model = parse_and_validate(flags.split(), world_size=1, env={}, cuda_available=False).model
    from megatron.core.models.gpt.gpt_model import GPTModel

    ours = GPTModel(model).state_dict()
    state = hf_interop.to_hf_state_dict(ours, model, family, VOCAB + 1)
    config = {**hf_interop.hf_config(model, family, VOCAB + 1, torch.float32, state=state),
              **edit}
    hf_files.save_hf_checkpoint(str(tmp_path / "hf"), state, config)
    with pytest.raises(SystemExit, match=re.escape(named)) as exc:
        _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck")
    assert "give the config.json saved with these weights" in str(exc.value)
    assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------ export
@pytest.mark.parametrize("extra", ["", "--no-bias-gelu-fusion",
                                   "--openai-gelu --untie-embeddings-and-output-weights "
                                   "--disable-bias-linear"],
                         ids=["bias-gelu-tied", "erf-gelu-tied", "openai-gelu-untied"])
def test_gpt2_export_has_our_logits(tmp_path, extra, capsys):
    _transformers()
    tr, _, _ = _train(tmp_path / "ck", extra)
    ours = _ours_logits(tr.model.module)[..., :VOCAB + 1]
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf", "--verify") == 0
    assert "verify: max |logits ours - transformers|" in capsys.readouterr().out
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    untied = "--untie-embeddings-and-output-weights" in extra
    assert ("lm_head.weight" in names) == untied and "transformer.wpe.weight" in names
    diff = (_hf_logits(tmp_path / "hf") - ours).abs().max().item()
    print(f"gpt2 {extra or 'gelu tied'}: max |logit diff| = {diff:.2e}")
    assert diff < TOL


def _llama_tp2_worker(rank, world_size, save_dir):
    tr, _, _ = _train(save_dir, f"{LLAMA} --tensor-model-parallel-size 2", world_size, rank)
    return _ours_logits(tr.model.module)  # this rank's half of the vocabulary


def test_llama_export_from_tp2_run_has_its_logits(tmp_path, capsys):
    _transformers()
    shards = run_distributed(_llama_tp2_worker, 2, str(tmp_path / "ck"))
    ours = torch.cat(shards, dim=-1)[..., :VOCAB + 1]  # padded vocab 256 over 2 ranks
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf",
                "--verify", "--verify-tolerance", TOL) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    assert cfg["rope_parameters"]["rope_theta"] == 500.0 and cfg["tie_word_embeddings"] is False
    diff = (_hf_logits(tmp_path / "hf") - ours).abs().max().item()
    print(f"llama tp2: max |logit diff| = {diff:.2e}")
    assert diff < TOL


def test_verify_catches_a_wrong_mapping(tmp_path, monkeypatch, capsys):
    _transformers()
    _train(tmp_path / "ck", LLAMA, steps=1)
    m = parse_and_validate(f"{TINY} {LLAMA}".split(), world_size=1, env={},
                           cuda_available=False).model
    sizes = [m.num_attention_heads * m.kv_channels] + [m.num_query_groups * m.kv_channels] * 2
    # a typical mapping bug: reading the fused QKV rows as [all q; all k; all v]
    monkeypatch.setattr(hf_interop, "split_qkv", lambda w, model: torch.split(w, sizes))
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf", "--verify",
                "--verify-tolerance", TOL) == 1
    assert "FAILED" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="cannot export as gpt2: normalization RMSNorm"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "x", "--family", "gpt2")


def test_verify_default_tolerance_is_relative_and_catches_small_mismatches(tmp_path, monkeypatch,
                                                                          capsys):
    """The default tolerance is 1e-5 of the largest logit (fp32 on both sides): the
    absolute 1e-3 it replaced passed a GeLU of the wrong form (7.8e-4 here) and a weight
    off by 1e-3 of itself."""
    _transformers()
    _train(tmp_path / "ck", "--no-bias-gelu-fusion --init-method-std 0.2", steps=1)
    export = lambda name: _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / name,
                               "--verify")
    assert export("ok") == 0
    assert re.search(r"tolerance \S+: 1e-05 x max \|logits\| [\d.]+, fp32 on both sides\): OK",
                     capsys.readouterr().out)
    monkeypatch.setitem(hf_interop._ACT_TO_HF, "gelu", "gelu_new")  # tanh GeLU for erf
    assert export("gelu") == 1
    assert "FAILED" in capsys.readouterr().out
    monkeypatch.undo()
    to_hf = hf_interop.to_hf_state_dict

    def perturbed(*args, **kwargs):
        out = to_hf(*args, **kwargs)
        out["transformer.h.1.mlp.c_fc.weight"] *= 1 + 1e-3
        return out

    monkeypatch.setattr(hf_convert, "to_hf_state_dict", perturbed)
    assert export("weight") == 1
    assert "FAILED" in capsys.readouterr().out
    monkeypatch.undo()
    # just past the default limit, as summation order can be in a deep model: the fix named
    monkeypatch.setattr(hf_convert, "compare_logits", lambda *a, **k: (2e-5, 1.0))
    assert export("near") == 1
    assert "rerun with --verify-tolerance 1.0e-04" in capsys.readouterr().out
    monkeypatch.setattr(hf_convert, "compare_logits", lambda *a, **k: (5e-4, 1.0))
    assert export("far") == 1
    assert "--verify-tolerance" not in capsys.readouterr().out


# ------------------------------------------------------------------------ import
def _save_hf_model(path, family):
    """A tiny random Hugging Face model saved with save_pretrained (safetensors)."""
    tf = _transformers()
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB + 1, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                            bos_token_id=VOCAB, eos_token_id=VOCAB,
                            attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=16, rope_theta=500.0, attention_bias=True,
                             rms_norm_eps=1e-5, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so mix-ups show
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("family,pp", [("gpt2", 2), ("llama", 1)])
def test_hf_to_ours_tp2_to_hf_is_exact(tmp_path, family, pp):
    _save_hf_model(tmp_path / "hf", family)
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck",
                "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", pp) == 0
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "out",
                "--verify", "--verify-tolerance", TOL) == 0
    cfg_in, sd_in = hf_files.load_hf_checkpoint(str(tmp_path / "hf"))
    cfg_out, sd_out = hf_files.load_hf_checkpoint(str(tmp_path / "out"))
    assert sd_in.keys() == sd_out.keys()
    for key, value in sd_in.items():
        assert torch.equal(sd_out[key], value), key
    assert _hf_logits(tmp_path / "out").equal(_hf_logits(tmp_path / "hf"))


def _imported_logits(ck, tokens=TOKENS) -> torch.Tensor:
    """Logits of the one-process model of the checkpoint `ck` (fp32, eval mode)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    _, model_cfg, state, _ = hf_convert.load_full_checkpoint(str(ck))
    model = GPTModel(model_cfg, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    return _ours_logits(model.float())


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu2"])
def test_gpt2_import_keeps_its_activation(tmp_path, act):
    """GPT-2's activation_function 'gelu' is the erf GeLU. Imported as our default
    activation it became the tanh form (Megatron-LM's fused bias-GeLU, on with biases):
    the logits moved by ~3e-4 on this tiny model and a re-export said gelu_new."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB + 1, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                        activation_function=act, bos_token_id=VOCAB, eos_token_id=VOCAB)
    hf_model = tf.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # larger weights: the GeLU forms differ by more
        for p in hf_model.parameters():
            p.mul_(4)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits
    diff = (_imported_logits(tmp_path / "ck")[..., :VOCAB + 1] - theirs).abs().max().item()
    assert diff < TOL, f"{act}: max |logit diff| = {diff:.2e}"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "out") == 0
    out_act = json.loads((tmp_path / "out" / "config.json").read_text())["activation_function"]
    assert out_act == {"gelu_pytorch_tanh": "gelu_new"}.get(act, act)


def test_llama_import_takes_swish_as_silu(tmp_path):
    """transformers' hidden_act 'swish' is nn.SiLU, as 'silu': it was refused."""
    tf = _transformers()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                         hidden_act="swish", bos_token_id=VOCAB, eos_token_id=VOCAB)
    hf_model = tf.LlamaForCausalLM(cfg).eval()
    hf_model.save_pretrained(str(tmp_path / "hf"))
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits
    assert (_imported_logits(tmp_path / "ck")[..., :VOCAB + 1] - theirs).abs().max() < TOL


@pytest.mark.parametrize("kind,window", [("mistral", None), ("mistral", 12), ("qwen2", 8)])
def test_mistral_and_qwen2_import_as_llama(tmp_path, capsys, kind, window):
    """Mistral (Llama with GQA and a sliding window) and Qwen2 (q/k/v biases alone) were
    refused as unknown model_types. A window shorter than --seq-length is refused naming
    sliding_window; one that covers it imports with a note; Qwen2's o_proj and MLP biases
    are zeros (Qwen2's window is off without use_sliding_window)."""
    tf = _transformers()
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=window)
    hf_model = (tf.MistralForCausalLM(tf.MistralConfig(**shape)) if kind == "mistral"
                else tf.Qwen2ForCausalLM(tf.Qwen2Config(**shape))).eval()
    with torch.no_grad():  # norms and q/k/v biases away from their 1 / 0 init
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf_model.save_pretrained(str(tmp_path / "hf"))
    argv = ("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck")
    if kind == "mistral" and window:
        with pytest.raises(SystemExit, match="sliding_window 12 is shorter than --seq-length 16"
                                             ".* pass --seq-length 12 or less"):
            _cli(*argv)
        argv += ("--seq-length", window)
    assert _cli(*argv) == 0
    out = capsys.readouterr().out
    assert ("note: config.json sliding_window 12" in out) == (window == 12)
    assert ("note: Qwen2 has biases on q/k/v only" in out) == (kind == "qwen2")
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits  # 12 tokens: within the window
    diff = (_imported_logits(tmp_path / "ck")[..., :VOCAB + 1] - theirs).abs().max().item()
    assert diff < TOL, f"{kind}: max |logit diff| = {diff:.2e}"
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "out",
                "--verify") == 0


def test_from_hf_of_a_llama_says_nothing_of_megatrons_swiglu_width(tmp_path, caplog):
    """A Llama's intermediate_size (96) is not --swiglu's rule (64 for hidden 32): from-hf
    warned "--ffn-hidden-size 96 kept; Megatron-LM 23.05 replaces it", a flag the user never
    gave and a width the weights fix. A run given that width is still told (test_arguments_
    validation), and the filter is gone after the import."""
    tf = _transformers()
    cfg = tf.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=16)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    with caplog.at_level("INFO", logger="megatron.arguments"):
        assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck") == 0
        assert "ffn-hidden-size" not in caplog.text and "setting global batch size" in caplog.text
        parse_and_validate(f"{TINY} {LLAMA} --ffn-hidden-size 96".split(), world_size=1, env={},
                           cuda_available=False)
    assert "--swiglu with --ffn-hidden-size 96: the MLP width is this value" in caplog.text
    _, model_cfg, _, _ = hf_convert.load_full_checkpoint(str(tmp_path / "ck"))
    assert model_cfg.ffn_hidden_size == 96


def _from_hf_tp2_worker(rank, world_size, ck, flags, save):
    tr, losses, loaded = _train(save, f"{flags} --tensor-model-parallel-size 2", world_size,
                                rank, steps=2, load=ck)
    return loaded, losses, tr.state.iteration


def test_from_hf_checkpoint_trains_in_tp2_run(tmp_path):
    hf_model = _save_hf_model(tmp_path / "hf", "llama").eval()
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck",
                "--tensor-model-parallel-size", 2) == 0
    _, flags = hf_interop.megatron_flags_from_hf(json.loads((tmp_path / "hf" / "config.json")
                                                            .read_text()))
    results = run_distributed(_from_hf_tp2_worker, 2, str(tmp_path / "ck"), " ".join(flags),
                              str(tmp_path / "cont"))
    ours = torch.cat([r[0] for r in results], dim=-1)[..., :VOCAB + 1]
    with torch.no_grad():
        theirs = hf_model(input_ids=TOKENS).logits
    diff = (ours - theirs).abs().max().item()
    print(f"from-hf llama -> tp2 run: max |logit diff| = {diff:.2e}")
    assert diff < TOL
    losses = results[0][1]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert results[0][2] == 2 and losses[1] < losses[0]
    assert (tmp_path / "cont" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_from_hf_refuses_a_save_holding_a_checkpoint(tmp_path, capsys):
    """from-hf into a run's --save directory would point its tracker at 'release' (a
    resume would restart from the import): refused before reading the model; --overwrite
    writes it, saying what it replaces, and keeps the run's iterations."""
    _train(tmp_path / "ck", "", steps=1)
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf") == 0
    for layout in ([], ["--tensor-model-parallel-size", 2]):
        with pytest.raises(SystemExit, match="already holds a checkpoint: latest_checkpointed_"
                           r"iteration.txt \('1'\), iter_0000001; .* add --overwrite"):
            _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck", *layout)
        assert sorted(os.listdir(tmp_path / "ck")) == ["iter_0000001",
                                                       "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    for _ in range(2):  # the second time the release directory itself is replaced
        assert _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck",
                    "--overwrite") == 0
    out = capsys.readouterr().out
    assert "said '1', now 'release'" in out and f"replacing {tmp_path / 'ck' / 'release'}" in out
    # the steps of a large import take minutes each: each is announced
    assert f"reading the Hugging Face model in {tmp_path / 'hf'} ..." in out
    assert f"tensors to {tmp_path / 'ck'} ..." in out
    assert sorted(os.listdir(tmp_path / "ck")) == ["iter_0000001",
                                                   "latest_checkpointed_iteration.txt", "release"]
    assert not [p for p in os.listdir(tmp_path) if ".from-hf-" in p]


def test_from_hf_into_a_directory_a_run_saves_into_is_refused(tmp_path):
    """A training run holds its --save's lock (megatron/save_lock.py); from-hf into that
    directory, at tp 1 (moved into place) or tp 2 (resharded into it), wrote its release
    checkpoint and pointed the run's tracker at it. Now it stops with one line naming
    the run, leaving the directory as it was; the lock is taken once (the reshard it runs
    is inside it)."""
    from megatron.save_lock import LOCK_NAME, SaveDirLock

    _save_hf_model(tmp_path / "hf", "llama")
    ck = tmp_path / "ck"
    ck.mkdir()
    with SaveDirLock(str(ck)) as run:
        assert run.acquire() is None
        for layout in ([], ["--tensor-model-parallel-size", 2]):
            with pytest.raises(SystemExit, match=rf"^error: --save {ck} is in use by another "
                               r"training run \(host "):
                _cli("from-hf", "--input", tmp_path / "hf", "--save", ck, *layout)
            assert os.listdir(ck) == [LOCK_NAME]
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", ck,
                "--tensor-model-parallel-size", 2) == 0
    assert sorted(os.listdir(ck)) == ["latest_checkpointed_iteration.txt", "release"]


def test_to_hf_refuses_a_vocabulary_without_the_eod_id(tmp_path):
    """NullTokenizer --vocab-size 100: ids 0..99 and the end-of-document id 100. Keeping
    100 rows would write eos/bos 100 outside the exported vocabulary: refused, nothing
    written."""
    _train(tmp_path / "ck", "", steps=1)
    with pytest.raises(SystemExit, match="--true-vocab-size 100 leaves out the end-of-"
                       r"document id 100 .*\(101 ids\).*pass --true-vocab-size 101 or more"):
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf",
             "--true-vocab-size", 100)
    assert not (tmp_path / "hf").exists()
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf",
                "--true-vocab-size", 101) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 100


def test_to_hf_frees_the_merged_model_before_writing(tmp_path, monkeypatch):
    """Without --verify the merged checkpoint state is dropped once the Hugging Face copies
    exist: writing (safetensors serialises a further copy) does not hold three models."""
    import gc
    import weakref

    _train(tmp_path / "ck", "", steps=1)
    load, save, refs, alive = hf_convert.load_full_checkpoint, hf_convert.save_hf_checkpoint, [], []

    def loading(*args, **kwargs):
        out = load(*args, **kwargs)
        refs.append(weakref.ref(next(iter(out[2].values()))))
        return out

    def saving(*args, **kwargs):
        gc.collect()
        alive.append(refs[0]() is not None)
        return save(*args, **kwargs)

    monkeypatch.setattr(hf_convert, "load_full_checkpoint", loading)
    monkeypatch.setattr(hf_convert, "save_hf_checkpoint", saving)
    assert _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf") == 0
    assert alive == [False]


def test_from_hf_names_the_flags_to_train_from_the_import(tmp_path, capsys):
    """from-hf said 'train from it with pretrain_gpt.py --load OUT and the same model
    flags' without naming them (they come from config.json), and printed a WARNING about a
    --log-interval nobody passed. It now names --use-checkpoint-args and the flags."""
    _save_hf_model(tmp_path / "hf", "llama")
    out = tmp_path / "my ck"
    assert _cli("from-hf", "--input", tmp_path / "hf", "--save", out) == 0
    printed = capsys.readouterr()
    assert "WARNING" not in printed.err and "--log-interval" not in printed.err
    last = printed.out.strip().splitlines()[-1]
    assert f"pretrain_gpt.py --load '{out}' --use-checkpoint-args" in last
    flags = shlex.split(last.split("model flags: ")[1])
    _, model_flags = hf_interop.megatron_flags_from_hf(
        json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert flags[:len(model_flags)] == model_flags
    assert flags[len(model_flags):] == ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                                        str(VOCAB), "--make-vocab-size-divisible-by", "128",
                                        "--seq-length", "16"]


@pytest.mark.parametrize("given,words", [
    ("gpt2", "does not exist; from-hf reads a local directory, not a Hugging Face Hub name: "
             "download it first (huggingface-cli download gpt2 --local-dir DIR)"),
    ("hf/config.json", "is a file; pass the model directory that holds it and its "
                       "config.json: --input {tmp}/hf"),
    ("empty", "no config.json there"),
])
def test_from_hf_input_mistakes_name_the_fix(tmp_path, monkeypatch, given, words):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    path = given if given == "gpt2" else str(tmp_path / given)
    with pytest.raises(SystemExit) as err:
        _cli("from-hf", "--input", path, "--save", tmp_path / "out")
    assert f"error: --input {path}" in str(err.value)
    assert words.format(tmp=tmp_path) in str(err.value)
    assert not (tmp_path / "out").exists()


GPT2_CONFIG = '{"model_type": "gpt2", "vocab_size": 10, "n_layer": 1}'
EXPECTED = ("from-hf reads a Hugging Face model directory as save_pretrained writes it "
            "(config.json and model.safetensors or pytorch_model.bin")


@pytest.mark.parametrize("files,words", [
    ({}, "no config.json there; " + EXPECTED),
    ({"latest_checkpointed_iteration.txt": "2"}, "no config.json there; it is a checkpoint in "
     "Megatron-LM's layout (latest_checkpointed_iteration.txt), which needs no import: pass "
     "it to --load as it is"),
    ({"config.json": "{not json"}, "config.json does not parse as JSON ("),
    ({"config.json": '{"vocab_size": 10}'}, "config.json has no model_type, so it is not a "
     "model's config; " + EXPECTED),
    # the model_type is checked before any weight file is read (this one is no safetensors)
    ({"config.json": '{"model_type": "bert"}', "model.safetensors": ""},
     "config.json model_type 'bert' is not supported; from-hf reads gpt2, llama, mistral, qwen2 models"),
    # quantized weights (with scales beside them) were refused as "parts we do not
    # implement", or, without scales, their integers taken as weights
    ({"config.json": '{"model_type": "llama", "quantization_config": {"quant_method": '
      '"fp8"}}', "model.safetensors": ""}, "config.json has quantization_config (quant_method "
     "'fp8'): the weights are stored quantized"),
    ({"config.json": GPT2_CONFIG}, "config.json but no weights (no *.safetensors or "
     "pytorch_model*.bin); " + EXPECTED),
    ({"config.json": GPT2_CONFIG, "model.safetensors": ""},
     "model.safetensors is not a readable safetensors file (Error while deserializing header"),
    ({"config.json": GPT2_CONFIG, "model.safetensors.index.json":
      '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'},
     "model.safetensors.index.json names 1 file(s) that are not there "
     "(model-00001-of-00002.safetensors); download every shard"),
    ({"config.json": GPT2_CONFIG, "model.safetensors.index.json": "{}"},
     "model.safetensors.index.json is not a shard index"),
    # a damaged or crafted index: a number (a TypeError traceback before), or a path out
    # of the directory (another model's weights, or any file, silently read before)
    ({"config.json": GPT2_CONFIG, "model.safetensors.index.json": '{"weight_map": {"a": 1}}'},
     "model.safetensors.index.json names 1 as shard file(s); a shard is named by a file "
     "name inside the model directory"),
    ({"config.json": GPT2_CONFIG, "model.safetensors.index.json":
      '{"weight_map": {"a": "../other/model.safetensors"}}', "../other/model.safetensors": ""},
     "model.safetensors.index.json names '../other/model.safetensors' as shard file(s)"),
    ({"config.json": GPT2_CONFIG, "model.safetensors.index.json":
      '{"weight_map": {"a": "/etc/passwd", "b": "ok.safetensors"}}', "ok.safetensors": ""},
     "model.safetensors.index.json names '/etc/passwd' as shard file(s)"),
])
def test_from_hf_on_a_directory_that_is_not_a_model_says_what_is_missing(tmp_path, files,
                                                                          words):
    """One line naming the directory, what is missing and what is expected; before, an
    unsupported model_type was found after every weight was read and did not name the
    directory, bad JSON gave only the parser's words, and an unreadable or missing weights
    file a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    with pytest.raises(SystemExit) as err:
        _cli("from-hf", "--input", src, "--save", tmp_path / "out")
    text = str(err.value)
    assert text.startswith(f"error: --input {src}: ") and "\n" not in text, text
    assert words in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, given, words", [
    ("llama", ["--tensor-model-parallel-size", 4], "--tensor-model-parallel-size 4 does not "
     r"divide the model's num_key_value_heads 2 \(config.json\)"
     ".*pass --tensor-model-parallel-size 1 or 2$"),
    ("gpt2", ["--tensor-model-parallel-size", 3], "--tensor-model-parallel-size 3 does not "
     r"divide the model's n_head 4 and n_inner \(or 4 x n_embd\) 128 "
     ".*pass --tensor-model-parallel-size 1 or 2 or 4$"),
    ("llama", ["--pipeline-model-parallel-size", 3], "--pipeline-model-parallel-size 3 does not "
     "divide the model's num_hidden_layers 2 .*pass --pipeline-model-parallel-size 1 or 2$"),
    ("gpt2", ["--seq-length", 32], "--seq-length 32 is larger than the model's n_positions 16 "
     r"\(config.json\); pass --seq-length 16 or less$")])
def test_from_hf_layout_the_model_cannot_take_names_its_config_field(tmp_path, family, given,
                                                                     words):
    """The general checks advised changing the model (--num-query-groups 2, --num-layers 3,
    --max-position-embeddings 32): from-hf takes the shape from config.json, so its message
    names the field and the sizes that fit."""
    _save_hf_model(tmp_path / "hf", family)
    with pytest.raises(SystemExit, match=f"^error: {words}"):
        _cli("from-hf", "--input", tmp_path / "hf", "--save", tmp_path / "ck", *given)
    assert not (tmp_path / "ck").exists()


def test_llama_export_takes_a_rotary_percent_of_one_or_more():
    """--rotary-percent 1 or above rotates whole heads (as in Megatron-LM), which is Llama's
    rotary; below 1 is refused."""
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 1 --lr 1e-4 "
            "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data --normalization RMSNorm "
            "--swiglu --position-embedding-type rope --no-position-embedding "
            "--untie-embeddings-and-output-weights --disable-bias-linear")
    for percent, ok in (("1.0", True), ("1.5", True), ("0.5", False)):
        cfg = parse_and_validate(shlex.split(f"{base} --rotary-percent {percent}"), world_size=1,
                                 env={"RANK": "0"}, cuda_available=False)
        problems = hf_interop.family_problems(cfg.model, "llama")
        assert not any("rotary" in p for p in problems) if ok else problems, (percent, problems)


@pytest.mark.parametrize("version, keyword", [("4.46.3", "torch_dtype"), ("4.55.4", "torch_dtype"),
                                              ("4.56.0", "dtype"), ("5.0.0.dev0", "dtype")])
def test_from_pretrained_dtype_keyword_follows_the_installed_transformers(monkeypatch, version,
                                                                          keyword):
    """to-hf --verify loads the export with transformers: before 4.56 its keyword is
    torch_dtype (a `dtype=` went into the model config, and saving failed)."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", version)
    assert hf_convert.dtype_kwarg(torch.float32) == {keyword: torch.float32}


@pytest.mark.parametrize("given", ["0", "-1", "129"])
def test_to_hf_refuses_a_true_vocab_size_outside_the_rows_naming_it(tmp_path, given):
    """--true-vocab-size 0 was taken as not given (the export kept the tokenizer's 101 ids),
    -1 was reported as leaving out the end-of-document id, 129 as 'vocab size 129' without
    the flag. Each is refused before the weights are read, naming the flag and the rows."""
    _train(tmp_path / "ck", "", steps=1)
    with pytest.raises(SystemExit) as exc:
        _cli("to-hf", "--load", tmp_path / "ck", "--output", tmp_path / "hf",
             f"--true-vocab-size={given}")
    assert f"--true-vocab-size {given} is outside [1, 128]" in str(exc.value)
    assert not (tmp_path / "hf").exists()
