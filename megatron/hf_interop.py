"""Hugging Face interop: our GPT state dict <-> `GPT2LMHeadModel` / `LlamaForCausalLM`.

Both directions work on FULL state dicts (tensor-parallel size 1, one pipeline stage, keys
as `GPTModel(config).state_dict()` names them); merging and splitting shards is the job of
the checkpoint resharding code, the convert commands that use both live in
megatron/hf_convert.py (to-hf) and megatron/hf_import.py (from-hf), and reading and
writing model directories in megatron/hf_files.py.
Shapes: n = attention heads, g = query groups (key/value heads), d = kv_channels,
h = hidden, f = ffn hidden, V = vocabulary.

    ours                                                  GPT-2 (Conv1D: weight is [in, out])
    embedding.word_embeddings.weight [V_pad, h]           transformer.wte.weight [V, h]
    embedding.position_embeddings.weight                  transformer.wpe.weight
    layers.i.input_layernorm.{weight,bias}                transformer.h.i.ln_1
    layers.i.self_attention.query_key_value [(n+2g)d, h]  transformer.h.i.attn.c_attn [h, 3h]
    layers.i.self_attention.dense [h, nd]                 transformer.h.i.attn.c_proj [nd, h]
    layers.i.post_attention_layernorm                     transformer.h.i.ln_2
    layers.i.mlp.dense_h_to_4h [f, h]                     transformer.h.i.mlp.c_fc [h, f]
    layers.i.mlp.dense_4h_to_h [h, f]                     transformer.h.i.mlp.c_proj [f, h]
    encoder.final_layernorm                               transformer.ln_f
    output_layer.weight (untied only)                     lm_head.weight (untied only)

    Llama (nn.Linear: weight is [out, in]): model.embed_tokens, model.layers.i.
    input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
    mlp.{gate,up,down}_proj, model.norm, lm_head.

Our fused QKV rows are grouped per query group: [q x (n/g), k, v] blocks of d rows. GPT-2's
c_attn columns are [all q heads; all k heads; all v heads]; Llama keeps q, k, v apart. Our
SwiGLU fc1 rows are [gate; up]. Rotary: ours rotates the two halves of each head
("rotate half", angles cat(freqs, freqs)), which is Hugging Face Llama's convention, so
q/k rows need no permutation. Our padded vocabulary rows are cut on export (to the
tokenizer's size) and filled with copies of the last real row on import (as Megatron-LM's
converters pad: see `_pad_rows`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.config import ModelConfig

FAMILIES = ("gpt2", "llama")
_L = "language_model.encoder.layers.{i}."
_EMB = "language_model.embedding."
_ACT_TO_HF = {"gelu": "gelu", "openai_gelu": "gelu_new", "squared_relu": "relu2"}
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu",
                "gelu_fast": "openai_gelu", "relu2": "squared_relu"}
# the erf GeLU needs --no-bias-gelu-fusion: with biases (GPT-2 has them) Megatron-LM's fused
# bias-GeLU, on by default, computes the tanh form (arguments_validate.activation_of)
_ACT_FLAG = {"gelu": ["--no-bias-gelu-fusion"], "openai_gelu": ["--openai-gelu"],
             "squared_relu": ["--squared-relu"]}


# ------------------------------------------------------------------------ families
def family_problems(model: ModelConfig, family: str) -> List[str]:
    """Why `model` cannot be written as `family` ("gpt2" | "llama"); empty when it can."""
    if family not in FAMILIES:
        raise ValueError(f"unknown Hugging Face family {family!r}; choose one of {FAMILIES}")
    problems = []
    if model.num_experts:
        problems.append(f"--num-experts {model.num_experts} (no Hugging Face {family} class "
                        "has a top-1 switch MLP)")
    if model.apply_residual_connection_post_layernorm:
        problems.append("--apply-residual-connection-post-layernorm (no HF equivalent)")
    both = model.position_embedding_type == "rope+learned"
    if both:
        problems.append("learned absolute and rotary positions together (--use-rotary-"
                        "position-embeddings without --no-position-embedding): neither "
                        "GPT2LMHeadModel nor LlamaForCausalLM has both")
    if family == "gpt2":
        if model.normalization != "LayerNorm":
            problems.append(f"normalization {model.normalization} (GPT-2 uses LayerNorm)")
        if model.position_embedding_type != "learned_absolute" and not both:
            problems.append(f"position embedding {model.position_embedding_type} "
                            "(GPT-2 learns absolute positions)")
        if model.activation not in _ACT_TO_HF:
            problems.append(f"activation {model.activation} (GPT-2 has no gated MLP)")
        if model.num_query_groups != model.num_attention_heads:
            problems.append(f"{model.num_query_groups} query groups (GPT-2 has no GQA)")
        if model.kv_channels * model.num_attention_heads != model.hidden_size:
            problems.append(f"kv_channels {model.kv_channels} x heads != hidden size")
    else:
        if model.normalization != "RMSNorm":
            problems.append(f"normalization {model.normalization} (Llama uses RMSNorm)")
        if (model.position_embedding_type != "rope" and not both) or model.rotary_percent < 1.0:
            problems.append(f"position embedding {model.position_embedding_type} with rotary "
                            f"percent {model.rotary_percent} (Llama rotates whole heads; a percent of 1 or more does too)")
        if not model.swiglu:
            problems.append(f"activation {model.activation} (Llama uses SwiGLU)")
        if model.hidden_size % model.num_attention_heads:
            problems.append("hidden size not divisible by the number of heads")
    return problems


def detect_family(model: ModelConfig) -> str:
    """"llama" for RMSNorm + SwiGLU + rotary models, "gpt2" for LayerNorm + learned
    positions; ValueError listing what fits neither."""
    for family in ("llama", "gpt2"):
        if not family_problems(model, family):
            return family
    why = "; ".join(f"{f}: {', '.join(family_problems(model, f))}" for f in FAMILIES)
    raise ValueError(f"this model fits no Hugging Face family we export ({why})")


# ------------------------------------------------------------------- tensor helpers
def split_qkv(w: torch.Tensor, model: ModelConfig) -> Tuple[torch.Tensor, ...]:
    """Our fused QKV weight [(n+2g)d, ...] (or bias) -> q [nd, ...], k [gd, ...], v [gd, ...]."""
    n, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    rest = w.shape[1:]
    x = w.reshape(g, n // g + 2, d, *rest)
    q = x[:, : n // g].reshape(n * d, *rest)
    return q, x[:, n // g].reshape(g * d, *rest), x[:, n // g + 1].reshape(g * d, *rest)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Inverse of `split_qkv`: per query group [q x (n/g), k, v] blocks of d rows."""
    n, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    rest = q.shape[1:]
    blocks = [q.reshape(g, n // g, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)]
    return torch.cat(blocks, dim=1).reshape((n + 2 * g) * d, *rest)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """`w` grown to `rows` rows by repeating its last row, as Megatron-LM's converters pad.
    Zero rows would give every padding id a logit of 0, far above a trained GPT-2's (its
    logits are tens below zero): the padding ids would take nearly all the probability and
    the imported model's loss would be wrong by that much."""
    if w.shape[0] > rows:
        raise ValueError(f"vocabulary of {w.shape[0]} rows does not fit the padded size {rows}")
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w[-1:].expand(rows - w.shape[0], *w.shape[1:])])


def _norm_weight(w: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    one_p = model.apply_layernorm_1p and model.normalization == "LayerNorm"
    return w + 1 if one_p else w  # LayerNorm1P stores gamma - 1


# ------------------------------------------------------------------------ ours -> HF
def _gpt2_layer_to_hf(sd: dict, i: int, model: ModelConfig, out: dict) -> None:
    p, h = _L.format(i=i), f"transformer.h.{i}."
    like = sd[p + "self_attention.dense.weight"]
    bias = lambda key, rows: sd.get(p + key + ".bias", like.new_zeros(rows))  # GPT-2 has biases
    for ours, hf in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
        out[h + hf + ".weight"] = _norm_weight(sd[p + ours + ".weight"], model)
        out[h + hf + ".bias"] = sd[p + ours + ".bias"]
    qkv = "self_attention.query_key_value"
    out[h + "attn.c_attn.weight"] = torch.cat(split_qkv(sd[p + qkv + ".weight"], model)).t()
    out[h + "attn.c_attn.bias"] = torch.cat(split_qkv(bias(qkv, 3 * model.hidden_size), model))
    for ours, hf, rows in (("self_attention.dense", "attn.c_proj", model.hidden_size),
                           ("mlp.dense_h_to_4h", "mlp.c_fc", model.ffn_hidden_size),
                           ("mlp.dense_4h_to_h", "mlp.c_proj", model.hidden_size)):
        out[h + hf + ".weight"] = sd[p + ours + ".weight"].t()  # Conv1D: [in, out]
        out[h + hf + ".bias"] = bias(ours, rows)


def _llama_layer_to_hf(sd: dict, i: int, model: ModelConfig, out: dict) -> None:
    p, h = _L.format(i=i), f"model.layers.{i}."
    out[h + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
    out[h + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    names = ("weight", "bias") if model.add_bias_linear else ("weight",)
    for kind in names:
        q, k, v = split_qkv(sd[f"{p}self_attention.query_key_value.{kind}"], model)
        out[f"{h}self_attn.q_proj.{kind}"] = q
        out[f"{h}self_attn.k_proj.{kind}"] = k
        out[f"{h}self_attn.v_proj.{kind}"] = v
        out[f"{h}self_attn.o_proj.{kind}"] = sd[f"{p}self_attention.dense.{kind}"]
        gate, up = torch.chunk(sd[f"{p}mlp.dense_h_to_4h.{kind}"], 2, dim=0)
        out[f"{h}mlp.gate_proj.{kind}"] = gate
        out[f"{h}mlp.up_proj.{kind}"] = up
        out[f"{h}mlp.down_proj.{kind}"] = sd[f"{p}mlp.dense_4h_to_h.{kind}"]


def _drop_zero_biases(out: dict) -> None:
    """Llama switches attention and MLP biases separately (attention_bias, mlp_bias); we
    have one switch. A set that is zero everywhere (as an import fills it) is left out."""
    for names in (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")):
        keys = [k for k in out if k.endswith(".bias") and k.split(".")[-2] in names]
        if keys and not any(out[k].any() for k in keys):
            for k in keys:
                del out[k]


def to_hf_state_dict(sd: Dict[str, torch.Tensor], model: ModelConfig, family: str,
                     vocab_size: int, dtype: Optional[torch.dtype] = None
                     ) -> Dict[str, torch.Tensor]:
    """Our full state dict -> the Hugging Face `family` state dict (contiguous tensors, the
    first `vocab_size` vocabulary rows; `dtype` None keeps each tensor's dtype). Tied
    models carry no `lm_head.weight` (transformers ties it on load)."""
    problems = family_problems(model, family)
    if problems:
        raise ValueError(f"cannot export as {family}: {'; '.join(problems)} (--family auto "
                         "picks the family that fits)")
    if not 0 < vocab_size <= model.padded_vocab_size:
        raise ValueError(f"vocab size {vocab_size} outside [1, {model.padded_vocab_size}] "
                         "(the padded vocabulary); pass the tokenizer's vocabulary size")
    out: Dict[str, torch.Tensor] = {}
    words = sd[_EMB + "word_embeddings.weight"][:vocab_size]
    if family == "gpt2":
        out["transformer.wte.weight"] = words
        out["transformer.wpe.weight"] = sd[_EMB + "position_embeddings.weight"]
        final = "transformer.ln_f."
    else:
        out["model.embed_tokens.weight"] = words
        final = "model.norm."
    layer_fn = _gpt2_layer_to_hf if family == "gpt2" else _llama_layer_to_hf
    for i in range(model.num_layers):
        layer_fn(sd, i, model, out)
    out[final + "weight"] = _norm_weight(sd["language_model.encoder.final_layernorm.weight"], model)
    if family == "gpt2":
        out[final + "bias"] = sd["language_model.encoder.final_layernorm.bias"]
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["language_model.output_layer.weight"][:vocab_size]
    if family == "llama":
        _drop_zero_biases(out)
    return {k: (v if dtype is None else v.to(dtype)).contiguous().clone() for k, v in out.items()}


def hf_config(model: ModelConfig, family: str, vocab_size: int, dtype: torch.dtype,
              eos_token_id: Optional[int] = None,
              state: Optional[Dict[str, torch.Tensor]] = None) -> dict:
    """The `config.json` contents of the exported model (plain data, no transformers).
    `state` (the exported tensors) tells which Llama bias sets were written."""
    def has(proj: str) -> bool:
        if state is None:
            return model.add_bias_linear
        return any(k.endswith(f"{proj}.bias") for k in state)

    dtype_name = str(dtype).replace("torch.", "")
    common = {"vocab_size": vocab_size, "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
              "initializer_range": model.init_method_std, "dtype": dtype_name,
              "torch_dtype": dtype_name, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id}
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_embd": model.hidden_size, "n_layer": model.num_layers,
                "n_head": model.num_attention_heads, "n_inner": model.ffn_hidden_size,
                "n_positions": model.max_position_embeddings, "n_ctx": model.max_position_embeddings,
                "layer_norm_epsilon": model.layernorm_epsilon,
                "activation_function": _ACT_TO_HF[model.activation],
                "resid_pdrop": model.hidden_dropout, "embd_pdrop": model.hidden_dropout,
                "attn_pdrop": model.attention_dropout, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
            "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.num_query_groups, "head_dim": model.kv_channels,
            "max_position_embeddings": model.max_position_embeddings,
            "rms_norm_eps": model.layernorm_epsilon, "hidden_act": "silu",
            "rope_theta": model.rotary_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rotary_base},
            "attention_bias": has("q_proj"), "mlp_bias": has("gate_proj"),
            "attention_dropout": model.attention_dropout, "pretraining_tp": 1}


# ------------------------------------------------------------------------ HF -> ours
# model_types whose config.json fields and weight names are Llama's: Mistral is a Llama
# with GQA and a sliding attention window (`sliding_window_note`), Qwen2 one with biases on
# q/k/v (and its window only with use_sliding_window)
_LLAMA_LIKE = ("mistral", "qwen2")


def hf_family(cfg: dict) -> str:
    """config.json's family ("gpt2" | "llama"; mistral and qwen2 read as llama), checked
    before any weight is read: ValueError for another model_type and for quantized weights."""
    kind = cfg.get("model_type")
    if kind not in FAMILIES + _LLAMA_LIKE:
        raise ValueError(f"config.json model_type {kind!r} is not supported; from-hf reads "
                         f"{', '.join(FAMILIES + _LLAMA_LIKE)} models (GPT2LMHeadModel, "
                         "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"config.json has quantization_config (quant_method {method!r}): the "
                         "weights are stored quantized, with scales beside them, and from-hf "
                         "reads full-precision ones (float32, bfloat16, float16); import an "
                         "unquantized copy of the model")
    return "llama" if kind in _LLAMA_LIKE else kind


def sliding_window_note(cfg: dict, seq_length: int) -> Optional[str]:
    """None when config.json's attention window cannot matter here (none, or as long as
    max_position_embeddings); a note when it covers `seq_length` (--seq-length) but not
    every position; ValueError naming sliding_window when it is shorter than `seq_length`:
    our attention is full causal, so tokens further apart than the window would see each
    other, which the model never allowed."""
    window, layer_types = cfg.get("sliding_window"), cfg.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        return None  # transformers' per-layer kinds: no layer uses the window
    if cfg.get("model_type") == "qwen2" and not (
            cfg.get("use_sliding_window", False)
            and cfg.get("num_hidden_layers", 32) > cfg.get("max_window_layers", 28)):
        return None  # Qwen2's window: only with use_sliding_window, from max_window_layers on
    max_pos = cfg.get("max_position_embeddings", 2048)
    if window is None or window >= max_pos:
        return None
    if window < seq_length:
        raise ValueError(f"config.json sliding_window {window} is shorter than --seq-length "
                         f"{seq_length}: attention here is full causal (no sliding window), "
                         f"so tokens {window} or more positions apart would attend to "
                         f"each other, which this {cfg['model_type']} model never learned; pass "
                         f"--seq-length {window} or less")
    return (f"config.json sliding_window {window} is shorter than max_position_embeddings "
            f"{max_pos}: the import (full causal attention) has the model's logits for "
            f"sequences of up to {window} tokens; keep --seq-length at {window} or less")


def _gpt2_flags(cfg: dict) -> List[str]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"GPT-2 activation_function {act!r} has no equivalent here; supported: "
                         f"{sorted(_ACT_FROM_HF)}")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"GPT-2 config {key}={cfg[key]} is not supported (needs {ok})")
    h = cfg.get("n_embd", 768)
    flags = ["--num-layers", cfg.get("n_layer", 12), "--hidden-size", h,
             "--num-attention-heads", cfg.get("n_head", 12),
             "--ffn-hidden-size", cfg.get("n_inner") or 4 * h,
             "--max-position-embeddings", cfg.get("n_positions", 1024),
             "--layernorm-epsilon", cfg.get("layer_norm_epsilon", 1e-5),
             "--hidden-dropout", cfg.get("resid_pdrop", 0.1),
             "--attention-dropout", cfg.get("attn_pdrop", 0.1),
             *_ACT_FLAG[_ACT_FROM_HF[act]]]
    return flags + ([] if cfg.get("tie_word_embeddings", True)
                    else ["--untie-embeddings-and-output-weights"])


def _llama_theta(cfg: dict) -> float:
    # transformers reads rope_scaling (older configs) over rope_parameters (newer ones):
    # a scaling in either is one we do not have
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"Llama {key} rope_type {kind!r} (rope scaling) is not supported; "
                             "only plain rotary embeddings ('default') are")
        if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("Llama partial_rotary_factor != 1 is not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _llama_flags(cfg: dict) -> List[str]:
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: both nn.SiLU
        raise ValueError(f"Llama hidden_act {cfg['hidden_act']!r} is not supported (needs silu)")
    heads = cfg.get("num_attention_heads", 32)
    groups = cfg.get("num_key_value_heads") or heads
    h = cfg.get("hidden_size", 4096)
    flags = ["--num-layers", cfg.get("num_hidden_layers", 32), "--hidden-size", h,
             "--num-attention-heads", heads, "--ffn-hidden-size", cfg.get("intermediate_size", 11008),
             "--max-position-embeddings", cfg.get("max_position_embeddings", 2048),
             "--normalization", "RMSNorm", "--layernorm-epsilon", cfg.get("rms_norm_eps", 1e-6),
             "--position-embedding-type", "rope", "--rotary-base", _llama_theta(cfg),
             "--swiglu", "--hidden-dropout", 0.0,
             "--attention-dropout", cfg.get("attention_dropout", 0.0)]
    if cfg.get("head_dim") and cfg["head_dim"] != h // heads:
        flags += ["--kv-channels", cfg["head_dim"]]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", groups]
    # (Qwen2 has q/k/v biases and no switch: its o_proj and MLP biases are imported as
    # zeros, as the MLP's of a Llama with attention_bias alone)
    if not (cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("model_type") == "qwen2"):
        flags.append("--disable-bias-linear")
    return flags + ([] if cfg.get("tie_word_embeddings", False)
                    else ["--untie-embeddings-and-output-weights"])


def megatron_flags_from_hf(cfg: dict) -> Tuple[str, List[str]]:
    """(family, our model flags) describing the Hugging Face `config.json` contents `cfg`.
    ValueError naming the setting when the model uses something we do not implement."""
    family = hf_family(cfg)
    flags = _gpt2_flags(cfg) if family == "gpt2" else _llama_flags(cfg)
    return family, [str(f) for f in flags]


def _gpt2_layer_from_hf(hf: dict, i: int, model: ModelConfig, out: dict) -> None:
    p, h = _L.format(i=i), f"transformer.h.{i}."
    for ours, name in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
        out[p + ours + ".weight"] = hf[h + name + ".weight"]
        out[p + ours + ".bias"] = hf[h + name + ".bias"]
    q, k, v = torch.chunk(hf[h + "attn.c_attn.weight"].t(), 3, dim=0)
    out[p + "self_attention.query_key_value.weight"] = fuse_qkv(q, k, v, model)
    out[p + "self_attention.query_key_value.bias"] = fuse_qkv(
        *torch.chunk(hf[h + "attn.c_attn.bias"], 3), model)
    for ours, name in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                       ("mlp.dense_4h_to_h", "mlp.c_proj")):
        out[p + ours + ".weight"] = hf[h + name + ".weight"].t()
        out[p + ours + ".bias"] = hf[h + name + ".bias"]


def _llama_layer_from_hf(hf: dict, i: int, model: ModelConfig, out: dict) -> None:
    p, h = _L.format(i=i), f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
    out[p + "post_attention_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
    n, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    f, hsz = model.ffn_hidden_size, model.hidden_size
    rows = {"self_attn.q_proj": n * d, "self_attn.k_proj": g * d, "self_attn.v_proj": g * d,
            "self_attn.o_proj": hsz, "mlp.gate_proj": f, "mlp.up_proj": f, "mlp.down_proj": hsz}
    for kind in ("weight", "bias") if model.add_bias_linear else ("weight",):
        t = {}
        for name, n_rows in rows.items():
            key = f"{h}{name}.{kind}"
            # a bias set that only one of attention_bias / mlp_bias switches on: zeros
            missing_bias = kind == "bias" and key not in hf
            t[name] = hf[f"{h}{name}.weight"].new_zeros(n_rows) if missing_bias else hf[key]
        out[f"{p}self_attention.query_key_value.{kind}"] = fuse_qkv(
            t["self_attn.q_proj"], t["self_attn.k_proj"], t["self_attn.v_proj"], model)
        out[f"{p}self_attention.dense.{kind}"] = t["self_attn.o_proj"]
        out[f"{p}mlp.dense_h_to_4h.{kind}"] = torch.cat([t["mlp.gate_proj"], t["mlp.up_proj"]])
        out[f"{p}mlp.dense_4h_to_h.{kind}"] = t["mlp.down_proj"]


class _Tracked(dict):
    """A state dict that remembers which keys were read (to report unused weights)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _hf_shapes(model: ModelConfig, family: str, vocab: int) -> Dict[str, Tuple[int, ...]]:
    """The shape config.json implies for each Hugging Face tensor name (biases included;
    a name may be absent from the weights)."""
    n, g, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    h, f, top = model.hidden_size, model.ffn_hidden_size, model.num_layers
    if family == "gpt2":
        pre, final = "transformer.", ["transformer.ln_f.weight", "transformer.ln_f.bias"]
        shapes = {pre + "wte.weight": (vocab, h),
                  pre + "wpe.weight": (model.max_position_embeddings, h)}
        layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
                 "attn.c_attn.weight": (h, 3 * n * d), "attn.c_attn.bias": (3 * n * d,),
                 "attn.c_proj.weight": (n * d, h), "attn.c_proj.bias": (h,),
                 "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,),
                 "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,)}
        prefix = pre + "h.{i}."
    else:
        final, shapes = ["model.norm.weight"], {"model.embed_tokens.weight": (vocab, h)}
        rows = {"self_attn.q_proj": (n * d, h), "self_attn.k_proj": (g * d, h),
                "self_attn.v_proj": (g * d, h), "self_attn.o_proj": (h, n * d),
                "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        for name, shape in rows.items():
            layer.update({f"{name}.weight": shape, f"{name}.bias": shape[:1]})
        prefix = "model.layers.{i}."
    for i in range(top):
        shapes.update({prefix.format(i=i) + k: v for k, v in layer.items()})
    return {**shapes, **{k: (h,) for k in final}, "lm_head.weight": (vocab, h)}


def check_hf_shapes(hf: Dict[str, torch.Tensor], model: ModelConfig, family: str,
                    vocab: int) -> None:
    """ValueError naming the tensors whose shapes differ from what config.json (as `model`
    and its `vocab` rows) implies: weights and config.json of different models would
    otherwise convert into a checkpoint that fails to load, or into another model."""
    wrong = [f"{k} {list(hf[k].shape)} (config.json: {list(shape)})"
             for k, shape in _hf_shapes(model, family, vocab).items()
             if k in hf and tuple(hf[k].shape) != shape]
    if wrong:
        raise ValueError(
            f"the Hugging Face weights do not match their config.json ({len(wrong)} "
            f"tensor(s)): {'; '.join(wrong[:3])}{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}. "
            f"config.json reads vocab_size {vocab}, hidden {model.hidden_size}, "
            f"{model.num_attention_heads} heads of {model.kv_channels}, "
            f"{model.num_query_groups} key/value heads, ffn {model.ffn_hidden_size}: give the "
            "config.json saved with these weights")


def from_hf_state_dict(hf: Dict[str, torch.Tensor], model: ModelConfig, family: str,
                       vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """A Hugging Face `family` state dict -> our full state dict for `model` (whose
    `padded_vocab_size` decides the rows appended to the vocabulary, copies of its last). `vocab_size`
    (config.json's; None: the embedding's rows) and `model` give every tensor's shape:
    ValueError naming the tensors that differ."""
    pre, final = ("transformer.", "transformer.ln_f.") if family == "gpt2" else ("model.", "model.norm.")
    if not any(k.startswith(pre) for k in hf):  # saved from the base model (GPT2Model, ...)
        hf = {(k if k == "lm_head.weight" else pre + k): v for k, v in hf.items()}
    words_key = pre + ("wte.weight" if family == "gpt2" else "embed_tokens.weight")
    if vocab_size is None and words_key in hf:
        vocab_size = hf[words_key].shape[0]
    check_hf_shapes(hf, model, family, vocab_size or 0)
    hf = _Tracked(hf)
    words = hf[words_key]
    out = {_EMB + "word_embeddings.weight": _pad_rows(words, model.padded_vocab_size)}
    if family == "gpt2":
        out[_EMB + "position_embeddings.weight"] = hf["transformer.wpe.weight"]
    layer_fn = _gpt2_layer_from_hf if family == "gpt2" else _llama_layer_from_hf
    try:
        for i in range(model.num_layers):
            layer_fn(hf, i, model, out)
        out["language_model.encoder.final_layernorm.weight"] = hf[final + "weight"]
        if family == "gpt2":
            out["language_model.encoder.final_layernorm.bias"] = hf[final + "bias"]
        if model.untie_embeddings_and_output_weights:
            out["language_model.output_layer.weight"] = _pad_rows(hf["lm_head.weight"],
                                                                  model.padded_vocab_size)
    except KeyError as exc:
        raise ValueError(f"the Hugging Face weights lack {exc.args[0]!r}, which their "
                         f"config.json ({family}) implies") from None
    unused = sorted(k for k in hf if k not in hf.read and not k.endswith(_BUFFERS)
                    and not (k == "lm_head.weight" and not model.untie_embeddings_and_output_weights))
    if unused:
        raise ValueError(f"the Hugging Face weights hold tensors this {family} mapping does not "
                         f"use ({', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}): the "
                         "model has parts we do not implement")
    return {k: v.contiguous() for k, v in out.items()}
