"""Data-parallel grad buffers: 2 gloo processes against the single-process full batch."""
import copy
import gc
import weakref
from contextlib import nullcontext

import pytest
import torch

from megatron.core.config import OptimizerConfig, ParallelConfig
from megatron.core.distributed import (
    DistributedDataParallel,
    allreduce_sequence_parallel_grads,
)
from megatron.core.optimizer import build_optimizer
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed

GLOBAL_BATCH = 8


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3),
    ).to(dtype)


def _data(iteration):
    g = torch.Generator().manual_seed(10 + iteration)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _reference_grads(model, x, y):
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _run_iteration(ddp, x, y, num_micro):
    """Megatron's micro-batch loop: loss / M, all but the last micro-batch in no_sync()."""
    ddp.zero_grad_buffer()
    for m, (xm, ym) in enumerate(zip(x.chunk(num_micro), y.chunk(num_micro))):
        ctx = ddp.no_sync() if m < num_micro - 1 else nullcontext()
        with ctx:
            (torch.nn.functional.mse_loss(ddp(xm), ym) / num_micro).backward()
    ddp.finish_grad_sync()
    return [p.main_grad.clone() for p in ddp.module.parameters()]


def _ddp_worker(rank, world_size, overlap, bucket_size, num_micro):
    ps = ParallelState.build(world_size, rank)
    model = _mlp()
    ref = copy.deepcopy(model)
    config = ParallelConfig(dp_size=world_size, world_size=world_size,
                            overlap_grad_reduce=overlap, ddp_bucket_size=bucket_size)
    ddp = DistributedDataParallel(model, ps, config)
    out = []
    local = GLOBAL_BATCH // world_size
    for it in range(2):  # the second iteration checks that buffers and buckets reset
        x, y = _data(it)
        grads = _run_iteration(ddp, x[rank * local:(rank + 1) * local],
                               y[rank * local:(rank + 1) * local], num_micro)
        out.append((grads, _reference_grads(ref, x, y)))
    assert all(p.grad is None for p in model.parameters())
    return {"iterations": out, "num_buckets": len(ddp.buckets)}


@pytest.mark.parametrize("overlap, bucket_size, num_micro", [
    (False, None, 1), (False, 40, 2), (True, 40, 1), (True, 40, 2), (True, None, 2),
])
def test_ddp_matches_full_batch(overlap, bucket_size, num_micro):
    results = run_distributed(_ddp_worker, 2, overlap, bucket_size, num_micro)
    for r in results:
        if bucket_size == 40:
            assert r["num_buckets"] == 3  # params reversed: 3+48 | 16+16+16 | 96 elements
        else:
            assert r["num_buckets"] == 1
        for grads, ref in r["iterations"]:
            for g, expected in zip(grads, ref):
                torch.testing.assert_close(g, expected, rtol=0, atol=1e-6)
    for a, b in zip(results[0]["iterations"][1][0], results[1]["iterations"][1][0]):
        assert torch.equal(a, b)  # every replica holds the same averaged grads


def test_buffer_layout_reverse_order_and_views():
    model = _mlp()
    ddp = DistributedDataParallel(model, ParallelState.build(), ParallelConfig(ddp_bucket_size=40))
    (buffer,) = ddp.grad_buffers.values()
    params = list(model.parameters())
    assert buffer.data.numel() == sum(p.numel() for p in params)
    offset = 0
    for p in reversed(params):  # last parameter first
        assert p.main_grad.data_ptr() == buffer.data[offset:].data_ptr()
        offset += p.numel()
    assert [len(b.params) for b in ddp.buckets] == [2, 3, 1]
    assert ddp.state_dict().keys() == model.state_dict().keys()


def test_fp32_accumulation_of_bf16_grads():
    model = _mlp(torch.bfloat16)
    ref = copy.deepcopy(model)
    config = ParallelConfig(accumulate_allreduce_grads_in_fp32=True)
    ddp = DistributedDataParallel(model, ParallelState.build(), config)
    assert list(ddp.grad_buffers) == [torch.float32]
    x, y = _data(0)
    x, y = x.bfloat16(), y.bfloat16()
    grads = _run_iteration(ddp, x, y, num_micro=2)
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        ref.zero_grad()
        (torch.nn.functional.mse_loss(ref(xm), ym) / 2).backward()
        for e, p in zip(expected, ref.parameters()):
            e += p.grad.float()
    for g, e in zip(grads, expected):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    bf16_ddp = DistributedDataParallel(_mlp(torch.bfloat16), ParallelState.build(),
                                       ParallelConfig())
    assert list(bf16_ddp.grad_buffers) == [torch.bfloat16]


def test_optimizer_reads_main_grad():
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, ParallelState.build(), ParallelConfig())
    config = OptimizerConfig(lr=1e-2, clip_grad=1.0)
    opt = build_optimizer(config, [ddp], ParallelState.build())
    ref_opt = build_optimizer(config, [ref], ParallelState.build())
    x, y = _data(0)
    for _ in range(2):
        _run_iteration(ddp, x, y, num_micro=1)
        ok, norm, _ = opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        _, ref_norm, _ = ref_opt.step()
        assert ok and float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert p.grad is None  # no alias of the buffer left for the next backward


def test_overlap_starts_buckets_during_last_backward_only():
    ddp = DistributedDataParallel(_mlp(), ParallelState.build(),
                                  ParallelConfig(overlap_grad_reduce=True, ddp_bucket_size=40))
    x, y = _data(0)
    with ddp.no_sync():
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    assert not any(b._started for b in ddp.buckets)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    assert all(b._started for b in ddp.buckets)  # launched by the hooks, not by finish
    ddp.finish_grad_sync()
    assert not any(b._started for b in ddp.buckets)
    with pytest.raises(RuntimeError, match="no_sync"):  # a second "last" backward
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(ddp(x), y).backward()


def test_a_dropped_wrapper_is_freed_and_leaves_a_plain_module():
    """The grad hooks hold the wrapper weakly: once nothing else refers to it, it and its
    grad buffers are freed while the module lives on, and the module's backward fills
    `.grad` again (before the fix the parameters' hooks kept the wrapper alive forever)."""
    model = _mlp()
    ddp = DistributedDataParallel(model, ParallelState.build(), ParallelConfig())
    buffer = weakref.ref(ddp.grad_buffers[torch.float32])
    x, y = _data(0)
    expected = _reference_grads(copy.deepcopy(model), x, y)
    grads = _run_iteration(ddp, x, y, num_micro=1)
    assert all(p.grad is None for p in model.parameters())  # moved into main_grad
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    wrapper = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert wrapper() is None and buffer() is None
    for g, e in zip(_reference_grads(model, x, y), expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def _sp_worker(rank, world_size):
    ps = ParallelState.build(world_size, rank, tp_size=world_size, sequence_parallel=True)
    norm = torch.nn.LayerNorm(4)
    other = torch.nn.Linear(4, 4)
    for p in norm.parameters():
        p.sequence_parallel = True
    model = torch.nn.ModuleList([norm, other])
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(rank + 1 + i))
    norm.bias.main_grad = torch.full_like(norm.bias, 10.0 * (rank + 1))
    allreduce_sequence_parallel_grads([model], ps.tp_group)
    return {"w": norm.weight.grad, "b": norm.bias.main_grad, "other": other.weight.grad}


def test_allreduce_sequence_parallel_grads():
    r0, r1 = run_distributed(_sp_worker, 2)
    for r, rank in ((r0, 0), (r1, 1)):
        assert torch.equal(r["w"], torch.full((4,), 3.0))      # 1 + 2
        assert torch.equal(r["b"], torch.full((4,), 30.0))     # 10 + 20 (main_grad wins)
        assert torch.equal(r["other"], torch.full((4, 4), float(rank + 3)))  # untouched


def _torch_ddp_worker(rank, world_size):
    import warnings

    ps = ParallelState.build(world_size, rank)
    model = _mlp()
    model.register_buffer("rank_local", torch.full((2,), float(rank)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(model, ps, ParallelConfig(
            dp_size=world_size, world_size=world_size, ddp_impl="torch"))
        ddp(torch.randn(2, 6))
    return {"warnings": [str(w.message) for w in caught],
            "buffer": model.rank_local.tolist()}


def test_torch_ddp_is_quiet_and_leaves_buffers_alone():
    """--DDP-impl torch wraps torch's DDP with Megatron-LM's broadcast_buffers=False: no
    buffer is synced, at init or in forward. torch 2.13 deprecates that argument with a
    FutureWarning that every rank printed at start-up."""
    for rank, r in enumerate(run_distributed(_torch_ddp_worker, 2)):
        assert not [w for w in r["warnings"] if "broadcast_buffers" in w], r["warnings"]
        assert r["buffer"] == [float(rank)] * 2


def _counting_allreduce_hook(state, bucket):
    state.append(bucket.index())
    fut = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / torch.distributed.get_world_size())


def _torch_ddp_schedule_worker(rank, world_size, num_micro):
    from megatron.core.pipeline_parallel.executor import ScheduleExecutor
    from megatron.core.pipeline_parallel.model_chunks import ModelChunks
    from megatron.core.pipeline_parallel.schedules import build_schedule

    model = _mlp()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, ParallelState.build(world_size, rank), ParallelConfig(
        dp_size=world_size, world_size=world_size, ddp_impl="torch"))
    reductions = []
    ddp.torch_ddp.register_comm_hook(reductions, _counting_allreduce_hook)
    chunks = ModelChunks([ddp])
    x, y = _data(0)
    local = GLOBAL_BATCH // world_size
    xs = x[rank * local:(rank + 1) * local].chunk(num_micro)
    ys = y[rank * local:(rank + 1) * local].chunk(num_micro)

    def forward_step(chunk, mb, _):
        return torch.nn.functional.mse_loss(chunks[chunk](xs[mb]), ys[mb])

    ScheduleExecutor(chunks, forward_step, None, 0, 1, num_micro).run(
        build_schedule(1, num_micro)[0])
    return {"reductions": len(reductions), "grads": [p.grad for p in model.parameters()],
            "expected": _reference_grads(ref, x, y)}


def test_torch_ddp_reduces_once_per_step_under_the_schedule():
    """--DDP-impl torch with gradient accumulation: torch's DDP decides in the FORWARD
    whether the next backward all-reduces, so the executor must run the forwards of all
    but the last micro-batch inside no_sync() too (Megatron-LM's no-pipelining schedule
    does). With only the backwards inside, every micro-batch was all-reduced (same
    gradients, num_micro times the data-parallel traffic)."""
    for r in run_distributed(_torch_ddp_schedule_worker, 2, 4):
        assert r["reductions"] == 1, r["reductions"]
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
