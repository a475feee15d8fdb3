"""Incremental decoding: the GPT forward over new tokens only, with a key/value cache.

Shape legend: b = batch, s = new tokens of this call, L = positions in the cache after it
(start + s), h = hidden, n = attention heads, g = query groups (key/value heads),
d = head dim, V = padded vocabulary.

`forward_incremental(model, input_ids_bs, cache)` runs the tokens at positions
[cache.length, cache.length + s): the prompt as one call (prefill), then one token per
call. Each layer appends its new keys and values to the cache and its new queries attend
over every cached position up to their own (causal). It reuses the model's own modules --
embedding (learned positions), norms, QKV and output projections, MLP, residual rule,
final norm and output layer -- and the same rotary table (`rotary.rotary_table`, the
cache's own copy, read from the new positions' rows) and rotation
(`fused_rotary.split_and_rotate`), so the logits equal those of the full forward at the
same positions up to float rounding (fp32: within 1e-6 of the largest logit,
tests/test_kv_cache.py).

Scope: eval mode, any tensor-parallel size without sequence parallelism; the whole model in
one pipeline stage, or one rank's stage of a pipeline wrapped as a `PipelineGPT`
(pipeline_decode.py), which runs the same steps (`embed_step`, `layers_step`, `head_step`)
stage after stage, each stage caching its own layers. Under tensor parallelism every rank
of the group calls it with the same tokens: each rank caches the keys and values of its own query groups (the
split of the fused QKV weight), the row-parallel projections all-reduce as in training,
and the vocabulary-parallel logits are all-gathered over the group (`gather_vocab`), so
every rank returns the same full-vocabulary rows (tests/test_generate_tp.py: the logits of
tp = 2 equal those of tp = 1 within 1e-5 of the largest, fp32). This path is eager and
separate: it calls the layers' submodules directly and never the training forward, the
compiled layer graphs or their inputs, so training numerics and what torch.compile
captures are unchanged. Its one-token calls change shapes every token (launch-bound on a
GPU); static_decode.py runs them at static shapes on the same cache, replayable from a CUDA
graph. A cache holds at most `max_len` positions (<=
--max-position-embeddings); what to do past that is the caller's choice (tools/generate.py recomputes the sliding window without the cache).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.fused_rotary import split_and_rotate
from megatron.core.tensor_parallel import gather_from_tp

from .rotary import rotary_table
from .transformer import sdpa_backend


class KVCache:
    """Per-layer keys and values, [b, g, max_len, d] each, zero-filled at a layer's first
    write (in the dtype and on the device of its keys); `length` positions are filled.
    One cache serves one sequence (batch) from position 0 on; start a new one for another
    (or `reset` it: megatron/core/models/gpt/static_decode.py reuses its tensors).

    `position`, when set (static decoding), is `length` as a device tensor [1] (int64),
    which the static one-token step reads and advances without a host value; every call
    of `forward_incremental` keeps it equal to `length`."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"a key/value cache needs max_len >= 1 (got {max_len})")
        self.max_len = max_len
        self.length = 0
        self.keys: List[Optional[torch.Tensor]] = [None] * num_layers
        self.values: List[Optional[torch.Tensor]] = [None] * num_layers
        self.rotary: Optional[torch.Tensor] = None  # [2, >= max_len, 1, 1, rot]: cos, sin
        self.position: Optional[torch.Tensor] = None  # [1] int64 == length (static steps)

    def tensors(self, layer: int, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s whole key and value tensors [b, g, max_len, d], allocated at
        the first call as zeros shaped and typed after `k_bgsd` / `v_bgsd`. Zeros, not
        uninitialised memory: the static step reads every slot (masked, but a NaN left in
        a masked value slot would still reach the output as 0 * NaN)."""
        if self.keys[layer] is None:
            b, g, _, d = k_bgsd.shape
            self.keys[layer] = k_bgsd.new_zeros(b, g, self.max_len, d)
            self.values[layer] = v_bgsd.new_zeros(b, g, self.max_len, d)
        return self.keys[layer], self.values[layer]

    def append(self, layer: int, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values of the positions [length, length + s);
        return its keys and values of positions [0, length + s) (views into the cache)."""
        end = self.length + k_bgsd.shape[2]
        k_all, v_all = self.tensors(layer, k_bgsd, v_bgsd)
        k_all[:, :, self.length:end] = k_bgsd
        v_all[:, :, self.length:end] = v_bgsd
        return k_all[:, :, :end], v_all[:, :, :end]

    def reorder(self, rows_b: torch.Tensor) -> None:
        """Row i of every layer's keys and values becomes the old row `rows_b[i]` (int64,
        on the cache's device; beam search following the beams it chose), for the filled
        positions. In place: the tensors stay the same objects, so a static decoder's
        captured graph keeps reading them."""
        for t in self.keys + self.values:
            if t is not None:
                t[:, :, :self.length] = t[:, :, :self.length].index_select(0, rows_b)

    def reset(self) -> None:
        """Back to position 0 for a new sequence batch of the same size, keeping the
        tensors (zeroed again, so nothing of the last batch can reach the next)."""
        self.length = 0
        for t in self.keys + self.values:
            if t is not None:
                t.zero_()
        if self.position is not None:
            self.position.zero_()


def check_incremental(model) -> None:
    """ValueError naming the reason when `model` cannot decode with a cache."""
    if not (model.pre_process and model.post_process):
        raise ValueError("incremental decoding needs the whole model in one process "
                         "(pre_process and post_process), or every pipeline stage's share "
                         "wrapped as a PipelineGPT (pipeline_decode.py); merge pipeline "
                         "stages (tools/generate.py load_model) or wrap this stage")
    if model._tp_size() > 1 and model.config.sequence_parallel:
        raise ValueError("incremental decoding runs without sequence parallelism (the "
                         f"model has tensor-parallel size {model._tp_size()} with "
                         "sequence_parallel on); build it with sequence_parallel off")
    if model.training:
        raise ValueError("incremental decoding runs in eval mode (no dropout): call "
                         "model.eval() first")


def _attend(attn, q_bnsd, k_bgLd, v_bgLd) -> torch.Tensor:
    """The new queries (the last s of L positions) over the cached keys and values,
    causal. Prefill (s == L) runs what the full forward runs (is_causal, the configured
    kernel); one new token sees every position, so it needs no mask."""
    s, total = q_bnsd.shape[2], k_bgLd.shape[2]
    mask = None
    if 1 < s < total:  # several new tokens after a prefix: bottom-right causal mask
        pos = torch.arange(total, device=q_bnsd.device)
        mask = pos[None, :] <= pos[total - s:, None]  # [s, L], True = attend
    k_bgLd, v_bgLd, gqa = attn.grouped_kv(q_bnsd, k_bgLd, v_bgLd, mask)
    backend = attn.config.attention_backend if s == total else "auto"
    with sdpa_backend(backend):
        return F.scaled_dot_product_attention(
            q_bnsd, k_bgLd, v_bgLd, attn_mask=mask, is_causal=s == total and s > 1,
            scale=1.0 / math.sqrt(attn.d), **gqa)


def qkv_heads(attn, x_sbh, rotary_table):
    """The QKV projection of the new tokens split into heads, q and k rotated:
    q [b, n, s, d], k and v [b, g, s, d] (ParallelAttention.forward's first half)."""
    qkv, bias = attn.query_key_value(x_sbh)
    if bias is not None:
        qkv = qkv + bias
    if rotary_table is None:
        q, k, v = attn._split_qkv(qkv)  # [s, b, n|g, d]
    else:
        q, k, v = split_and_rotate(qkv, rotary_table, attn.g, attn.n // attn.g, attn.d)
    return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n|g, s, d]


def _attention_step(attn, x_sbh, rotary_table, cache: KVCache, layer: int):
    """ParallelAttention.forward for the new tokens, keys and values through the cache."""
    q, k, v = qkv_heads(attn, x_sbh, rotary_table)
    k_all, v_all = cache.append(layer, k, v)
    ctx = _attend(attn, q, k_all, v_all)
    b, _, s, _ = q.shape
    return attn.dense(ctx.permute(2, 0, 1, 3).reshape(s, b, attn.n * attn.d))


def layer_step(layer, x_sbh, attention):
    """TransformerLayer.forward (pre-LN, or post-LN residuals) with the self-attention
    replaced by `attention(self_attention, x_sbh)` -> (out, bias) (a cached one)."""
    ln = layer.input_layernorm(x_sbh)
    out, bias = attention(layer.self_attention, ln)
    if layer.config.apply_residual_connection_post_layernorm:
        x_sbh = layer._residual_dropout(out, bias, ln)
        ln = layer.post_attention_layernorm(x_sbh)
        out, bias = layer.mlp(ln)
        return layer._residual_dropout(out, bias, ln)
    x_sbh = layer._residual_dropout(out, bias, x_sbh)
    out, bias = layer.mlp(layer.post_attention_layernorm(x_sbh))
    return layer._residual_dropout(out, bias, x_sbh)


def rotary_table_of(model, cache: KVCache, device) -> Optional[torch.Tensor]:
    """The cache's rotary cos/sin table [2, >= max_len, 1, 1, rot], or None without rotary
    positions. The table is the cache's own, built as GPTModel builds its table (same
    function, same length when the cache fits in --seq-length, so the same values): the
    model's table, which the training forward passes to the compiled layers, is left as
    it is."""
    if model.rotary_dim is None:
        return None
    if cache.rotary is None or cache.rotary.device != device:
        length = max(cache.max_len, model.config.seq_length)
        cache.rotary = rotary_table(length, model.rotary_dim, model.config.rotary_base, device)
    return cache.rotary


def gather_vocab(model, logits_bsv: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [..., V] from the model's vocabulary-parallel ones [..., V/tp]:
    an all-gather of the last dim over `model.tp_group` (every rank of the group must call
    it; the identity at tp = 1). Every rank gets the same tensor, so the same sampling
    draws follow from the same generator."""
    return gather_from_tp(logits_bsv, model.tp_group)


def check_room(model, cache: KVCache, s: int) -> Tuple[int, int]:
    """(start, end): the positions `s` new tokens take after `cache`; ValueError when they
    would run past the cache or the model's positions."""
    start = cache.length
    end = start + s
    limit = min(cache.max_len, model.config.max_position_embeddings)
    if s < 1 or end > limit:
        raise ValueError(f"{s} new token(s) after {start} cached positions make {end}, "
                         f"over the cache's {cache.max_len} / the model's "
                         f"{model.config.max_position_embeddings} positions; start a new "
                         "cache on the last positions (recompute) instead")
    return start, end


def embed_step(model, input_ids_bs: torch.Tensor, start: int) -> torch.Tensor:
    """Hidden states [s, b, h] of the tokens at positions [start, start + s): the word
    (and learned position) embedding of a model that holds it (`pre_process`)."""
    lm = model.language_model
    position_ids = None
    if lm.embedding.position_embeddings is not None:
        end = start + input_ids_bs.shape[1]
        position_ids = torch.arange(start, end, device=input_ids_bs.device)[None]
    return lm.embedding(input_ids_bs, position_ids)


def layers_step(model, hidden_sbh: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """`model`'s transformer layers over the new positions [cache.length, + s), each
    layer's keys and values through `cache` (indexed by the model's own layers: a pipeline
    stage caches its layers only). The cache is not advanced (see `advance`)."""
    start, end = cache.length, cache.length + hidden_sbh.shape[0]
    rotary = rotary_table_of(model, cache, hidden_sbh.device)
    rotary = None if rotary is None else rotary[:, start:end]
    for i, layer in enumerate(model.language_model.encoder.layers):
        hidden_sbh = layer_step(layer, hidden_sbh, lambda attn, x, i=i:
                                _attention_step(attn, x, rotary, cache, i))
    return hidden_sbh


def advance(cache: KVCache, end: int) -> None:
    """The cache holds positions [0, end) now (host length and device position)."""
    cache.length = end
    if cache.position is not None:
        cache.position.fill_(end)


def head_step(model, hidden_sbh: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    """Vocabulary-parallel logits [b, s, V/tp] ([b, 1, V/tp] with `last_only`) of the last
    hidden states: final norm and output layer of a model that holds them
    (`post_process`)."""
    hidden_sbh = model.language_model.encoder.final_layernorm(hidden_sbh)
    if last_only:
        hidden_sbh = hidden_sbh[-1:]
    return model._head(hidden_sbh, None)


@torch.no_grad()
def forward_incremental(model, input_ids_bs: torch.Tensor, cache: KVCache,
                        last_only: bool = False) -> torch.Tensor:
    """Logits [b, s, V] (the whole padded vocabulary on every tensor-parallel rank; [b, 1,
    V] with `last_only`) of the tokens `input_ids_bs` at positions [cache.length,
    cache.length + s), given the keys and values of the earlier positions in `cache`,
    which this call extends. A model split over pipeline stages
    (pipeline_decode.PipelineGPT) runs its own: the same steps, stage after stage.

    ValueError when the model cannot decode this way (see `check_incremental`) or the
    tokens would run past the cache or the model's positions."""
    check_incremental(model)
    if hasattr(model, "forward_incremental"):  # PipelineGPT: one stage's share
        return model.forward_incremental(input_ids_bs, cache, last_only)
    _, end = check_room(model, cache, input_ids_bs.shape[1])
    hidden_sbh = layers_step(model, embed_step(model, input_ids_bs, cache.length), cache)
    advance(cache, end)
    return gather_vocab(model, head_step(model, hidden_sbh, last_only))


__all__ = ["KVCache", "advance", "check_incremental", "check_room", "embed_step",
           "forward_incremental", "gather_vocab", "head_step", "layers_step"]
