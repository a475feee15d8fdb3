"""The polynomial GeLU (`--gelu-kernel`, megatron/core/fused_activation.py).

- The operators (torch ops on the CPU) against the fp64 erf GeLU over [-12, 12]: forward
  and gradient within 2e-6 in fp32 (the erf polynomial's 1.5e-7, scaled by |x|, plus fp32
  rounding); in bf16 within one bf16 rounding step of torch's bf16 result.
- The Triton kernels (CPU interpreter) give the operators' values (fp32: 1e-6; bf16: one
  rounding step), also on a ragged tail; torch.library.opcheck passes.
- Under torch.compile the operators give eager's values and gradients.
- `auto` runs the kernels where Triton can, torch's GeLU elsewhere.
- Training 4 steps with `--gelu-kernel polynomial` gives the losses of `torch` (1e-5).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core import fused_activation as fa
from megatron.core.config import ModelConfig
from megatron.core.models.gpt.transformer import ParallelMLP
from tests.gpt_helpers import cli_trainer, train_steps


def _reference(x: torch.Tensor, grad: torch.Tensor):
    x64 = x.detach().double().requires_grad_(True)
    y = F.gelu(x64)
    (g,) = torch.autograd.grad(y, x64, grad.double())
    return y.detach(), g


def _ours(fn, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().requires_grad_(True)
    y = fn(x)
    (g,) = torch.autograd.grad(y, x, grad)
    return y.detach(), g


def test_matches_the_erf_gelu_in_fp32():
    x = torch.linspace(-12, 12, 20001)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    y_ref, g_ref = _reference(x, grad)
    y, g = _ours(fa.gelu, x, grad)
    assert y.dtype == torch.float32 and g.dtype == torch.float32
    assert (y.double() - y_ref).abs().max() < 2e-6
    assert (g.double() - g_ref).abs().max() < 2e-6


def test_matches_torch_in_bf16():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4096, generator=gen) * 3).bfloat16()
    grad = torch.randn(4096, generator=gen).bfloat16()
    y_torch, g_torch = _ours(F.gelu, x, grad)
    y, g = _ours(fa.gelu, x, grad)
    assert y.dtype == torch.bfloat16 and g.dtype == torch.bfloat16
    step = 2.0 ** -7  # one bf16 rounding step, relative
    assert ((y.float() - y_torch.float()).abs() <= step * y_torch.float().abs() + 1e-6).all()
    assert ((g.float() - g_torch.float()).abs() <= step * g_torch.float().abs() + 1e-6).all()


@pytest.fixture
def interpret(triton_interpreter, monkeypatch):
    """Run the Triton kernels on CPU tensors (tests/conftest.py's triton_interpreter)."""
    monkeypatch.setattr(fa, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(fa, "BLOCK", 256)  # several programs and a ragged tail


@pytest.mark.parametrize("dtype,step", [(torch.float32, 0.0), (torch.bfloat16, 2.0 ** -7)])
def test_kernels_match_the_operators(interpret, dtype, step):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(1000, generator=gen) * 4).to(dtype)
    grad = torch.randn(1000, generator=gen).to(dtype)
    y_kernel, g_kernel = fa.gelu_forward(x), fa.gelu_backward(grad, x)
    pdf, cdf = fa._pdf_cdf(x.float())  # the operators' torch-ops arithmetic
    y_ops = (x.float() * cdf).to(dtype)
    g_ops = (grad.float() * (cdf + x.float() * pdf)).to(dtype)
    for got, want in ((y_kernel, y_ops), (g_kernel, g_ops)):
        assert got.dtype == dtype
        tol = step * want.float().abs() + 1e-6
        assert ((got.float() - want.float()).abs() <= tol).all()


def test_operator_registration():
    x = torch.randn(8, 12, dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.megatron.gelu.default, (x,))
    # (no double backward: the backward operator has no gradient of its own)
    torch.library.opcheck(torch.ops.megatron.gelu_backward.default,
                          (torch.randn(8, 12), x.detach()))


def test_compiled_equals_eager():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 4
    grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    y, g = _ours(fa.gelu, x, grad)
    yc, gc = _ours(torch.compile(fa.gelu, dynamic=False), x, grad)
    assert torch.allclose(yc, y, rtol=0, atol=1e-6)
    assert torch.allclose(gc, g, rtol=0, atol=1e-6)


def _mlp_act(kernel: str):
    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, padded_vocab_size=16,
                      seq_length=4, max_position_embeddings=4, gelu_kernel=kernel)
    return ParallelMLP(cfg).act


def test_choice(monkeypatch):
    assert _mlp_act("torch") is F.gelu
    assert _mlp_act("polynomial") is fa.gelu
    auto = _mlp_act("auto")
    x = torch.randn(64, generator=torch.Generator().manual_seed(6)) * 3
    monkeypatch.setattr(fa, "INTERPRET_ON_CPU", False)
    assert torch.equal(auto(x), F.gelu(x))  # no Triton on this device: torch's GeLU
    calls = []
    monkeypatch.setattr(fa, "available", lambda device: True)
    monkeypatch.setattr(fa, "gelu", lambda h: calls.append(h) or h)
    auto(x)
    assert calls and calls[0] is x  # where the kernels can run, auto uses them


ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_training_with_the_polynomial_matches_torch():
    from megatron.training import data_iterator

    def losses(kernel):
        cfg, rt, tr = cli_trainer(ARGV + ["--gelu-kernel", kernel])
        return train_steps(tr, data_iterator(cfg, rt, "train", 0), 4)

    expected, got = losses("torch"), losses("polynomial")
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_on_cuda_matches_torch_in_bf16():
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(2048, 8192, device="cuda", generator=gen) * 3).bfloat16()
    grad = torch.randn(2048, 8192, device="cuda", generator=gen).bfloat16()
    y_torch, g_torch = _ours(F.gelu, x, grad)
    y, g = _ours(torch.compile(fa.gelu, dynamic=False), x, grad)
    step = 2.0 ** -7
    assert ((y.float() - y_torch.float()).abs() <= step * y_torch.float().abs() + 1e-6).all()
    assert ((g.float() - g_torch.float()).abs() <= step * g_torch.float().abs() + 1e-6).all()


# ---------------------------------------------------------------------------------- SwiGLU
def _swiglu_reference(h: torch.Tensor, grad: torch.Tensor):
    h64 = h.detach().double().requires_grad_(True)
    a, b = torch.chunk(h64, 2, dim=-1)
    y = F.silu(a) * b
    (g,) = torch.autograd.grad(y, h64, grad.double())
    return y.detach(), g


def test_swiglu_matches_silu_times_up():
    """The operator (torch ops on the CPU) against silu(a) * b in float64: fp32 values and
    gradients within fp32 rounding; fp64 inputs pass torch's gradcheck."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(6, 5, 2 * 40, generator=gen) * 4
    grad = torch.randn(6, 5, 40, generator=gen)
    y_ref, g_ref = _swiglu_reference(h, grad)
    y, g = _ours(fa.swiglu, h, grad)
    assert y.shape == (6, 5, 40) and g.shape == h.shape
    assert (y.double() - y_ref).abs().max() < 1e-5 * y_ref.abs().max()
    assert (g.double() - g_ref).abs().max() < 1e-5 * g_ref.abs().max()
    h64 = torch.randn(3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(fa.swiglu, (h64,))
    with pytest.raises(ValueError, match="even last dimension, got 7"):
        fa.swiglu(torch.randn(2, 7))


@pytest.mark.parametrize("dtype,step", [(torch.float32, 0.0), (torch.float16, 2.0 ** -10)])
def test_swiglu_kernels_match_the_operators(interpret, monkeypatch, dtype, step):
    """The Triton kernels (interpreter): the operators' values, also with a ragged tail of
    columns (BLOCK 256, 600 columns per half)."""
    monkeypatch.setattr(fa, "SWIGLU_BLOCK", 256)
    gen = torch.Generator().manual_seed(4)
    h = (torch.randn(3, 1200, generator=gen) * 4).to(dtype)
    grad = torch.randn(3, 600, generator=gen).to(dtype)
    got = (fa._swiglu_launch(h, None, h.new_empty(3, 600), backward=False),
           fa._swiglu_launch(h, grad, torch.empty_like(h), backward=True))
    want = (fa._swiglu_torch(h), fa._swiglu_torch(h, grad))
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert ((g.float() - w.float()).abs() <= step * w.float().abs() + 1e-6).all()


def test_swiglu_operator_registration_and_compile():
    h = torch.randn(4, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.megatron.swiglu.default, (h,))
    torch.library.opcheck(torch.ops.megatron.swiglu_backward.default,
                          (torch.randn(4, 8), h.detach()))
    grad = torch.randn(4, 8)
    y, g = _ours(fa.swiglu, h, grad)
    yc, gc = _ours(torch.compile(fa.swiglu, dynamic=False), h, grad)
    assert torch.allclose(yc, y, rtol=0, atol=1e-6) and torch.allclose(gc, g, rtol=0, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_cuda_kernels_match_the_operators():
    gen = torch.Generator().manual_seed(6)
    h = (torch.randn(64, 2 * 3000, generator=gen) * 4).bfloat16().cuda()
    grad = torch.randn(64, 3000, generator=gen).bfloat16().cuda()
    y, g = _ours(fa.swiglu, h, grad)
    want = (fa._swiglu_torch(h), fa._swiglu_torch(h, grad))
    for got, w in zip((y, g), want):
        assert ((got.float() - w.float()).abs() <= 2.0 ** -7 * w.float().abs() + 1e-6).all()
