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
    with pytest.raises(ArgumentsError, match="--reset-attention-mask; use auto or math$"):
        parse_and_validate(BASE + ["--attention-backend", "flash", "--reset-attention-mask",
                                   "--attention-dropout", "0"], cuda_available=False)


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


def test_native_query_groups_follow_a_model_built_on_meta_and_moved(monkeypatch):
    """tools/generate.py builds on "meta", assigns the checkpoint's weights and moves the
    model to the GPU: its attention then takes SDPA's grouped k/v (`_sm80`) as one built
    on that GPU does. The CPU plays the sm80 GPU here (`_sm80_gpu` faked), read from the
    weights' device each time they move."""
    from megatron.core.models.gpt import transformer

    monkeypatch.setattr(transformer, "_sm80_gpu", lambda dev: torch.device(dev).type == "cpu")
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      padded_vocab_size=128, seq_length=16, max_position_embeddings=16,
                      use_cpu_initialization=True)

    def flags(model):
        return [m._sm80 for m in model.modules() if isinstance(m, transformer.ParallelAttention)]

    direct = GPTModel(cfg, device="cpu")
    moved = GPTModel(cfg, device="meta")
    assert flags(direct) == [True, True] and flags(moved) == [False, False]
    moved.load_state_dict(direct.state_dict(), strict=True, assign=True)
    moved.to(device="cpu")  # what tools/generate.py does next
    assert flags(moved) == flags(direct)
    moved.to_empty(device="meta")
    assert flags(moved) == [False, False]


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


def test_attention_grad_comes_back_in_the_outputs_layout():
    """GradLikeOutput: a grad output of other strides reaches the attention backward in the
    output's strides, its values unchanged; one already in them passes as it is."""
    from megatron.core.models.gpt.transformer import GradLikeOutput

    base = torch.randn(16, 2, 4, 8)  # [s, b, n, d], viewed as [b, n, s, d] like SDPA's output
    out = base.permute(1, 2, 0, 3).requires_grad_(True)
    seen = {}
    y = GradLikeOutput.apply(out)
    y.register_hook(lambda g: seen.setdefault("in", g))
    out.register_hook(lambda g: seen.setdefault("out", g))
    grad = torch.randn(2, 4, 16, 8)  # contiguous [b, n, s, d]: other strides
    y.backward(grad)
    assert seen["in"].stride() != out.stride() and seen["out"].stride() == out.stride()
    assert torch.equal(seen["out"], grad)
    same = torch.randn(16, 2, 4, 8).permute(1, 2, 0, 3)
    assert GradLikeOutput.backward(type("Ctx", (), {"layout": (out.shape, out.stride())}),
                                   same) is same


def _attention_identity_gap(compiled: bool) -> float:
    """Attention without biases is linear in the value rows W_v of the QKV weight:
    <out, G> = <W_v, dW_v> when the backward's probabilities (dropout mask included) are
    the forward's. The gap relative to sum |out * G| (bf16: ~5e-5 when right)."""
    from megatron.core.models.gpt.transformer import ParallelAttention, compile_layers
    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed

    torch._dynamo.reset()
    cfg = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=4,
                      padded_vocab_size=128, seq_length=128, max_position_embeddings=128,
                      hidden_dropout=0.0, attention_dropout=0.5, add_bias_linear=False,
                      params_dtype=torch.bfloat16)
    tracker = model_parallel_seed(1234, 0, RNGStatesTracker("cuda"))
    attn = ParallelAttention(cfg, rng_tracker=tracker, device="cuda").to(torch.bfloat16)
    run = compile_layers(attn) if compiled else attn
    gen = torch.Generator(device="cuda").manual_seed(3)
    x, g = (torch.randn(128, 2, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    gaps = []
    for _ in range(2):
        attn.zero_grad(set_to_none=True)
        out, _ = run(x)
        (out * g).sum().backward()
        w = attn.query_key_value.weight  # per head: q (64 rows), k (64), v (64)
        value_rows = torch.arange(w.shape[0], device="cuda") % 192 >= 128
        lhs = (w.float() * w.grad.float())[value_rows].sum().item()
        terms = out.detach().float() * g.float()
        gaps.append(abs(lhs - terms.sum().item()) / terms.abs().sum().item())
    return max(gaps)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eager_and_compiled_attention_in_one_process_backpropagate_right():
    """A compiled attention layer, then the same shapes eagerly, then compiled again, in
    one process (bf16, dropout 0.5, the kernel torch picks: cuDNN on sm90): each backward
    matches its forward. Without GradLikeOutput the eager call after the compiled one got
    wrong value grads from torch 2.11's cuDNN backward (gap 2.6e-2)."""
    gaps = [_attention_identity_gap(compiled) for compiled in (True, False, True)]
    assert max(gaps) < 1e-3, gaps
