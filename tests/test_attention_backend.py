"""--attention-backend: restricting scaled_dot_product_attention to one kernel changes
nothing but speed (CPU: flash vs math, fp32, same loss and grads within 1e-5), and the
choices a machine cannot run are refused before any work with a message naming the fix."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]


def _loss_and_grads(backend: str):
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cpu_initialization=True,
                      attention_backend=backend)
    model = GPTModel(cfg, device="cpu")
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_flash_and_math_kernels_agree_on_cpu():
    loss_m, grads_m = _loss_and_grads("math")
    loss_f, grads_f = _loss_and_grads("flash")
    assert torch.allclose(loss_m, loss_f, atol=1e-5, rtol=0)
    for name, g in grads_m.items():
        assert torch.allclose(g, grads_f[name], atol=1e-5, rtol=1e-4), name


def test_flag_reaches_the_model_config():
    cfg = parse_and_validate(BASE + ["--attention-backend", "math"], cuda_available=False)
    assert cfg.model.attention_backend == "math"
    assert parse_and_validate(BASE, cuda_available=False).model.attention_backend == "auto"


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_cuda_only_kernels_are_refused_without_cuda(backend):
    with pytest.raises(ArgumentsError, match=f"--attention-backend {backend} needs CUDA"):
        parse_and_validate(BASE + ["--attention-backend", backend], cuda_available=False)


def test_flash_refused_with_per_document_mask():
    with pytest.raises(ArgumentsError, match="--reset-attention-mask; use auto or efficient"):
        parse_and_validate(BASE + ["--attention-backend", "flash", "--reset-attention-mask"],
                           cuda_available=True)
