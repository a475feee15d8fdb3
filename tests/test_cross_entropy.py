"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy.

Each rank gets its vocabulary slice of one full set of logits; the per-token loss and the
logits grad (of sum(loss * w) for random per-token weights w) must equal the
single-process torch result. Tolerance: fp32 atol=rtol=1e-5; bf16 logits are compared
with the fp32 reference evaluated on the same (bf16-rounded) logits, grads at bf16
resolution (atol=rtol=1e-2).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.dist_utils import run_distributed

S, B, VOCAB_PER_RANK = 5, 3, 7


def _data(vocab, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(S, B, vocab, generator=g) * scale).to(dtype)
    target = torch.randint(0, vocab, (S, B), generator=g)
    weights = torch.rand(S, B, generator=g)
    return logits, target, weights


def _reference(logits, target, weights, label_smoothing):
    full = logits.float().clone().requires_grad_(True)
    loss = F.cross_entropy(full.view(-1, full.size(-1)), target.view(-1), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)
    (loss * weights).sum().backward()
    return loss.detach(), full.grad


def _parallel(logits, target, weights, label_smoothing, group, rank, world):
    local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, group, label_smoothing)
    (loss * weights).sum().backward()
    assert torch.equal(local.detach(), before), "logits modified in place"
    return loss.detach(), local.grad


CASES = [  # (dtype, label_smoothing, logit scale)
    (torch.float32, 0.0, 1.0),
    (torch.float32, 0.1, 1.0),
    (torch.float32, 0.0, 300.0),  # large logits: the max shift keeps exp finite
    (torch.bfloat16, 0.0, 1.0),
]


def _tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


def _worker(rank, world):
    group = dist.group.WORLD if world > 1 else None
    vocab = VOCAB_PER_RANK * world
    for i, (dtype, smoothing, scale) in enumerate(CASES):
        logits, target, weights = _data(vocab, dtype, scale, seed=i)
        loss_ref, grad_ref = _reference(logits, target, weights, smoothing)
        loss, grad = _parallel(logits, target, weights, smoothing, group, rank, world)
        what = f"world={world} dtype={dtype} smoothing={smoothing} scale={scale}"
        assert loss.dtype == torch.float32 and grad.dtype == dtype, what
        torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{what} loss: {m}")
        torch.testing.assert_close(grad.float(), grad_ref.chunk(world, dim=-1)[rank],
                                   **_tolerance(dtype), msg=lambda m: f"{what} grad: {m}")
    return rank


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(world):
    assert run_distributed(_worker, world) == list(range(world))


def test_single_process_matches_torch():
    _worker(0, 1)


def test_invalid_arguments():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="does not match target shape"):
        vocab_parallel_cross_entropy(logits, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long),
                                     label_smoothing=1.0)


def test_plain_cross_entropy_matches_vocab_parallel_single_process():
    """The compiled head's loss function (uncompiled here) equals the vocab-parallel one."""
    from megatron.core.models.gpt.gpt_model import plain_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(5, 3, 37, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 37, (5, 3))
    a = plain_cross_entropy(logits, labels)
    a.sum().backward()
    ga = logits.grad.clone()
    logits.grad = None
    b = vocab_parallel_cross_entropy(logits.float(), labels)
    b.sum().backward()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga.float(), logits.grad.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("smoothing", [0.1, 0])
def test_megatron_positional_label_smoothing_is_named(smoothing):
    # Megatron-LM's vocab_parallel_cross_entropy(logits, target, label_smoothing): here the
    # third argument is the group, and a number there crashed inside torch.distributed.
    logits, target = torch.randn(2, 5), torch.tensor([1, 2])
    with pytest.raises(TypeError, match=rf"pass label_smoothing={smoothing!r} by name"):
        vocab_parallel_cross_entropy(logits, target, smoothing)
    ref = F.cross_entropy(logits, target, reduction="none", label_smoothing=smoothing)
    got = vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
    torch.testing.assert_close(got, ref)
