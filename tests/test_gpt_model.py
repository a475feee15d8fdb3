"""Single-process GPT model behaviour: document masking and activation recompute."""
from __future__ import annotations

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.datasets.utils import get_ltor_masks_and_position_ids
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed


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
