"""Output layer + cross entropy in one node (`--cross-entropy-kernel`,
megatron/core/fused_cross_entropy.py), the Triton kernel run on the CPU through Triton's
interpreter (skipped where Triton is not installed).

- Kernel: per-row loss equals torch's cross entropy (fp32: 1e-5; bf16 logits: 1e-2, the
  reference upcasting the same bf16 values) and the row is overwritten with
  softmax - onehot (rounded to the logits' dtype).
- Autograd node against x @ W^T -> F.cross_entropy with a per-token weighting like the
  training loss's mask: loss, grad_x and grad_W within 1e-5 (fp32); with gradient-
  accumulation fusion the weight grad lands in `main_grad` (added to what was there).
- Training: 4 steps with the kernel give the losses of `--cross-entropy-kernel torch`
  (fp32, tied and untied output weights, within 1e-5).
- Insisting where it cannot run is refused with the fix named.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="Triton is not installed")

from megatron.core import fused_cross_entropy as fce  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.gpt_helpers import cli_trainer, train_steps  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(request, monkeypatch):
    """CPU tests: the interpreter (tests/conftest.py sets TRITON_INTERPRET where CUDA is
    absent; where it is visible Triton's library is built for the GPU, so they skip)."""
    if "cuda" in request.keywords:
        return
    monkeypatch.setattr(fce, "BLOCK", 64)  # several loop iterations and a ragged tail
    if torch.cuda.is_available():
        pytest.skip("CPU-interpreter test; the CUDA test covers this machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fce, "INTERPRET_ON_CPU", True)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernel_loss_and_in_place_gradient(dtype, atol):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 201, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, 201, (37,), generator=gen)
    reference = logits.float()
    expected_loss = F.cross_entropy(reference, labels, reduction="none")
    expected_grad = torch.softmax(reference, -1) - F.one_hot(labels, 201).float()
    work = logits.clone()
    loss = fce.loss_and_grad_rows_(work, labels)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, expected_loss, rtol=0, atol=atol)
    assert work.dtype == dtype
    assert torch.allclose(work.float(), expected_grad, rtol=0, atol=1e-6 if dtype == torch.float32
                          else 4e-3)


@pytest.mark.parametrize("fusion", [False, True])
def test_linear_cross_entropy_matches_separate_layers(fusion):
    gen = torch.Generator().manual_seed(1)
    s, b, h, vocab = 6, 3, 16, 130
    x = torch.randn(s, b, h, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, h, generator=gen) * 0.3)
    labels = torch.randint(0, vocab, (s, b), generator=gen)
    mask = (torch.rand(s, b, generator=gen) > 0.3).float()

    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(True)
    ref = F.cross_entropy((x_ref @ w_ref.t()).flatten(0, 1), labels.flatten(),
                          reduction="none").view(s, b)
    ((ref * mask).sum() / mask.sum()).backward()

    if fusion:
        weight.main_grad = torch.full_like(weight, 0.5)
    loss = fce.linear_cross_entropy(x, weight, labels, gradient_accumulation_fusion=fusion)
    ((loss * mask).sum() / mask.sum()).backward()
    assert torch.allclose(loss, ref, rtol=0, atol=1e-5)
    assert torch.allclose(x.grad, x_ref.grad, rtol=0, atol=1e-6)
    if fusion:
        assert weight.grad is None
        assert torch.allclose(weight.main_grad - 0.5, w_ref.grad, rtol=0, atol=1e-6)
    else:
        assert torch.allclose(weight.grad, w_ref.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fusion", [False, True])
def test_fp16_weight_grad_survives_a_loss_scale_beyond_fp16s_range(fusion):
    """The fused head's fp16 weight grad G^T (c x): tokens come in pairs with the same x
    and nearly opposite rows of G, so the gradient is small while c x (c = 2^12 per token,
    |x| up to ~400) would overflow fp16 (both checked). Finite, and within fp16 rounding
    (2e-3 of the norm) of float64; with fusion a stale main grad is written over, one no
    longer stale added to."""
    from megatron.core.distributed import stale_grads

    gen = torch.Generator().manual_seed(3)
    pairs, h, vocab = 24, 16, 40
    x_half = torch.randn(pairs, h, generator=gen, dtype=torch.float64) * 100
    g_half = torch.rand(pairs, vocab, generator=gen, dtype=torch.float64) * 2 - 1
    x64 = torch.cat([x_half, x_half]).half().double()
    g64 = torch.cat([g_half, -g_half * 0.997]).half().double()
    c64 = torch.full((2 * pairs, 1), 2.0 ** 12, dtype=torch.float64)
    ref = g64.t() @ (c64 * x64)
    assert (c64 * x64).abs().max() > 65504 and ref.abs().max() < 30000
    weight = torch.nn.Parameter(torch.zeros(vocab, h, dtype=torch.float16))
    if fusion:
        weight.main_grad = torch.full_like(weight, 3.0)
        stale_grads.mark([weight.main_grad])
    out = fce._fp16_weight_grad(g64.half(), x64.half(), c64.float(), weight, fusion)
    got = weight.main_grad if fusion else out
    assert (out is None) == fusion and got.dtype == torch.float16
    assert torch.isfinite(got).all()
    assert (got.double() - ref).norm() / ref.norm() < 2e-3
    if fusion:  # no longer stale: the next product is added
        fce._fp16_weight_grad(g64.half(), x64.half(), c64.float(), weight, fusion)
        assert (weight.main_grad.double() - 2 * ref).norm() / (2 * ref).norm() < 2e-3


def test_fp16_head_matches_separate_layers():
    """The fused head with fp16 x and weights against the same layers in float64: loss,
    input grad and weight grad within fp16 rounding."""
    gen = torch.Generator().manual_seed(4)
    s, b, h, vocab = 6, 3, 16, 130
    x64 = torch.randn(s, b, h, generator=gen, dtype=torch.float64).half().double()
    w64 = (torch.randn(vocab, h, generator=gen, dtype=torch.float64) * 0.3).half().double()
    labels = torch.randint(0, vocab, (s, b), generator=gen)
    x_ref, w_ref = x64.clone().requires_grad_(True), w64.clone().requires_grad_(True)
    ref = F.cross_entropy((x_ref @ w_ref.t()).flatten(0, 1), labels.flatten(),
                          reduction="none").view(s, b)
    (ref.mean() * 1024).backward()
    x = x64.half().requires_grad_(True)
    weight = torch.nn.Parameter(w64.half())
    loss = fce.linear_cross_entropy(x, weight, labels)
    (loss.mean() * 1024).backward()
    assert torch.allclose(loss.double(), ref, rtol=0, atol=1e-2)
    for got, want in ((x.grad, x_ref.grad), (weight.grad, w_ref.grad)):
        assert (got.double() - want).norm() / want.norm() < 2e-3


# Few rows (the interpreter runs one program per row, ~40 ms of CPU each): 8 tokens a
# micro-batch, two micro-batches a step (the weight grad accumulates over them).
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "8", "--lr", "3e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("extra,atol", [
    ([], 1e-5), (["--untie-embeddings-and-output-weights"], 1e-5),
    (["--fp16", "--initial-loss-scale", "4096"], 2e-3)])  # fp16: a weight's last bit
def test_training_with_the_fused_head_matches_torch(extra, atol):
    from megatron.training import data_iterator

    def losses(kernel):
        cfg, rt, tr = cli_trainer(ARGV + extra + ["--cross-entropy-kernel", kernel])
        return train_steps(tr, data_iterator(cfg, rt, "train", 0), 4)

    expected = losses("torch")
    got = losses("triton")
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=0, atol=atol)


def test_reasons_and_refusal(monkeypatch):
    cpu = torch.device("cpu")
    assert fce.use_fused("auto", cpu, False) is None  # the interpreter counts as able
    assert "torch" in fce.use_fused("torch", cpu, False)
    assert "--fp16-lm-cross-entropy" in fce.use_fused("auto", cpu, True)
    assert fce.use_fused("auto", cpu, False, torch.float16) is None
    assert fce.use_fused("auto", cpu, False, torch.float32) is None
    monkeypatch.setattr(fce, "INTERPRET_ON_CPU", False)
    assert "cannot run on this device" in fce.use_fused("auto", cpu, False)
    from megatron.arguments import ArgumentsError

    with pytest.raises(ArgumentsError, match="--cross-entropy-kernel triton cannot be used: "
                                             "Triton cannot run on this device; use "
                                             "--cross-entropy-kernel auto or torch"):
        cli_trainer(ARGV + ["--cross-entropy-kernel", "triton"])  # refused in validation


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_with_a_gpt2_sized_vocabulary():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(512, 50304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 50304, (512,), device="cuda", generator=gen)
    reference = logits.float()
    work = logits.clone()
    loss = fce.loss_and_grad_rows_(work, labels)
    expected = F.cross_entropy(reference, labels, reduction="none")
    assert torch.allclose(loss, expected, rtol=0, atol=1e-3)
    grad = torch.softmax(reference, -1) - F.one_hot(labels, 50304).float()
    assert torch.allclose(work.float(), grad, rtol=0, atol=4e-3)


def _vocab_parallel_worker(rank, world, dtype):
    gen = torch.Generator().manual_seed(7)
    vocab = 64 * world + 18 * world  # slices longer than one block: a ragged tail
    logits = (torch.randn(29, vocab, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, vocab, (29,), generator=gen)
    per_rank = vocab // world
    work = logits[:, rank * per_rank:(rank + 1) * per_rank].clone()
    loss = fce.vocab_parallel_loss_and_grad_rows_(work, labels, rank * per_rank, None
                                                  if world == 1 else torch.distributed.group.WORLD)
    reference = logits.float()
    expected_grad = torch.softmax(reference, -1) - F.one_hot(labels, vocab).float()
    return (loss, F.cross_entropy(reference, labels, reduction="none"), work.float(),
            expected_grad[:, rank * per_rank:(rank + 1) * per_rank])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_vocab_parallel_kernels_match_torch(dtype, atol):
    """Two ranks, each with half of the vocabulary: every rank gets the whole loss and
    its slice of softmax - onehot."""
    for loss, expected_loss, grad, expected_grad in run_distributed(
            _vocab_parallel_worker, 2, dtype):
        assert torch.allclose(loss, expected_loss, rtol=0, atol=atol)
        assert torch.allclose(grad, expected_grad, rtol=0,
                              atol=1e-6 if dtype == torch.float32 else 4e-3)


def _tp_training_worker(rank, world, extra):
    from megatron.training import data_iterator

    def losses(kernel):
        cfg, rt, tr = cli_trainer(ARGV + extra + ["--tensor-model-parallel-size", str(world),
                                                  "--cross-entropy-kernel", kernel],
                                  world_size=world, rank=rank)
        return train_steps(tr, data_iterator(cfg, rt, "train", 0), 3)

    return losses("torch"), losses("triton")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"],
                                   ["--untie-embeddings-and-output-weights"]])
def test_tensor_parallel_training_with_the_fused_head_matches_torch(extra):
    """tp 2 (gloo): 3 steps with the vocab-parallel fused head give the losses of the
    separate column-parallel layer and vocab-parallel cross entropy (1e-5)."""
    for expected, got in run_distributed(_tp_training_worker, 2, extra):
        assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)


def test_output_layer_products_are_recorded_for_the_gemm_tuner():
    """The fused head's three products go through gemm_algos, so tools/tune_gemms.py
    records (and --gemm-algorithms can route) the output layer's shapes."""
    from megatron.core.tensor_parallel import gemm_algos
    from megatron.core.tensor_parallel.gemm_algos import Shape

    s, b, h, vocab = 4, 2, 16, 96
    x = torch.randn(s, b, h, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, h) * 0.3)
    weight.main_grad = torch.zeros(vocab, h)
    labels = torch.randint(0, vocab, (s, b))
    with gemm_algos.recording() as counts:
        fce.linear_cross_entropy(x, weight, labels, gradient_accumulation_fusion=True).sum().backward()
    assert counts == {Shape("forward", s * b, vocab, h, "fp32"): 1,
                      Shape("dgrad", s * b, h, vocab, "fp32"): 1,
                      Shape("wgrad", vocab, h, s * b, "fp32"): 1}
