"""Small stand-ins of checkpoints other programs write, for the tests of what --load says
about them (tests/test_foreign_checkpoints.py). Each has the directory layout and the file
names of its format and a few entries with its real key names; the tensors are tiny.

    hf_dir          Hugging Face save_pretrained: config.json + model.safetensors, or
                    sharded (model.safetensors.index.json, pytorch_model.bin.index.json)
    dist_checkpoint Megatron-Core distributed checkpoint (--ckpt-format torch_dist / zarr):
                    the tracker, iter_N/ with metadata.json, common.pt, *.distcp
    mcore_legacy    Megatron-LM with Megatron-Core models, --ckpt-format torch: 23.05's
                    layout, Megatron-Core's GPTModel key names (linear_qkv, linear_fc1, and
                    mlp.experts.local_experts.* with MoE); megatron_layout: any model state
    nemo_file / nemo_dir  a NeMo .nemo archive (model_config.yaml, model_weights.ckpt) or its
                    extracted directory; nemo2_dir: NeMo 2 (context/, weights/)
    deepspeed_dir   DeepSpeed: `latest`, global_stepN/mp_rank_00_model_states.pt,
                    zero_pp_rank_*_mp_rank_00_optim_states.pt, zero_to_fp32.py (and the
                    tracker file Megatron-DeepSpeed writes beside them)
    nanogpt_dir     nanoGPT's out/ckpt.pt (model, optimizer, model_args, iter_num, config)
    lightning_dir   PyTorch Lightning's lightning_logs/version_0/ (hparams.yaml,
                    checkpoints/epoch=E-step=S.ckpt) around a GPT-2-, Llama- or other model
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Dict, List

import torch

TRACKER = "latest_checkpointed_iteration.txt"

# 23.05's names -> Megatron-Core GPTModel's (the local transformer spec)
MCORE_NAMES = [
    ("language_model.embedding.", "embedding."),
    ("language_model.encoder.final_layernorm.", "decoder.final_layernorm."),
    ("language_model.encoder.layers.", "decoder.layers."),
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
    ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
]


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write(path: Path, text: str) -> Path:
    _mk(path.parent)
    path.write_text(text)
    return path


def _small_state() -> Dict[str, torch.Tensor]:
    return {"transformer.wte.weight": torch.zeros(8, 4), "lm_head.weight": torch.zeros(8, 4)}


def hf_dir(root: Path, kind: str = "safetensors") -> Path:
    """`kind`: safetensors, bin, sharded-safetensors, sharded-bin, weights-only (no
    config.json)."""
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    if kind != "weights-only":
        _write(root / "config.json", json.dumps({"model_type": "gpt2", "n_layer": 1}))
    if kind in ("safetensors", "weights-only"):
        save_file(_small_state(), str(root / "model.safetensors"))
    elif kind == "bin":
        torch.save(_small_state(), root / "pytorch_model.bin")
    else:
        ext = "safetensors" if kind == "sharded-safetensors" else "bin"
        stem = "model" if ext == "safetensors" else "pytorch_model"
        names = [f"{stem}-0000{i}-of-00002.{ext}" for i in (1, 2)]
        for name, key in zip(names, _small_state()):
            if ext == "safetensors":
                save_file({key: torch.zeros(8, 4)}, str(root / name))
            else:
                torch.save({key: torch.zeros(8, 4)}, root / name)
        _write(root / f"{stem}.{ext}.index.json",
               json.dumps({"metadata": {}, "weight_map": dict(zip(_small_state(), names))}))
    return root


def dist_files(path: Path, backend: str = "torch_dist") -> Path:
    """What Megatron-Core's dist_checkpointing.save writes into the directory `path`."""
    _write(path / "metadata.json", json.dumps({
        "sharded_backend": backend, "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"checkpoint_version": 3.0}, path / "common.pt")
    if backend == "zarr":
        _write(path / "decoder.layers.self_attention.linear_qkv.weight" / ".zarray", "{}")
    else:
        for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
            (path / name).write_bytes(b"\0" * 16)
    return path


def dist_checkpoint(root: Path, backend: str = "torch_dist", iteration: int = 100) -> Path:
    """A Megatron-Core distributed checkpoint under `root` (its tracker names `iteration`)."""
    _write(root / TRACKER, str(iteration))
    dist_files(root / f"iter_{iteration:07d}", backend)
    return root


def _layer_names_2305(layers: int) -> List[str]:
    out = ["language_model.embedding.word_embeddings.weight",
           "language_model.embedding.position_embeddings.weight"]
    for i in range(layers):
        for part in ("input_layernorm", "self_attention.query_key_value",
                     "self_attention.dense", "post_attention_layernorm", "mlp.dense_h_to_4h",
                     "mlp.dense_4h_to_h"):
            out += [f"language_model.encoder.layers.{i}.{part}.{k}" for k in ("weight", "bias")]
    return out + ["language_model.encoder.final_layernorm.weight",
                  "language_model.encoder.final_layernorm.bias"]


def mcore_names(layers: int = 2, moe: bool = False) -> List[str]:
    """Megatron-Core GPTModel's parameter names (local spec) of a `layers`-layer model; with
    `moe`, layer 0's MLP is two experts and a router."""
    names = []
    for name in _layer_names_2305(layers):
        for old, new in MCORE_NAMES:
            name = name.replace(old, new)
        names.append(name)
    if moe:
        dense = [n for n in names if n.startswith("decoder.layers.0.mlp.")]
        names = [n for n in names if n not in dense] + ["decoder.layers.0.mlp.router.weight"]
        names += [n.replace(".mlp.", f".mlp.experts.local_experts.{e}.") for e in (0, 1)
                  for n in dense]
    return names


def megatron_layout(root: Path, model: Dict[str, torch.Tensor], iteration: int = 2,
                    **args) -> Path:
    """A checkpoint in Megatron-LM 23.05's layout (tracker, one rank) whose payload is as a
    Megatron-LM release writes it: `args` a Namespace, the model state `model`."""
    path = root / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    ns = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4,
                            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            iteration=iteration, **args)
    torch.save({"args": ns, "checkpoint_version": 3.0, "iteration": iteration,
                "model": model}, path)
    _write(root / TRACKER, str(iteration))
    return root


def mcore_legacy(root: Path, moe: bool = False) -> Path:
    """Megatron-LM with Megatron-Core models, --ckpt-format torch: 23.05's layout, the model
    flat under Megatron-Core's names."""
    return megatron_layout(root, {n: torch.zeros(2) for n in mcore_names(moe=moe)},
                           use_mcore_models=True, ckpt_format="torch")


def nemo_dir(root: Path, weights: str = "ckpt") -> Path:
    """An extracted .nemo: model_config.yaml and `weights`: ckpt (model_weights.ckpt),
    tp2 (mp_rank_0X/model_weights.ckpt) or dist (model_weights/, a distributed
    checkpoint)."""
    _write(root / "model_config.yaml", "precision: bf16\nnum_layers: 2\nhidden_size: 32\n")
    state = {"model.language_model.embedding.word_embeddings.weight": torch.zeros(8, 4)}
    if weights == "ckpt":
        torch.save(state, root / "model_weights.ckpt")
    elif weights == "tp2":
        for rank in (0, 1):
            (root / f"mp_rank_0{rank}").mkdir()
            torch.save(state, root / f"mp_rank_0{rank}" / "model_weights.ckpt")
    else:
        dist_files(root / "model_weights")
    return root


def nemo_file(path: Path) -> Path:
    """A .nemo archive (a tar of `nemo_dir`'s files, as NeMo 1 writes it)."""
    src = nemo_dir(path.parent / (path.stem + "_src"))
    with tarfile.open(path, "w:") as tar:
        for name in sorted(os.listdir(src)):
            tar.add(src / name, arcname=f"./{name}")
    shutil.rmtree(src)
    return path


def nemo2_dir(root: Path) -> Path:
    """A NeMo 2 checkpoint: context/ (io.json, model.yaml) and weights/ (distributed)."""
    _write(root / "context" / "io.json", "{}")
    _write(root / "context" / "model.yaml", "_target_: nemo.collections.llm.gpt.model.GPTModel\n")
    dist_files(root / "weights")
    return root


def deepspeed_dir(root: Path, step: int = 50, megatron_tracker: bool = False) -> Path:
    """DeepSpeed's checkpoint; with `megatron_tracker` as Megatron-DeepSpeed writes it (a
    latest_checkpointed_iteration.txt naming `step` beside `latest`)."""
    tag = f"global_step{step}"
    _write(root / "latest", tag)
    if megatron_tracker:
        _write(root / TRACKER, str(step))
    _write(root / "zero_to_fp32.py", "# DeepSpeed's consolidation script\n")
    module = {"language_model.embedding.word_embeddings.weight": torch.zeros(8, 4)}
    torch.save({"module": module, "ds_version": "0.14.0", "iteration": step},
               _mk(root / tag) / "mp_rank_00_model_states.pt")
    for dp in (0, 1):
        torch.save({"optimizer_state_dict": {}, "ds_version": "0.14.0"},
                   root / tag / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")
    return root


def nanogpt_dir(root: Path) -> Path:
    """nanoGPT's `out/` directory with its ckpt.pt."""
    model_args = dict(n_layer=1, n_head=2, n_embd=4, block_size=8, bias=False, vocab_size=8,
                      dropout=0.0)
    torch.save({"model": {"transformer.wte.weight": torch.zeros(8, 4),
                          "transformer.h.0.attn.c_attn.weight": torch.zeros(12, 4)},
                "optimizer": {"state": {}, "param_groups": []}, "model_args": model_args,
                "iter_num": 2000, "best_val_loss": torch.tensor(1.5),
                "config": {"dataset": "shakespeare_char", "batch_size": 12}},
               _mk(root) / "ckpt.pt")
    return root


def lightning_dir(root: Path, model: str = "gpt2") -> Path:
    """Lightning's lightning_logs/version_0/ (`root`) as ModelCheckpoint leaves it, the
    LightningModule holding `model` (gpt2: Hugging Face GPT2LMHeadModel, llama:
    LlamaForCausalLM, other: a plain module) as `self.model`."""
    names = {"gpt2": ["model.transformer.wte.weight", "model.transformer.h.0.attn.c_attn.weight"],
             "llama": ["model.model.embed_tokens.weight",
                       "model.model.layers.0.self_attn.q_proj.weight"],
             "other": ["model.encoder.0.weight", "model.head.weight"]}[model]
    _write(root / "hparams.yaml", "lr: 0.001\n")
    torch.save({"epoch": 3, "global_step": 1200, "pytorch-lightning_version": "2.2.1",
                "state_dict": {n: torch.zeros(4, 4) for n in names}, "loops": {},
                "callbacks": {"ModelCheckpoint{'monitor': None}": {}},
                "optimizer_states": [{"state": {}, "param_groups": []}], "lr_schedulers": [],
                "hparams_name": "kwargs", "hyper_parameters": {"lr": 1e-3}},
               _mk(root / "checkpoints") / "epoch=3-step=1200.ckpt")
    return root
