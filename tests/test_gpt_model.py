"""Single-process GPT model behaviour: document masking, activation recompute, each
model-shaping setting against a plain-torch reference of Megatron-LM 23.05, and the
initialisation statistics."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ModelConfig
from megatron.core.datasets.utils import get_ltor_masks_and_position_ids
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed
from tests.gpt_reference import (
    BASE,
    CASES,
    case_batch,
    case_config,
    perturb_,
    reference_forward,
)


def _model(seed=0, **kw) -> GPTModel:
    torch.manual_seed(seed)
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
                seq_length=16, max_position_embeddings=16, hidden_dropout=0.0,
                attention_dropout=0.0, use_cpu_initialization=True)
    base.update(kw)
    return GPTModel(ModelConfig(**base))


def test_explicit_causal_mask_equals_builtin_causal():
    model = _model()
    tokens = torch.randint(0, 64, (2, 16))
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None].expand(2, 1, 16, 16)
    a = model(tokens, labels=tokens)
    b = model(tokens, labels=tokens, attention_mask=mask)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_reset_masks_make_documents_independent():
    """With --reset-attention-mask and --reset-position-ids, a document that starts after
    an EOD is scored exactly as if it were alone at position 0 (fp32, atol 1e-5)."""
    model = _model()
    eod = 63
    doc_a = torch.randint(0, 60, (5,))
    doc_b = torch.randint(0, 60, (11,))
    packed = torch.cat([doc_a, torch.tensor([eod]), doc_b[:-1]])[None]  # [1, 16]
    mask, _, pos = get_ltor_masks_and_position_ids(packed, eod, True, True, False)
    logits_packed = model(packed, position_ids=pos, attention_mask=mask)
    alone = doc_b[:-1][None]
    logits_alone = model(alone)
    torch.testing.assert_close(logits_packed[0, 6:], logits_alone[0], rtol=1e-5, atol=1e-5)


def test_reset_attention_mask_keeps_one_s_by_s_copy_for_all_layers():
    """--reset-attention-mask: the backward keeps the [b, 1, s, s] mask (as SDPA's additive
    bias) once, not once per layer (at s = 32768 each copy is 4 GiB in fp32)."""
    s = 64
    model = _model(num_layers=4, seq_length=s, max_position_embeddings=s)
    tokens = torch.randint(0, 63, (1, s))
    tokens[0, 20] = 63
    mask, _, pos = get_ltor_masks_and_position_ids(tokens, 63, True, True, False)
    storages = set()

    def pack(t):
        if t.dim() == 4 and t.shape[-2:] == (s, s):
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids=pos, labels=tokens, attention_mask=mask)
    loss.sum().backward()
    assert len(storages) == 1, f"{len(storages)} s x s mask copies saved for 4 layers"


@pytest.mark.parametrize("granularity,method", [("full", "uniform"), ("full", "block"),
                                                ("selective", None)])
def test_recompute_gives_identical_grads_with_dropout(granularity, method):
    """Activation recompute replays the dropout masks: loss and every grad equal the run
    without recompute (bit-identical on CPU fp32)."""
    def run(**kw):
        tracker = RNGStatesTracker()
        model_parallel_seed(1234, 0, tracker)
        model = _model(hidden_dropout=0.2, attention_dropout=0.2, **kw)
        model.language_model.encoder.rng_tracker = tracker
        for layer in model.language_model.encoder.layers:
            layer.rng_tracker = tracker
            layer.self_attention.rng_tracker = tracker
        torch.manual_seed(7)
        tokens = torch.randint(0, 64, (2, 16))
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = run()
    loss, grads = run(recompute_granularity=granularity, recompute_method=method,
                      recompute_num_layers=1)
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


class _WordPlusPositions(torch.nn.Module):
    """A word embedding that adds learned positions 0..s-1: the input a rotary-only model
    gets in place of Megatron-LM 23.05's rotary + learned-position embedding."""

    def __init__(self, word, positions_weight):
        super().__init__()
        self.word, self.positions_weight = word, positions_weight

    @property
    def weight(self):  # the tied output layer's
        return self.word.weight

    def forward(self, ids):
        return self.word(ids) + self.positions_weight[: ids.shape[1]]


def test_rope_plus_learned_is_rotary_layers_fed_word_plus_positions():
    """position_embedding_type rope+learned (--use-rotary-position-embeddings without
    --no-position-embedding): the learned table is added to the word embedding and every
    layer rotates q and k -- the rotary-only model with the same weights, fed word +
    position embeddings, gives the same logits (fp32, 1e-6); the table gets gradients."""
    both = _model(position_embedding_type="rope+learned", rotary_percent=0.5)
    ref = _model(seed=1, position_embedding_type="rope", rotary_percent=0.5)
    table = both.language_model.embedding.position_embeddings.weight
    assert ref.load_state_dict(both.state_dict(), strict=False).unexpected_keys == \
        ["language_model.embedding.position_embeddings.weight"]
    emb = ref.language_model.embedding
    emb.word_embeddings = _WordPlusPositions(emb.word_embeddings, table.detach())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    out = both(tokens)
    torch.testing.assert_close(out, ref(tokens), rtol=0, atol=1e-6)
    emb.word_embeddings = emb.word_embeddings.word
    assert (out - ref(tokens)).abs().max() > 1e-3  # the positions do take part
    both(tokens, labels=tokens).mean().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


# ------------------------------------------------- Megatron-LM 23.05 semantics, flag by flag
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_megatron_reference(case):
    """Per-token losses of each model-shaping setting equal the plain-torch reference of
    Megatron-LM 23.05's GPT (tests/gpt_reference.py) with the same weights, all of them
    perturbed (fp32 on CPU against the reference in fp64: atol 2e-5)."""
    fields, reset = case_config(case)
    cfg = ModelConfig(**fields)
    torch.manual_seed(0)
    model = GPTModel(cfg)
    perturb_(model)
    tokens, labels, pos, mask = case_batch(reset)
    got = model(tokens, position_ids=pos, labels=labels, attention_mask=mask)
    ref = reference_forward(model.state_dict(), cfg, tokens, labels, pos, mask)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)


def expected_init(name: str, shape, cfg) -> tuple:
    """Megatron-LM 23.05's initial distribution of a parameter, as ("const", value) or
    ("normal", std) or ("uniform", bound) (Xavier uniform: bound from the full weight's
    fans, whatever the tensor-parallel size)."""
    if name.endswith(("layernorm.bias", ".bias")):
        return "const", 0.0
    if name.endswith("layernorm.weight"):
        return "const", 0.0 if cfg.apply_layernorm_1p else 1.0
    if cfg.init_method_xavier_uniform:
        return "uniform", math.sqrt(6.0 / (shape[0] + shape[1]))
    if name.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
        return "normal", cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    return "normal", cfg.init_method_std


def check_init(name: str, w: torch.Tensor, cfg) -> None:
    """w (the full weight) drawn from `expected_init`: std within 4%, mean within 4
    standard errors, a uniform's extremes inside and near its bound."""
    kind, value = expected_init(name, w.shape, cfg)
    if kind == "const":
        assert torch.equal(w, torch.full_like(w, value)), name
        return
    std = value if kind == "normal" else value / math.sqrt(3.0)
    assert abs(w.std().item() / std - 1) < 0.04, (name, w.std().item(), std)
    assert abs(w.mean().item()) < 4 * std / math.sqrt(w.numel()), name
    if kind == "uniform":
        assert 0.98 * value < w.abs().max().item() <= value, (name, value)


INIT_CASES = [dict(), dict(init_method_std=0.006, apply_layernorm_1p=True,
                           untie_embeddings_and_output_weights=True),
              dict(init_method_xavier_uniform=True, untie_embeddings_and_output_weights=True),
              dict(activation="swiglu", ffn_hidden_size=320, kv_channels=24)]
INIT_SHAPE = dict(num_layers=6, hidden_size=128, num_attention_heads=4, padded_vocab_size=512,
                  seq_length=16, max_position_embeddings=256)


@pytest.mark.parametrize("cpu_init", [True, False])
@pytest.mark.parametrize("kw", INIT_CASES)
def test_initial_weights_follow_megatron(kw, cpu_init):
    """Every parameter group starts as Megatron-LM 23.05 draws it (fixed seed): weights
    N(0, --init-method-std^2), the attention and MLP output projections
    N(0, (std / sqrt(2 * num_layers))^2), biases 0, norm weights 1 (0 stored with
    --apply-layernorm-1p); with --init-method-xavier-uniform U(-a, a) of each weight's
    fans. Both initialisation paths (--use-cpu-initialization, and the shard drawn in
    place)."""
    cfg = ModelConfig(**INIT_SHAPE, **kw, use_cpu_initialization=cpu_init)
    tracker = RNGStatesTracker()
    model_parallel_seed(1234, 0, tracker)
    torch.manual_seed(1234)
    model = GPTModel(cfg, rng_tracker=tracker)
    for name, p in model.named_parameters():
        check_init(name, p.detach(), cfg)


@pytest.mark.parametrize("post_ln", [False, True])
def test_dropout_placement_matches_megatron(monkeypatch, post_ln):
    """Training mode, dropout made a fixed scaling (x 0.37) to see where it acts: hidden
    dropout on the embeddings' sum and on each attention and MLP output before its residual
    add (5 calls for 2 layers), as in Megatron-LM 23.05; the attention dropout is the
    attention kernel's own, on the softmax probabilities, with --attention-dropout."""
    calls, probs_dropout = [], []
    sdpa = F.scaled_dot_product_attention

    def fixed_dropout(x, p=0.5, training=True, inplace=False):
        calls.append((p, training))
        return x * 0.37 if training else x

    def recording_sdpa(*args, dropout_p=0.0, **kw):
        probs_dropout.append(dropout_p)
        return sdpa(*args, **kw)  # the probabilities kept: the scaling is checked above

    monkeypatch.setattr(F, "dropout", fixed_dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    cfg = ModelConfig(**{**BASE, "hidden_dropout": 0.2, "attention_dropout": 0.3,
                         "apply_residual_connection_post_layernorm": post_ln})
    torch.manual_seed(0)
    model = GPTModel(cfg)
    perturb_(model)
    tokens, labels, _, _ = case_batch(False)
    got = model(tokens, labels=labels)
    assert calls == [(0.2, True)] * 5 and probs_dropout == [0.3, 0.3]
    ref = reference_forward(model.state_dict(), cfg, tokens, labels,
                            hidden_dropout=lambda t: t * 0.37)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    calls.clear()
    probs_dropout.clear()
    model.eval()
    torch.testing.assert_close(model(tokens, labels=labels).double(),
                               reference_forward(model.state_dict(), cfg, tokens, labels),
                               rtol=0, atol=2e-5)
    assert probs_dropout == [0.0, 0.0] and all(not training for _, training in calls)


@pytest.mark.parametrize("groups", [3, 8, 0])
def test_query_groups_that_do_not_divide_the_heads_are_refused_at_once(groups):
    """ModelConfig names both values and the choices; the model would otherwise fail in
    its first forward, in a view of the QKV product ("shape [8, 2, 3, 24] is invalid")."""
    with pytest.raises(ValueError, match=rf"num_query_groups={groups} must divide "
                                         r"num_attention_heads=4 .*\[1, 2, 4\]"):
        ModelConfig(**{**BASE, "num_attention_heads": 4, "num_query_groups": groups})
    assert ModelConfig(**{**BASE, "num_attention_heads": 4, "num_query_groups": 2})
