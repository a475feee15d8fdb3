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


def _gqa_attention(native: bool, device="cpu", dtype=torch.float32, backend="auto"):
    """A grouped-query attention (8 query heads in 2 groups) with rotary embeddings:
    its output and the grads of its input and weights, k and v handed to SDPA as groups
    (`native`) or repeated to every query head."""
    from megatron.core.models.gpt import transformer
    from megatron.core.models.gpt.rotary import rotary_table

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      padded_vocab_size=128, seq_length=16, max_position_embeddings=16,
                      attention_dropout=0.0, use_cpu_initialization=True, add_bias_linear=False,
                      position_embedding_type="rope", attention_backend=backend,
                      params_dtype=dtype)
    attn = transformer.ParallelAttention(cfg, device=device)
    attn._native_gqa = lambda q, mask: native  # the choice under test, forced
    x = torch.randn(16, 3, 64, device=device, dtype=dtype, requires_grad=True)
    table = rotary_table(16, cfg.kv_channels, device=device)
    out, _ = attn(x, table)
    out.float().square().sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in attn.parameters()]


def test_query_groups_handed_to_sdpa_as_groups_equal_repeated_heads():
    """`enable_gqa`: SDPA maps query head i to group i // (heads / groups) and sums a
    group's k/v grads itself -- the same as repeating k and v first (CPU, fp32: within
    1e-5 of the largest value, the sums running in another order)."""
    for a, b in zip(_gqa_attention(True), _gqa_attention(False)):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


def test_native_query_groups_only_where_a_kernel_takes_them():
    from megatron.core.models.gpt import transformer

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      padded_vocab_size=128, seq_length=16, max_position_embeddings=16,
                      use_cpu_initialization=True)
    attn = transformer.ParallelAttention(cfg, device="cpu")
    q = torch.zeros(1, 8, 16, 8)
    assert attn._native_gqa(q, None)
    assert not attn._native_gqa(q, torch.zeros(1, 1, 16, 16, dtype=torch.bool))  # masked
    attn.config = ModelConfig(**{**cfg.__dict__, "attention_backend": "efficient"})
    assert not attn._native_gqa(q, None)  # the memory-efficient kernel has no GQA mode


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_native_query_groups_on_cuda_match_repeated_heads():
    """On the GPU (bf16, cuDNN or flash attention) the group sums of the k/v grads run in
    another order: within bf16 rounding of the repeated-heads run."""
    got = _gqa_attention(True, "cuda", torch.bfloat16)
    ref = _gqa_attention(False, "cuda", torch.bfloat16)
    for a, b in zip(got, ref):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale
