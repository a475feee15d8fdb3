"""The distributed optimizer (--use-distributed-optimizer) and --DDP-impl torch.

1. GPT training with the distributed optimizer under DP=2 and DP=4 (with and without
   overlapped, bucketed reduce-scatter and overlapped parameter all-gather) and TP=2 x DP=2
   equals the single-process run with the plain optimizer: losses and grad norms of every
   iteration, and all parameters after the last one. Tolerance: fp32 with a different
   reduction order -> rtol 1e-5 on losses and norms, max abs diff <= 1e-5 * (1 + max|w|)
   on parameters. Every parameter element has optimizer state on exactly one DP rank.
2. PP=2 x DP=2 with tied embeddings: the distributed optimizer equals the plain one.
3. bf16 parameters: the distributed optimizer matches the unsharded mixed-precision
   optimizer (bf16 tolerance).
4. Checkpoints: saved with DP=2, resumed with DP=1 and DP=4, the next losses equal the
   uninterrupted DP=2 run (rtol 1e-5); files load with torch.load(weights_only=True) and
   distrib_optim.pt has Megatron's layout.
5. An inf gradient on one rank skips the step on every rank.
6. --DDP-impl torch equals the local DDP; flag validation messages; bucket layout.
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest
import torch

from megatron import trainer_checkpoint
from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.core.config import OptimizerConfig, ParallelConfig
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import DistributedOptimizer, build_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_tensor, tiny_config

DIST = dict(use_distributed_optimizer=True)
OVERLAP = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, ddp_bucket_size=2500)


def _trainer(rank, world, tp=1, pp=1, parallel=None, model_kw=None, optim=None, iters=3):
    torch.manual_seed(0)
    cfg = tiny_config(world_size=world, tp=tp, pp=pp, iters=iters, **(model_kw or {}))
    for k, v in (parallel or {}).items():
        setattr(cfg.parallel, k, v)
    for k, v in (optim or {}).items():
        setattr(cfg.optimizer, k, v)
    ps = ParallelState.build(world, rank, tp_size=tp, pp_size=pp)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    return cfg, rt, build_trainer(cfg, rt)


def _params(tr, tp_group):
    for chunk in tr.model:
        chunk.finish_param_sync()
    return {n: full_tensor(p, p.detach().float(), tp_group)
            for n, p in tr.model.module.named_parameters()}


def _state_elements(opt) -> int:
    return sum(s["exp_avg"].numel() for s in opt.state.values() if "exp_avg" in s)


def _train(rank, world, tp=1, pp=1, parallel=None, model_kw=None, optim=None, iters=3):
    cfg, rt, tr = _trainer(rank, world, tp, pp, parallel, model_kw, optim, iters)
    data = data_iterator(cfg, rt, "train", 0)
    losses, norms, pending = [], [], False
    for _ in range(iters):
        loss, ok, norm, _ = train_step(tr, data)
        assert ok
        losses.append(float(loss))
        norms.append(float(norm))
        pending |= any(b.param_sync_pending for c in tr.model for b in c.buckets)
    return {"losses": losses, "norms": norms, "params": _params(tr, rt.ps.tp_group),
            "kind": type(tr.optimizer).__name__, "state": _state_elements(tr.optimizer),
            "local": sum(p.numel() for p in tr.model.module.parameters()),
            "buckets": len(tr.model[0].buckets), "pending": pending}


@lru_cache(maxsize=None)
def _reference():
    return _train(0, 1)


def _compare(ref, got, what, rtol=1e-5):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=rtol, atol=0, msg=f"{what}: losses differ")
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]),
                               rtol=rtol, atol=0, msg=f"{what}: grad norms differ")
    for name, w in ref["params"].items():
        diff = (got["params"][name] - w).abs().max().item()
        assert diff <= rtol * (1 + w.abs().max().item()), f"{what}: {name} off by {diff}"


# --------------------------------------------------------------------------- 1. parity
@pytest.mark.parametrize("world,tp,parallel", [
    (2, 1, DIST), (2, 1, dict(OVERLAP, overlap_param_gather=True)), (4, 1, DIST),
    (4, 1, OVERLAP), (4, 2, DIST),
], ids=["dp2", "dp2-overlap-param-gather", "dp4", "dp4-overlap", "tp2xdp2"])
def test_distributed_optimizer_matches_single_process(world, tp, parallel):
    ref = _reference()
    results = run_distributed(_train, world, tp, 1, parallel)
    dp = world // tp
    for rank, got in enumerate(results):
        assert got["kind"] == "DistributedOptimizer"
        _compare(ref, got, f"world={world} tp={tp} {parallel} rank={rank}")
        if parallel.get("overlap_grad_reduce"):
            assert got["buckets"] > 2
        assert got["pending"] == bool(parallel.get("overlap_param_gather"))
    for t in range(tp):  # each element's Adam state lives on exactly one DP rank
        replica = [results[d * tp + t] for d in range(dp)]
        assert sum(r["state"] for r in replica) == replica[0]["local"]
        assert max(r["state"] for r in replica) < replica[0]["local"] / dp + 5000


def _pp_worker(rank, world):
    from megatron.core.distributed import ddp

    plain = _train(rank, world, pp=2)
    rebuilt, rebuild = [], ddp._rebuild_reduced_grad
    ddp._rebuild_reduced_grad = lambda *a: rebuilt.append(1) or rebuild(*a)
    sharded = _train(rank, world, pp=2, parallel=DIST)
    return plain, sharded, len(rebuilt)


def test_pipeline_with_tied_embeddings_matches_plain_optimizer():
    """pp=2 dp=2, tied embeddings: the distributed optimizer's run equals the plain one's,
    the tied weights (marked shared_embedding by build_model: a bucket of their own,
    sharded alike on both ends) summed over the embedding group without first rebuilding
    their whole DP-reduced grad (one all-reduce of the embedding per step less)."""
    for rank, (plain, sharded, rebuilt) in enumerate(run_distributed(_pp_worker, 4)):
        assert sharded["kind"] == "DistributedOptimizer"
        _compare(plain, sharded, f"pp=2 dp=2 rank={rank}")
        assert rebuilt == 0, f"rank {rank} rebuilt a tied embedding's grad {rebuilt} times"


# --------------------------------------------------------------------------- 2. bf16
BF16 = dict(params_dtype=torch.bfloat16)


def _bf16_worker(rank, world):
    par = dict(accumulate_allreduce_grads_in_fp32=True)
    plain = _train(rank, world, parallel=par, model_kw=BF16, optim=dict(bf16=True))
    sharded = _train(rank, world, parallel=dict(par, **OVERLAP), model_kw=BF16,
                     optim=dict(bf16=True))
    return plain, sharded


def test_bf16_params_match_unsharded_mixed_precision():
    for rank, (plain, sharded) in enumerate(run_distributed(_bf16_worker, 2)):
        assert plain["kind"] == "MixedPrecisionOptimizer"
        assert sharded["kind"] == "DistributedOptimizer"
        assert sharded["losses"][-1] < sharded["losses"][0]
        _compare(plain, sharded, f"bf16 rank={rank}", rtol=1e-2)


# --------------------------------------------------------------------------- 3. checkpoints
def _save_worker(rank, world, root):
    cfg, rt, tr = _trainer(rank, world, parallel=DIST, iters=4)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = root, 2
    data = data_iterator(cfg, rt, "train", 0)
    losses = []
    for it in range(4):
        losses.append(float(train_step(tr, data)[0]))
        tr.state.iteration += 1
        tr.state.consumed_train_samples += cfg.data.global_batch_size
        if tr.state.iteration == 2:
            trainer_checkpoint.save_trainer_checkpoint(tr)
    return losses[2:]


def _load_worker(rank, world, root, distributed=True):
    cfg, rt, tr = _trainer(rank, world, parallel=DIST if distributed else {}, iters=4)
    cfg.checkpoint.load = root
    trainer_checkpoint.load_trainer_checkpoint(tr)
    assert tr.state.iteration == 2
    data = data_iterator(cfg, rt, "train", tr.state.consumed_train_samples)
    return [float(train_step(tr, data)[0]) for _ in range(2)]


def test_checkpoint_saved_with_dp2_resumes_with_dp1_and_dp4(tmp_path):
    root = str(tmp_path / "ckpt")
    expected = run_distributed(_save_worker, 2, root)[0]
    rank_dir = os.path.join(root, "iter_0000002", "mp_rank_00")
    assert sorted(os.listdir(rank_dir)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    main = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=True)
    groups = main["optimizer"]["optimizer"]["param_groups"]
    assert "state" not in main["optimizer"]["optimizer"]
    assert all("params" not in g and g["step"] == 2 for g in groups)
    shards = torch.load(os.path.join(rank_dir, "distrib_optim.pt"), weights_only=True)
    entry = shards[0][torch.float32]
    n = sum(t.numel() for t in main["model"].values())
    assert set(entry) == {"param", "exp_avg", "exp_avg_sq"}
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() == n
               for t in entry.values())  # n is even: no padding at dp=2
    # parameters back to back in buffer order: the model's last parameter first
    last_name, last = list(main["model"].items())[-1]
    torch.testing.assert_close(entry["param"][:last.numel()], last.reshape(-1).float())
    for world in (1, 4):
        for rank, got in enumerate(run_distributed(_load_worker, world, root)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5,
                                       atol=0, msg=f"resumed with dp={world} rank={rank}")
    # without --use-distributed-optimizer the shards are gathered into the plain optimizer
    # state on load, and training goes on exactly as with the sharded optimizer
    got = run_distributed(_load_worker, 1, root, False)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0,
                               msg="resumed with the plain optimizer")


def test_shards_of_another_precision_exit_with_the_load_error(tmp_path):
    """distrib_optim.pt without this run's grad-buffer dtype (saved in another precision):
    the load ends like every other checkpoint that does not fit, with one "error: loading
    <dir>: ..." (SystemExit, agreed over the ranks), not a ValueError traceback from each
    rank (or, where only some stages failed, the other ranks waiting forever)."""
    root = str(tmp_path / "ckpt")
    _save_worker(0, 1, root)
    path = os.path.join(root, "iter_0000002", "mp_rank_00", "distrib_optim.pt")
    shards = torch.load(path, weights_only=True)
    shards[0] = {torch.bfloat16: shards[0][torch.float32]}  # as if saved with bf16 buffers
    torch.save(shards, path)
    cfg, _, tr = _trainer(0, 1, parallel=DIST, iters=4)
    cfg.checkpoint.load = root
    with pytest.raises(SystemExit) as info:
        trainer_checkpoint.load_trainer_checkpoint(tr)
    message = str(info.value.code)
    assert message.startswith(f"error: loading {path}: distrib_optim.pt has no "  # the file
                              "entry for model chunk 0 with grad dtype torch.float32"), message
    assert "--no-load-optim" in message


def _distributed_mlp_optimizer(**optim):
    ps = ParallelState.build(1, 0)
    ddp = DistributedDataParallel(_mlp(), ps, ParallelConfig(
        dp_size=1, world_size=1, use_distributed_optimizer=True))
    opt = build_optimizer(OptimizerConfig(lr=0.1, **optim), [ddp], ps)
    assert isinstance(opt, DistributedOptimizer)
    return opt


def test_resume_keeps_the_command_lines_hyperparameters_and_refuses_another_kind():
    """The saved groups' betas / eps replaced the command line's on load; an SGD run loading
    an Adam checkpoint went on with Adam's group keys and no momentum buffer."""
    saved = _distributed_mlp_optimizer().state_dict()
    opt = _distributed_mlp_optimizer(adam_beta1=0.8, adam_eps=1e-5)
    assert opt.load_state_dict(saved) == [
        "--adam-beta1/--adam-beta2: using the command line's 0.8 0.999, not the "
        "checkpoint's 0.9 0.999", "--adam-eps: using the command line's 1e-05, not the "
        "checkpoint's 1e-08"]
    assert all(g["betas"] == (0.8, 0.999) and g["eps"] == 1e-5
               for g in opt.optimizer.param_groups)
    with pytest.raises(ValueError, match="--optimizer adam's but this run uses --optimizer sgd"):
        _distributed_mlp_optimizer(optimizer="sgd").load_state_dict(saved)


# --------------------------------------------------------------------------- 4. overflow
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _inf_worker(rank, world):
    ps = ParallelState.build(world, rank)
    model = _mlp()
    ddp = DistributedDataParallel(model, ps, ParallelConfig(
        dp_size=world, world_size=world, use_distributed_optimizer=True))
    opt = build_optimizer(OptimizerConfig(lr=0.1, loss_scale=8.0), [ddp], ps)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    results = []
    for inject in (True, False):
        ddp.zero_grad_buffer()
        opt.scale_loss(ddp(x).square().mean()).backward()
        ddp.finish_grad_sync()
        if inject and rank == 1:
            ddp.buckets[0].shard(ddp.buckets[0].grad_data)[0] = float("inf")
        ok, norm, _ = opt.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        results.append((ok, changed))
    return results, isinstance(opt, DistributedOptimizer)


def test_inf_grad_on_one_rank_skips_the_step_everywhere():
    for results, is_distributed in run_distributed(_inf_worker, 2):
        assert is_distributed
        assert results == [(False, False), (True, True)]


# --------------------------------------------------------------------------- 5. DDP impls
def _ddp_impl_worker(rank, world):
    fused = dict(gradient_accumulation_fusion=True)  # the CLI default; torch DDP ignores it
    local = _train(rank, world, model_kw=fused)
    torch_ddp = _train(rank, world, parallel=dict(ddp_impl="torch"), model_kw=fused)
    return local, torch_ddp


def test_torch_ddp_matches_local_ddp():
    for rank, (local, torch_ddp) in enumerate(run_distributed(_ddp_impl_worker, 2)):
        _compare(local, torch_ddp, f"--DDP-impl torch rank={rank}")


def test_torch_ddp_rejects_what_needs_grad_buffers():
    ps = ParallelState.build()
    for bad in (dict(use_distributed_optimizer=True), dict(accumulate_allreduce_grads_in_fp32=True),
                dict(pp_size=2)):
        with pytest.raises(ValueError, match="use --DDP-impl local"):
            DistributedDataParallel(_mlp(), ps, ParallelConfig(ddp_impl="torch", **bad))


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 "
        "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data").split()


@pytest.mark.parametrize("extra,world,part", [
    ("--use-distributed-optimizer --DDP-impl torch", 2,
     "--use-distributed-optimizer needs --DDP-impl local (got torch)"),
    ("--DDP-impl torch --pipeline-model-parallel-size 2", 2,
     "--pipeline-model-parallel-size 2 needs --DDP-impl local (got torch)"),
    ("--overlap-param-gather", 2, "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--use-distributed-optimizer --overlap-param-gather --compile", 2, "drop --compile"),
])
def test_flag_validation(extra, world, part):
    with pytest.raises(ArgumentsError) as info:
        parse_and_validate(BASE + extra.split(), world_size=world, env={}, cuda_available=False)
    assert part in info.value.message


def test_flags_reach_the_configs():
    cfg = parse_and_validate(BASE + ["--use-distributed-optimizer", "--overlap-param-gather"],
                             world_size=2, env={}, cuda_available=False)
    assert cfg.parallel.use_distributed_optimizer and cfg.parallel.overlap_param_gather


def test_sharded_bucket_layout():
    model = _mlp()  # 96 + 16 + 48 + 3 elements
    for p in model[0].parameters():
        p.shared_embedding = True  # bucket of its own
    ddp = DistributedDataParallel(model, ParallelState.build(), ParallelConfig(
        use_distributed_optimizer=True, ddp_bucket_size=40))
    sizes = [len(b.params) for b in ddp.buckets]
    assert sizes == [2, 1, 1]  # [b2, w2] | b0 | w0 (reversed order)
    for p in model.parameters():  # parameters now live in the buckets' param_data
        bucket = p.grad_bucket
        start, _ = bucket.param_ranges[p]
        assert p.data_ptr() == bucket.param_data[start:].data_ptr()
    assert ddp.state_dict().keys() == model.state_dict().keys()


def _padding_worker(rank, world):
    ps = ParallelState.build(world, rank)
    ddp = DistributedDataParallel(_mlp(), ps, ParallelConfig(
        dp_size=world, world_size=world, use_distributed_optimizer=True, ddp_bucket_size=40))
    return [(b.grad_data.numel(), b.shard_range) for b in ddp.buckets]


def test_buckets_padded_to_dp_multiple_and_sharded():
    results = run_distributed(_padding_worker, 4)
    for rank, layout in enumerate(results):
        assert [n for n, _ in layout] == [52, 112]  # [b2, w2]: 51 -> 52 | [b0, w0]: 112
        for n, (lo, hi) in layout:
            assert (lo, hi) == (rank * n // 4, (rank + 1) * n // 4)


def test_replaced_parameter_storage_is_reported():
    model = _mlp()
    ps = ParallelState.build()
    ddp = DistributedDataParallel(model, ps, ParallelConfig(use_distributed_optimizer=True))
    opt = build_optimizer(OptimizerConfig(lr=0.1), [ddp], ps)
    model[0].weight.data = model[0].weight.data.clone()  # e.g. a .to() after wrapping
    with pytest.raises(RuntimeError, match="no longer lives in its grad bucket"):
        opt.step()
