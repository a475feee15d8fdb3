"""Megatron-LM 23.05 code ported unchanged: `initialize_model_parallel(2)`, then
`ColumnParallelLinear` / `RowParallelLinear` / `VocabParallelEmbedding` /
`vocab_parallel_cross_entropy` / `linear_with_grad_accumulation_and_async_allreduce`
called without a group. They must shard over the tensor-parallel group that
`initialize_model_parallel` remembered (Megatron finds it through parallel_state), not
silently run unsharded or read a vocabulary shard as the whole vocabulary.

On 2 gloo ranks (tensor-parallel 2) each result is compared with the same computation on
one process, fp32, within atol=rtol=1e-5.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from tests.dist_utils import run_distributed

TP = 2
H, FFN, VOCAB = 8, 16, 12
TOL = dict(atol=1e-5, rtol=1e-5)
INIT = tp.init_method_normal(0.5)


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, H, generator=g)  # [s, b, h]
    ids = torch.randint(0, VOCAB, (2, 4), generator=g)  # [b, s]
    logits = torch.randn(4, 2, VOCAB, generator=g) * 3
    target = torch.randint(0, VOCAB, (4, 2), generator=g)
    return x, ids, logits, target


def _ported_mlp(x):
    """Megatron's ParallelMLP pattern, no group passed: (y, x grad, fc1 weight shape)."""
    torch.manual_seed(0)
    fc1 = tp.ColumnParallelLinear(H, FFN, gather_output=False, init_method=INIT,
                                  use_cpu_initialization=True)
    fc2 = tp.RowParallelLinear(FFN, H, input_is_parallel=True, init_method=INIT,
                               use_cpu_initialization=True)
    x = x.clone().requires_grad_()
    h, _ = fc1(x)
    y, _ = fc2(F.gelu(h))
    (y * torch.arange(y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, tuple(fc1.weight.shape)


def _ported_embedding(ids):
    torch.manual_seed(3)
    emb = tp.VocabParallelEmbedding(VOCAB, H, init_method=INIT, use_cpu_initialization=True)
    return emb(ids).detach(), tuple(emb.weight.shape)


def _ported_linear(x, w):
    """The functional linear with Megatron's six arguments: the input grad is summed over
    the group (async_grad_allreduce) when the weight is a column shard."""
    x = x.clone().requires_grad_()
    y = tp.linear_with_grad_accumulation_and_async_allreduce(x, w, None, False, True, False)
    y.sum().backward()
    return y.detach(), x.grad


def fc1_weight_like():
    w = torch.nn.Parameter(torch.zeros(2))
    tp.set_tensor_model_parallel_attributes(w, True, 0, 1)
    return w


def _worker(rank, world_size):
    x, ids, logits, target = _inputs()
    out = {}
    try:  # before initialize_model_parallel the group is unknown in a 2-process run
        tp.ColumnParallelLinear(H, FFN, init_method=INIT, use_cpu_initialization=True)
    except ValueError as e:
        out["early"] = str(e)
    ps.initialize_model_parallel(TP)
    r = ps.get_tensor_model_parallel_rank()
    out["mlp"] = _ported_mlp(x)
    out["emb"] = _ported_embedding(ids)
    shard = logits.chunk(TP, -1)[r].contiguous().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(shard, target)
    loss.sum().backward()
    out["ce"] = (loss.detach(), shard.grad)
    out["linear"] = _ported_linear(x, torch.eye(FFN, H).chunk(TP, 0)[r])
    # an explicit None is still one process (this project's own calling convention)
    plain = torch.nn.Parameter(torch.zeros(2))  # replicated: counted on tp rank 0 only
    out["counted"] = (tp.param_is_not_tensor_parallel_duplicate(plain),
                      tp.param_is_not_tensor_parallel_duplicate(fc1_weight_like()))
    out["none"] = tuple(tp.ColumnParallelLinear(H, FFN, tp_group=None, init_method=INIT,
                                                use_cpu_initialization=True).weight.shape)
    dist.barrier()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, TP)


def test_ported_mlp_shards_and_matches_one_process(results):
    want_y, want_grad, _ = _ported_mlp(_inputs()[0])
    for r, res in enumerate(results):
        y, grad, shape = res["mlp"]
        assert shape == (FFN // TP, H), f"rank {r}: fc1 weight {shape} is not a shard"
        torch.testing.assert_close(y, want_y, **TOL, msg=f"MLP output, rank {r}")
        torch.testing.assert_close(grad, want_grad, **TOL, msg=f"MLP input grad, rank {r}")


def test_ported_embedding_shards_and_matches_one_process(results):
    want, _ = _ported_embedding(_inputs()[1])
    for r, res in enumerate(results):
        got, shape = res["emb"]
        assert shape == (VOCAB // TP, H)
        torch.testing.assert_close(got, want, **TOL, msg=f"embedding, rank {r}")


def test_ported_cross_entropy_reads_the_whole_vocabulary(results):
    _, _, logits, target = _inputs()
    logits = logits.clone().requires_grad_()
    want = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none")
    want.sum().backward()
    for r, res in enumerate(results):
        loss, grad = res["ce"]
        torch.testing.assert_close(loss, want.detach().view(4, 2), **TOL, msg=f"loss, rank {r}")
        torch.testing.assert_close(grad, logits.grad.chunk(TP, -1)[r], **TOL,
                                   msg=f"logits grad, rank {r}")


def test_ported_functional_linear_reduces_the_input_grad(results):
    x = _inputs()[0].clone().requires_grad_()
    torch.nn.functional.linear(x, torch.eye(FFN, H)).sum().backward()
    for r, res in enumerate(results):
        y, grad = res["linear"]
        torch.testing.assert_close(y, x.detach() @ torch.eye(FFN, H).chunk(TP, 0)[r].t())
        torch.testing.assert_close(grad, x.grad, **TOL, msg=f"input grad, rank {r}")


def test_ported_duplicate_check_reads_the_tp_rank(results):
    # Megatron-LM's param_is_not_tensor_parallel_duplicate(param), without a tp rank
    assert [res["counted"] for res in results] == [(True, True), (False, True)]


def test_explicit_none_is_one_process(results):
    assert all(res["none"] == (FFN, H) for res in results)


def test_before_initialize_model_parallel_a_larger_run_is_an_error(results):
    for res in results:
        msg = res.get("early", "")
        assert "ColumnParallelLinear(tp_group=...)" in msg and "initialize_model_parallel" in msg


def test_one_process_without_initialize_is_unsharded():
    assert not dist.is_initialized() and ps.is_unitialized()
    layer = tp.ColumnParallelLinear(H, FFN, init_method=INIT, use_cpu_initialization=True)
    assert layer.tp_group is None and tuple(layer.weight.shape) == (FFN, H)


def test_forced_world_size_without_a_matching_group_is_an_error():
    ps.set_tensor_model_parallel_world_size(2)
    try:
        with pytest.raises(ValueError, match=r"set_tensor_model_parallel_world_size\(2\)"):
            tp.RowParallelLinear(FFN, H, init_method=INIT, use_cpu_initialization=True)
    finally:
        ps.set_tensor_model_parallel_world_size(None)
