"""The distributed optimizer stepped by the Triton AdamW kernel (`--adam-kernel triton`,
megatron/core/optimizer/multi_tensor_adam.py) against torch's AdamW (`--adam-kernel
torch`), on the CPU through Triton's interpreter (the CUDA test compiles the kernel).

The model is an MLP whose weights the shard boundaries cut (pieces longer than one kernel
block, odd sizes; two buckets, two param groups; at dp=2 rank 1 holds no bias, so its
no-weight-decay group is empty), wrapped in DistributedDataParallel with the distributed
optimizer, dp=1 in this process and dp=2 on two gloo processes. Every step writes the same
gradients (times the current loss scale) into the grad buffers of both runs, so the runs
differ only in the update's arithmetic. After 4 steps, clipping active in each:
- main shards, exp_avg and exp_avg_sq within 1e-6 * (1 + max|value|) of torch's (fp32
  rounding of a different order of operations, as in tests/test_multi_tensor_adam.py);
  grad norms within rtol 1e-6; the same steps skipped, the same loss scale; Adam's step
  count is the number of kept steps;
- the 16-bit model parameters: this rank's part of every bucket is exactly its fp32 main
  shards rounded (the kernel wrote it; the copy pass never ran), every rank holds the same
  whole parameters (the all-gather ran), and they are within one 16-bit ulp of torch's run
  (fp32: the main parameters, within the bound above);
- the kernel read the gradients in the grad buffer's own dtype.
Precisions: bf16 with an fp32 grad buffer, bf16 with a bf16 one, fp16 with an fp16 one
and a dynamic loss scale (one step has an inf gradient on the last rank only: skipped on
every rank), fp32 (the main shards are `param_data` itself).
Checkpoint: `state_dict()` and `get_parameter_state()` after 2 Triton steps, loaded back
into the same optimizer (its kernel tables then stale) and into a fresh one: the next 2
steps equal the uninterrupted run's bitwise.
GPT: the trainer's step with bf16, dp=2 and overlapped gathers, against torch's kernel.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core.config import OptimizerConfig, ParallelConfig
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import DistributedOptimizer, build_optimizer, multi_tensor_adam
from megatron.core.parallel_state import ParallelState
from megatron.training import data_iterator, train_step
from tests.dist_utils import run_distributed

# case -> (parameter dtype, DDP options, optimizer options)
CASES = {
    "bf16-fp32-grads": (torch.bfloat16, dict(accumulate_allreduce_grads_in_fp32=True),
                        dict(bf16=True)),
    "bf16-bf16-grads": (torch.bfloat16, {}, dict(bf16=True)),
    "fp16": (torch.float16, {}, dict(fp16=True, initial_loss_scale=1024.0)),
    "fp32": (torch.float32, {}, {}),
}
STEPS = 4
INF_STEP = 2  # fp16: an inf gradient on the last rank at this step
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # one ulp, relative


@pytest.fixture
def interpret(triton_interpreter, monkeypatch):
    """The kernel on CPU tensors, in Triton's interpreter (tests/conftest.py)."""
    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", True)


def _mlp():
    # buffer order (reversed): b3 w3 b2 w2 | b1 w1 -- two buckets of 1888 and 2318
    return torch.nn.Sequential(torch.nn.Linear(37, 61), torch.nn.GELU(), torch.nn.Linear(61, 29),
                               torch.nn.GELU(), torch.nn.Linear(29, 3))


def _build(ps, world, case, kernel, device):
    dtype, ddp_kw, opt_kw = CASES[case]
    torch.manual_seed(0)
    model = _mlp().to(device=device, dtype=dtype)
    ddp = DistributedDataParallel(model, ps, ParallelConfig(
        dp_size=world, world_size=world, use_distributed_optimizer=True, ddp_bucket_size=1500,
        **ddp_kw))
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0,
                          adam_kernel=kernel, **opt_kw)
    opt = build_optimizer(cfg, [ddp], ps)
    assert isinstance(opt, DistributedOptimizer)
    copies = [0]
    copy_pass = opt._copy_main_params_to_model_params

    def counted():
        copies[0] += 1
        copy_pass()
    opt._copy_main_params_to_model_params = counted
    return ddp, opt, copies


def _step(ddp, opt, step, rank, world, case):
    """Same gradients for every run: seeded by (step, rank), times the loss scale."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    scale = opt.get_loss_scale().cpu()
    for p in ddp.module.parameters():
        g = torch.randn(p.shape, generator=gen) * 0.05 * scale
        p.main_grad.copy_(g.to(p.main_grad.device))
    if case == "fp16" and step == INF_STEP and rank == world - 1:
        ddp.module[0].weight.main_grad.view(-1)[7] = float("inf")
    ddp.finish_grad_sync()
    ok, norm, _ = opt.step()
    return bool(ok), None if norm is None else float(norm)


def _snapshot(ddp, opt, rows, copies) -> dict:
    ddp.finish_param_sync()
    mains = opt.get_parameters()
    state = [opt.state.get(p, {}) for p in mains]
    multi = opt._multi or None
    return {
        "rows": list(rows), "copies": copies[0], "scale": float(opt.get_loss_scale()),
        "mains": [p.detach().cpu().clone() for p in mains],
        "exp_avg": [s["exp_avg"].cpu().clone() for s in state],
        "exp_avg_sq": [s["exp_avg_sq"].cpu().clone() for s in state],
        "steps": {float(s["step"]) for s in state},
        "model": [p.detach().cpu().clone() for p in ddp.module.parameters()],
        "rounded": all(torch.equal(s.model_shard[e.start:e.end], e.main.to(s.model_shard.dtype))
                       for s in opt.shards for e in s.entries),
        "group_sizes": [len(g["params"]) for g in opt.param_groups],
        "kernel_grad_dtypes": (None if multi is None else
                               {t.grad_dtype for t in multi.tables if t.params}),
        "grad_dtype": next(iter(ddp.grad_buffers)),
    }


def _train(ps, rank, world, case, kernel, device="cpu") -> dict:
    ddp, opt, copies = _build(ps, world, case, kernel, device)
    rows = [_step(ddp, opt, step, rank, world, case) for step in range(STEPS)]
    return _snapshot(ddp, opt, rows, copies)


def _parity_worker(rank, world, case, device="cpu"):
    if world > 1:  # a child process (this process's setting comes from the fixtures)
        multi_tensor_adam.INTERPRET_ON_CPU = device == "cpu"
    ps = ParallelState.build(world, rank)
    return {kernel: _train(ps, rank, world, case, kernel, device) for kernel in ("torch", "triton")}


def _close(got, ref, what):
    for a, b in zip(got, ref):
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        assert diff <= 1e-6 * (1 + b.abs().max().item()), f"{what} off by {diff}"


def _check_parity(results, case):
    dtype = CASES[case][0]
    for rank, runs in enumerate(results):
        ref, got = runs["torch"], runs["triton"]
        assert ref["kernel_grad_dtypes"] is None and ref["copies"] == sum(r[0] for r in ref["rows"])
        assert got["kernel_grad_dtypes"] == {got["grad_dtype"]}, "the kernel did not step"
        assert got["copies"] == 0 and got["rounded"] and ref["rounded"]
        assert [r[0] for r in got["rows"]] == [r[0] for r in ref["rows"]]
        for (_, norm), (_, ref_norm) in zip(got["rows"], ref["rows"]):
            assert (norm is None) == (ref_norm is None)
            assert norm is None or abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
        assert got["scale"] == ref["scale"]
        kept = sum(r[0] for r in got["rows"])
        assert got["steps"] == ref["steps"] == ({float(kept)} if got["mains"] else set())
        for key in ("mains", "exp_avg", "exp_avg_sq"):
            _close(got[key], ref[key], f"rank {rank} {case} {key}")
        for a, b in zip(got["model"], ref["model"]):
            assert a.dtype == dtype
            if dtype == torch.float32:  # the main parameters themselves
                _close([a], [b], f"rank {rank} {case} model")
            else:  # one rounding of main parameters that agree to fp32 rounding: one ulp
                ulp = ULP[dtype] * b.float().abs().clamp(min=torch.finfo(dtype).smallest_normal)
                assert ((a.float() - b.float()).abs() <= ulp).all()
        for a, b in zip(got["model"], results[0]["triton"]["model"]):
            assert torch.equal(a, b), "the ranks' parameters differ: no all-gather"
        if case == "fp16":  # the inf sat in one rank's shard: skipped on every rank
            assert [r[0] for r in got["rows"]] == [i != INF_STEP for i in range(STEPS)]


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_dp1(case, interpret):
    _check_parity([_parity_worker(0, 1, case)], case)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_dp2(case, interpret):
    results = run_distributed(_parity_worker, 2, case)
    assert any(0 in r["triton"]["group_sizes"] for r in results), "no empty group on a rank"
    _check_parity(results, case)


# --------------------------------------------------------------------------- checkpoint
def _load(ddp, opt, saved) -> None:
    model_state, opt_state, param_state = saved
    ddp.module.load_state_dict(model_state)
    opt.load_state_dict(copy.deepcopy(opt_state))
    opt.load_parameter_state(param_state)


def _resume_worker(rank, world, case, device="cpu"):
    if world > 1:  # a child process (this process's setting comes from the fixtures)
        multi_tensor_adam.INTERPRET_ON_CPU = device == "cpu"
    ps = ParallelState.build(world, rank)
    ddp, opt, copies = _build(ps, world, case, "triton", device)
    rows = [_step(ddp, opt, step, rank, world, case) for step in range(2)]
    param_state = [opt.get_parameter_state()]  # on DP rank 0 only, as when saving
    if world > 1:
        dist.broadcast_object_list(param_state, src=0)
    saved = ({k: v.clone() for k, v in ddp.module.state_dict().items()},
             copy.deepcopy(opt.state_dict()), param_state[0])
    later = [_step(ddp, opt, step, rank, world, case) for step in range(2, STEPS)]
    expected = _snapshot(ddp, opt, rows + later, copies)
    stale = [t.exp_avgs for t in opt._multi.tables]
    _load(ddp, opt, saved)  # the same optimizer: its kernel tables are stale now
    same = _snapshot(ddp, opt, rows + [_step(ddp, opt, s, rank, world, case)
                                       for s in range(2, STEPS)], copies)
    rebuilt = all(a is not b for old, t in zip(stale, opt._multi.tables)
                  for a, b in zip(old, t.exp_avgs))
    ddp, opt, copies = _build(ps, world, case, "triton", device)
    _load(ddp, opt, saved)
    fresh = _snapshot(ddp, opt, rows + [_step(ddp, opt, s, rank, world, case)
                                        for s in range(2, STEPS)], copies)
    return expected, same, fresh, rebuilt


def _check_resume(results):
    for expected, same, fresh, rebuilt in results:
        assert rebuilt, "the kernel's tables were not rebuilt after the load"
        assert expected["kernel_grad_dtypes"] and fresh["kernel_grad_dtypes"]
        for got in (same, fresh):
            assert got["rows"] == expected["rows"] and got["scale"] == expected["scale"]
            assert got["steps"] == expected["steps"]
            for key in ("mains", "exp_avg", "exp_avg_sq", "model"):
                assert all(torch.equal(a, b) for a, b in zip(got[key], expected[key])), key


@pytest.mark.parametrize("case", ["bf16-fp32-grads", "fp16"])
def test_checkpoint_round_trip_continues_identically_dp1(case, interpret):
    _check_resume([_resume_worker(0, 1, case)])


@pytest.mark.parametrize("case", ["bf16-fp32-grads", "fp16"])
def test_checkpoint_round_trip_continues_identically_dp2(case, interpret):
    _check_resume(run_distributed(_resume_worker, 2, case))


# --------------------------------------------------------------------------- GPT
GPT_PARALLEL = dict(use_distributed_optimizer=True, accumulate_allreduce_grads_in_fp32=True,
                    overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=2500)


def _gpt_worker(rank, world):
    from tests.test_distrib_optimizer import _trainer

    multi_tensor_adam.INTERPRET_ON_CPU = True
    runs = {}
    for kernel in ("torch", "triton"):
        cfg, rt, tr = _trainer(rank, world, parallel=GPT_PARALLEL,
                               model_kw=dict(params_dtype=torch.bfloat16),
                               optim=dict(bf16=True, adam_kernel=kernel), iters=4)
        data = data_iterator(cfg, rt, "train", 0)
        rows = [train_step(tr, data)[::2] for _ in range(4)]
        runs[kernel] = ([(float(loss), float(norm)) for loss, norm in rows],
                        bool(tr.optimizer._multi))
    return runs


def test_gpt_training_dp2_with_overlapped_gathers_matches_torch(interpret):
    """The trainer's step (bf16 GPT, dp=2, overlapped reduce-scatter and parameter
    all-gather): the first step's loss and grad norm equal torch's (the same weights and
    gradients; norm within rtol 1e-6); later losses within 1e-3 and norms within rtol 1e-3
    (an ulp of an fp32 weight can flip a bf16 one, as in tests/test_multi_tensor_adam.py)."""
    for runs in run_distributed(_gpt_worker, 2):
        (ref, ref_multi), (got, got_multi) = runs["torch"], runs["triton"]
        assert got_multi and not ref_multi
        assert got[0][0] == ref[0][0] and abs(got[0][1] - ref[0][1]) <= 1e-6 * ref[0][1]
        for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
            assert abs(loss - ref_loss) <= 1e-3 and abs(norm - ref_norm) <= 1e-3 * ref_norm
        assert ref[-1][0] < ref[0][0]


# --------------------------------------------------------------------------- choices
def _dp1_optimizer(kernel, mixed_dtypes=False):
    ps = ParallelState.build()
    model = _mlp().to(torch.bfloat16)
    if mixed_dtypes:  # an fp32 layer: grad buffers of two dtypes
        model[4].float()
    ddp = DistributedDataParallel(model, ps, ParallelConfig(use_distributed_optimizer=True))
    opt = build_optimizer(OptimizerConfig(lr=1e-2, bf16=True, adam_kernel=kernel), [ddp], ps)
    return ddp, opt


def test_triton_where_it_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(multi_tensor_adam, "triton", None)  # Triton missing
    ddp, opt = _dp1_optimizer("triton")
    ddp.finish_grad_sync()
    with pytest.raises(ValueError, match="--adam-kernel triton cannot be used: Triton cannot"):
        opt.step()
    ddp, opt = _dp1_optimizer("auto")  # auto: torch's kernel, as before
    ddp.finish_grad_sync()
    assert opt.step()[0] and opt._multi is False


def test_several_grad_dtypes_keep_torch_kernel(interpret):
    ddp, opt = _dp1_optimizer("triton", mixed_dtypes=True)
    ddp.finish_grad_sync()
    with pytest.raises(ValueError, match="grad buffers have several dtypes"):
        opt.step()
    ddp, opt = _dp1_optimizer("auto", mixed_dtypes=True)
    ddp.finish_grad_sync()
    assert opt.step()[0] and opt._multi is False


def test_a_rank_that_cannot_take_the_kernel_stops_with_an_error(interpret):
    """A rank whose shards the kernel cannot step (parameters at two Adam step counts):
    alone (no group) it falls back to torch's kernel; with a group over several ranks it
    raises, naming the fix, before any collective -- falling back alone would leave the
    other ranks waiting in a collective of the other path."""
    for group in (None, "a world of several ranks"):
        ddp, opt = _dp1_optimizer("triton")
        ddp.finish_grad_sync()
        assert opt.step()[0] and opt._multi
        next(iter(opt.optimizer.state.values()))["step"] += 1
        opt._multi.step_count = None  # as after a load: the counts are read again
        opt.mp_group = group  # never used: the check comes first
        ddp.finish_grad_sync()
        if group is None:
            assert opt.step()[0] and not opt._multi.ready()
            continue
        with pytest.raises(RuntimeError, match="every rank must take the same path: run "
                                               "with --adam-kernel torch"):
            opt.step()


def test_captured_in_a_step_graph_only_with_one_dp_rank(interpret):
    """dp=1: no collective in the step, so a whole-step graph may record it; with a DP
    group the parameter all-gather after the step rules the graph out."""
    ddp, opt = _dp1_optimizer("triton")
    ddp.finish_grad_sync()
    assert opt.step()[0] and opt._multi
    assert opt.graph_capture_reason() is None
    opt.shards[0].bucket.dp_group = object()  # as a bucket of several DP ranks has
    assert "--use-distributed-optimizer" in opt.graph_capture_reason()


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_on_cuda_dp1(case, monkeypatch):
    """The compiled kernel against torch's fused AdamW on the GPU, dp=1: the same checks,
    and the checkpoint round trip."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", False)
    _check_parity([_parity_worker(0, 1, case, "cuda")], case)
    _check_resume([_resume_worker(0, 1, case, "cuda")])
