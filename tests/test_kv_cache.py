"""Incremental decoding with a key/value cache (megatron/core/models/gpt/kv_cache.py) and
tools/generate.py's use of it: for tiny random models of each variant the framework builds,
the logits of a prefill plus one-token steps equal the full forward's at every position
(fp32: within 1e-5 of the largest logit), and generation with the cache gives the tokens
of the full-recompute path -- greedy and seeded sampling, also past
--max-position-embeddings, where both recompute the sliding window."""
from __future__ import annotations

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.kv_cache import KVCache, forward_incremental
from tools import generate

VOCAB = 128
MAX_POS = 24
VARIANTS = {
    # learned positions, LayerNorm, GeLU, biases, tied output
    "gpt2": {},
    # rotary on half the head channels, RMSNorm, SwiGLU, GQA, no biases, untied output
    "llama": dict(position_embedding_type="rope", rotary_percent=0.5, normalization="RMSNorm",
                  activation="swiglu", num_query_groups=2, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, rotary_base=500.0),
    # one query group (multi-query attention), a head dim other than hidden / heads,
    # full-width rotary, squared ReLU, the fp32 residual stream (in 16-bit runs)
    "mqa": dict(position_embedding_type="rope", num_query_groups=1, kv_channels=16,
                activation="squared_relu", fp32_residual_connection=True),
    # Megatron-LM 23.05's --use-rotary-position-embeddings alone: learned absolute
    # positions added to the word embedding and rotary ones in every layer
    "rope+learned": dict(position_embedding_type="rope+learned", rotary_percent=0.5),
    # tied, tanh GeLU (the MLP's epilogue path), post-LN residuals, LayerNorm-1p, no
    # position embedding at all
    "tied-postln": dict(position_embedding_type="none", activation="openai_gelu",
                        apply_residual_connection_post_layernorm=True,
                        apply_layernorm_1p=True),
}


def _model(variant: str, dtype=torch.float32, seq_length: int = MAX_POS,
           **overrides) -> GPTModel:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                      padded_vocab_size=VOCAB, seq_length=seq_length,
                      max_position_embeddings=MAX_POS, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cpu_initialization=True,
                      init_method_std=0.3, params_dtype=dtype,
                      **{**VARIANTS[variant], **overrides})
    model = GPTModel(cfg, device="cpu").eval()
    with torch.no_grad():  # norms away from their init, so their weights take part
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_and_steps_equal_the_full_forward(variant):
    model = _model(variant)
    if variant == "rope+learned":  # both kinds of position really take part
        assert model.language_model.embedding.position_embeddings is not None
        assert model.rotary_dim == 4
    ids = _tokens(MAX_POS)
    with torch.no_grad():
        full = model(ids)[0]
    for prefill in (1, 7):
        cache = KVCache(model.config.num_layers, MAX_POS)
        parts = [forward_incremental(model, ids[:, :prefill], cache)[0]]
        parts += [forward_incremental(model, ids[:, i:i + 1], cache)[0]
                  for i in range(prefill, MAX_POS)]
        cached = torch.cat(parts)
        assert cache.length == MAX_POS and cached.shape == full.shape
        err = (cached - full).abs().max() / full.abs().max()
        assert err < 1e-5, (variant, prefill, float(err))
    # several new tokens after a prefix (bottom-right causal mask), and last_only
    cache = KVCache(model.config.num_layers, MAX_POS)
    forward_incremental(model, ids[:, :5], cache)
    chunk = forward_incremental(model, ids[:, 5:12], cache)[0]
    torch.testing.assert_close(chunk, full[5:12], rtol=0, atol=1e-5 * full.abs().max())
    last = forward_incremental(model, ids[:, 12:15], cache, last_only=True)[0]
    torch.testing.assert_close(last, full[14:15], rtol=0, atol=1e-5 * full.abs().max())


def test_the_models_rotary_table_is_left_alone():
    """Decoding past --seq-length (up to --max-position-embeddings) builds the cache's own
    longer table: the model's, which training passes to its compiled layers (a longer
    table would change the strides they were compiled for), stays as it was."""
    model = _model("llama", seq_length=8)
    with torch.no_grad():
        model(_tokens(8))
    table = model._rotary_cache
    generate.generate(model, _tokens(4)[0].tolist(), 16, greedy=True)
    assert model._rotary_cache is table and table.shape[1] == 8


def test_rotary_kernel_reads_the_new_positions_rows(triton_interpreter, monkeypatch):
    """The Triton rotation (CUDA's path, here through Triton's interpreter) given the
    table's rows from the cache's position on rotates as the full forward does."""
    from megatron.core import fused_rotary

    monkeypatch.setattr(fused_rotary, "INTERPRET_ON_CPU", True)
    model = _model("llama")
    ids = _tokens(12)
    with torch.no_grad():
        full = model(ids)[0]
    cache = KVCache(model.config.num_layers, MAX_POS)
    parts = [forward_incremental(model, ids[:, :5], cache)[0]]
    parts += [forward_incremental(model, ids[:, i:i + 1], cache)[0] for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=1e-5 * full.abs().max())


def test_the_cached_path_stays_eager():
    """A model built to compile its layers (--compile-layers) decodes through the cache
    without compiling anything: the training graphs are neither built nor changed here."""
    import dataclasses

    model = _model("llama")
    model.config = dataclasses.replace(model.config, compile_layers=True)
    model.language_model.encoder.config = model.config
    counters = torch._dynamo.utils.counters
    counters.clear()
    generate.generate(model, [1, 2, 3], 4, greedy=True)
    assert model.language_model.encoder._compiled is None
    assert model.language_model.encoder._compiled_unit is None
    assert not counters["frames"] and not counters["stats"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generation_with_and_without_cache_gives_the_same_tokens(variant):
    model = _model(variant)
    prompt = _tokens(6, seed=2)[0].tolist()
    for new in (3, 30):  # 30: past the 24 positions, the window slides
        runs = {use: generate.generate(model, prompt, new, greedy=True, vocab_limit=100,
                                       use_cache=use) for use in (True, False)}
        assert len(runs[True]) == new and runs[True] == runs[False], (variant, new)
    sampled = {use: generate.generate(model, prompt, 30, temperature=1.0, top_k=20,
                                      generator=torch.Generator().manual_seed(7),
                                      use_cache=use) for use in (True, False)}
    assert sampled[True] == sampled[False]


def test_generation_uses_the_cache(monkeypatch):
    """With the cache each new token is one model call of one token (the prompt one call
    of all its tokens) until the positions run out; then the full forward takes over."""
    model = _model("llama")
    seen = []
    real = generate.forward_incremental
    monkeypatch.setattr(generate, "forward_incremental",
                        lambda m, ids, cache, **kw: seen.append(ids.shape[1]) or
                        real(m, ids, cache, **kw))
    generate.generate(model, list(range(20)), 8, greedy=True)
    assert seen == [20, 1, 1, 1, 1]  # 24 positions; tokens 25 .. 27 recompute the window
    seen.clear()
    generate.generate(model, [1, 2], 4, greedy=True, use_cache=False)
    assert seen == []


@pytest.mark.parametrize("variant", ["llama", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_generation_matches(dtype, variant):
    """bf16 / fp16: greedy tokens equal the full-recompute path's on a short sequence;
    the logits agree within 2e-2 of the largest (one rounding of the half-precision
    activations)."""
    model = _model(variant, dtype)
    ids = _tokens(16, seed=3)
    with torch.no_grad():
        full = model(ids)[0].float()
    cache = KVCache(model.config.num_layers, MAX_POS)
    parts = [forward_incremental(model, ids[:, :8], cache)[0]]
    parts += [forward_incremental(model, ids[:, i:i + 1], cache)[0] for i in range(8, 16)]
    cached = torch.cat(parts).float()
    assert cached.dtype == torch.float32 and cache.keys[0].dtype == dtype
    assert (cached - full).abs().max() / full.abs().max() < 2e-2
    prompt = ids[0, :6].tolist()
    assert generate.generate(model, prompt, 10, greedy=True) == \
        generate.generate(model, prompt, 10, greedy=True, use_cache=False)


def test_refusals():
    model = _model("gpt2")
    cache = KVCache(model.config.num_layers, 8)
    with pytest.raises(ValueError, match="5 new token.* after 0 cached positions make 5"):
        forward_incremental(model, _tokens(5), KVCache(2, 4))
    forward_incremental(model, _tokens(8), cache)
    with pytest.raises(ValueError, match="1 new token.* after 8 cached positions make 9"):
        forward_incremental(model, _tokens(1), cache)
    with pytest.raises(ValueError, match="call model.eval"):
        forward_incremental(model.train(), _tokens(1), KVCache(2, 4))
    with pytest.raises(ValueError, match="max_len >= 1"):
        KVCache(2, 0)
