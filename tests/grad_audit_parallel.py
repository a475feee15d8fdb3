"""The gradient audit of tests/grad_audit.py across ranks: on a parallel layout, the
gradient the training step hands the optimizer is the derivative of the loss the step
reports. Every rank builds its shard as pretrain_gpt.py builds it (parse with the world
size, `initialize_distributed` inside the process group the caller made, `build_trainer`)
and runs the same step, `capture_update` taking the update's gradient; the loss is
differenced along one global direction d, as in one process (five points, fp32, the
generators re-seeded per evaluation as training seeds them, so that the dropout masks --
per-tp-rank streams inside the tensor-parallel regions, one stream outside -- repeat).

One global direction. d is drawn per local tensor from a generator seeded by the tensor's
global key: its virtual pipeline stage and name in the stage, plus the tensor-parallel
rank for a tensor split over tp (the shards' own draws make up the global direction).
Replicas share one key and so one d: tp-replicated tensors (norms, row-parallel biases,
position embeddings, routers) have no tp rank in theirs, the two copies of the tied word
embedding (first and last pipeline stage) have one key, data-parallel replicas are never
told apart. The scales s are per local tensor (replicas hold equal values, equal scales).

Each element counted once. A replicated tensor has n replicas, each with the gradient its
rank holds, which a correct step makes equal (the sequence-parallel all-reduce of norm
grads, the tied-embedding all-reduce, the data-parallel all-reduce). <g, d> is taken in K
views: view k takes every tensor's gradient from its replica k mod n (n divides K), so
each view counts every element once and every replica enters some view; the error is the
largest over the views and directions. n multiplies tp (a tp-replicated tensor), 2 (a
tied-embedding copy, pp > 1) and dp (without the distributed optimizer; with it a rank
holds the reduced gradient of its shard only -- zeros elsewhere -- and shards are
disjoint). Sums over ranks: one float64 all-reduce over the world per direction.

The loss is the step's: averaged over data-parallel replicas (each its own micro-batches)
and broadcast over the pipeline; the audit fails a layout whose ranks report different
losses. Under dp the gradient is the average of the replicas' gradients on their own
data, the derivative of that average. Expert choices must stay put on every rank (one
all-reduce per stencil point decides).

Measured on the CPU (gloo, fp32, eps 3e-2): every layout 3e-5 to 3e-4, the bound is
tests/grad_audit.TOLERANCE (3e-3). Deliberate breaks: the sequence-parallel norm/bias
all-reduce left out 5e-1; the tied-embedding all-reduce left out 5e-1 (pp2), 4e-1
(pp2-vp2), and under the distributed optimizer its rebuild over dp 2e-1; the dp average
left out 1.6; the column-parallel input-grad all-reduce left out 1.1; the
sequence-parallel reduce-scatter made a split 1.5; the vocabulary-parallel cross
entropy's backward subtracting the target on every rank 0.9; hidden dropout outside the
tensor-parallel region drawn from the per-rank stream (tp2 without SP: the replicas part)
0.55; the audit counting replicas once per rank instead of once 4e-2 to 2.2; the audit not
waiting for an overlapped parameter all-gather 0.4. Not seen, by design: attention dropout
drawn from one stream on every tp rank (correlated masks, no wrong gradient).

Legend: L the step's loss, g the gradient, d a direction, s the per-tensor scales, K views.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from tests.grad_audit import (
    BASE_FLAGS,
    DROPOUT,
    EPS,
    LLAMA,
    NO_DROPOUT,
    RECOMPUTE,
    TOLERANCE,
    AuditRow,
    _same_choices,
    _set_params,
    expert_choices,
    fp32_matmuls,
    step_loss_and_grads,
)

TP2 = ("--tensor-model-parallel-size", "2")
SP = ("--sequence-parallel",)
PP2 = ("--pipeline-model-parallel-size", "2")
DP_SHARDED = ("--use-distributed-optimizer",)
# 2 micro-batches of 2 at dp 1 (the pipeline schedules' steady state), one per replica at
# dp 2
GBS4 = ("--global-batch-size", "4")
VP2 = ("--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1")
# Losses the ranks report may differ by rounding in the reductions, no more.
LOSS_SPREAD = 1e-6


@dataclass(frozen=True)
class LayoutCase:
    """One layout: pretrain_gpt.py flags on tests/grad_audit.BASE_FLAGS, on `world_size`
    ranks."""

    name: str
    flags: Tuple[str, ...]
    world_size: int = 2
    directions: int = 2
    tolerance: float = TOLERANCE

    def argv(self) -> List[str]:
        return BASE_FLAGS + list(self.flags)


# The device's compile default (on with CUDA, off on the CPU) unless a case names one.
LAYOUTS: Tuple[LayoutCase, ...] = (
    LayoutCase("tp2", DROPOUT + TP2),
    LayoutCase("tp2-sp", DROPOUT + TP2 + SP),
    LayoutCase("tp2-sp/selective", DROPOUT + TP2 + SP + RECOMPUTE["selective"]),
    LayoutCase("tp2/full-uniform", DROPOUT + TP2 + RECOMPUTE["full-uniform"]),
    LayoutCase("tp2-sp/full-block", DROPOUT + TP2 + SP + RECOMPUTE["full-block"]),
    LayoutCase("tp2-sp/llama", DROPOUT + TP2 + SP + LLAMA + RECOMPUTE["selective"]),
    # Expert choices flip under small perturbations (tests/grad_audit.CASES). At seed
    # 1234 a token's two router logits are 6e-5 apart: every eps flips its choice. Seed
    # 1236, no dropout (masks differ between devices, so would the logits): 2e-2 apart
    # at the closest. (No expert parallelism: the parser refuses
    # --expert-model-parallel-size; the experts are split over tp like the dense MLP.)
    LayoutCase("tp2/moe-2-experts", NO_DROPOUT + TP2 + (
        "--num-experts", "2", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--seed", "1236"),
        directions=3, tolerance=1e-2),
    LayoutCase("pp2", DROPOUT + PP2 + GBS4),
    LayoutCase("pp2-vp2", DROPOUT + PP2 + GBS4 + VP2),
    LayoutCase("pp2/untied", DROPOUT + PP2 + GBS4 + ("--untie-embeddings-and-output-weights",)),
    LayoutCase("dp2", DROPOUT + GBS4),
    # the distributed optimizer's reduce-scatter and unscaling of a constant loss scale
    LayoutCase("dp2-distopt", DROPOUT + GBS4 + DP_SHARDED + ("--loss-scale", "4096")),
    LayoutCase("dp2-distopt/overlap", DROPOUT + GBS4 + DP_SHARDED + (
        "--overlap-grad-reduce", "--overlap-param-gather")),
    LayoutCase("tp2-sp/selective/compiled",
               DROPOUT + TP2 + SP + RECOMPUTE["selective"] + ("--compile",)),
    LayoutCase("tp2-sp-pp2-vp2", DROPOUT + TP2 + SP + PP2 + GBS4 + VP2, world_size=4),
    LayoutCase("pp2-dp2-distopt", DROPOUT + PP2 + ("--global-batch-size", "8") + DP_SHARDED,
               world_size=4),
    LayoutCase("tp2-sp-dp2-distopt", DROPOUT + TP2 + SP + GBS4 + DP_SHARDED, world_size=4),
)


# --quick of benchmarks/grad_audit.py --layouts: tensor, sequence, pipeline (interleaved,
# tied) and data parallelism (sharded), recompute with dropout, a switch MLP; 4 ranks once
LAYOUT_QUICK = ("tp2-sp/selective", "tp2/full-uniform", "tp2/moe-2-experts", "pp2-vp2",
                "dp2-distopt", "tp2-sp-pp2-vp2")


def layout(name: str) -> LayoutCase:
    return next(c for c in LAYOUTS if c.name == name)


# --------------------------------------------------------------------------- building
def build_layout_trainer(argv: Sequence[str], device: torch.device):
    """(config, runtime, trainer) of this rank, built as pretrain_gpt.py builds it, in
    the process group the caller made (gloo, or NCCL on `device`), validated for the
    device (compile on by default with CUDA)."""
    from tests.gpt_helpers import cli_trainer

    return cli_trainer(argv, dist.get_world_size(), dist.get_rank(),
                       cuda_available=device.type == "cuda")


def layout_micro_batches(cfg, rt) -> List[dict]:
    """This rank's micro-batches of the first step (none on a middle pipeline stage)."""
    from megatron.training import data_iterator

    data = data_iterator(cfg, rt, "train", 0)
    return [] if data is None else [next(data) for _ in range(cfg.data.num_micro_batches)]


@dataclass
class Held:
    """What this rank holds of one global tensor: `key` seeds its direction; it is
    replica `replica` of `replicas` (see the module doc)."""

    param: torch.nn.Parameter
    key: str
    replicas: int
    replica: int


def held_tensors(tr) -> Tuple[List[Held], int]:
    """This rank's trainable tensors with their keys and replica numbers, and K (the
    number of views: every tensor's replica count divides it)."""
    from megatron.core.models.gpt.stages import tied_embedding_weights
    from megatron.train_step import model_chunks

    ps, chunks = tr.rt.ps, model_chunks(tr)
    tied = {id(w) for w in tied_embedding_weights(chunks, ps)}
    sharded_dp = tr.config.parallel.use_distributed_optimizer
    n_dp, r_dp = (1, 0) if sharded_dp else (ps.dp_size, ps.dp_rank)
    held = []
    for c, chunk in enumerate(chunks):
        stage = c * ps.pp_size + ps.pp_rank
        for name, p in getattr(chunk, "module", chunk).named_parameters():
            if not p.requires_grad:
                continue
            key, n_tie, r_tie = f"stage{stage}/{name}", 1, 0
            if id(p) in tied:
                key, n_tie, r_tie = "tied-word-embedding", 2, 0 if ps.is_first_stage else 1
            n_tp, r_tp = ps.tp_size, ps.tp_rank
            if getattr(p, "tensor_model_parallel", False):
                key, n_tp, r_tp = f"{key}/tp{ps.tp_rank}", 1, 0
            held.append(Held(p, key, n_tp * n_tie * n_dp,
                             r_tp + n_tp * (r_tie + n_tie * r_dp)))
    views = ps.tp_size * (2 if ps.pp_size > 1 else 1) * n_dp
    return held, views


# --------------------------------------------------------------------------- the check
def _direction(h: Held, index: int, seed: int, scale: float) -> torch.Tensor:
    key = zlib.crc32(f"{seed}/{index}/{h.key}".encode())
    gen = torch.Generator().manual_seed(key)
    return (torch.randn(h.param.shape, generator=gen) * scale).to(h.param.device)


def _view_sums(held: List[Held], views: int, per_tensor: List[float],
               device: torch.device) -> List[float]:
    """Per view k: the sum over the world of `per_tensor` (one value per held tensor),
    each tensor counted from its replica k mod n. Collective (all-reduce over the world)."""
    local = torch.zeros(views, dtype=torch.float64)
    for h, v in zip(held, per_tensor):
        for k in range(h.replica, views, h.replicas):
            local[k] += v
    local = local.to(device)
    dist.all_reduce(local)
    return local.tolist()


def _all_agree(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() == 1.0)


def _loss_spread(loss: float, device: torch.device) -> float:
    """The largest difference between the losses the ranks report, over |loss|."""
    t = torch.tensor([loss, -loss], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0] + t[1]) / max(abs(loss), 1e-30)


def _difference(cfg, rt, tr, batches, params, theta, d, eps, choices0) -> Optional[float]:
    """tests/grad_audit._difference with the expert choices agreed by every rank."""
    losses = {}
    for k in (-2, -1, 1, 2):
        _set_params(params, theta, d, k * eps)
        with expert_choices(tr.model) as choices:
            losses[k] = step_loss_and_grads(cfg, rt, tr, batches)[0]
        if not _all_agree(_same_choices(choices, choices0), rt.device):
            return None
    return (8 * (losses[1] - losses[-1]) - (losses[2] - losses[-2])) / (12 * eps)


@dataclass
class LayoutResult:
    loss: float
    loss_spread: float  # of the ranks' losses, relative
    error: float  # the largest over views and directions (inf: no direction usable)
    views: int
    slopes: List[Tuple[float, float, List[float]]]  # per direction: (eps, fd, <g, d> per view)
    skipped: int = 0


def layout_directional_error(cfg, rt, tr, batches, eps: float = EPS, count: int = 2,
                             seed: int = 0) -> LayoutResult:
    """The step's gradient against five-point differences of its loss along `count`
    global directions, on every rank of the layout alike (collective); the parameters
    end as they started."""
    held, views = held_tensors(tr)
    params = [h.param for h in held]
    step_loss_and_grads(cfg, rt, tr, batches)  # warm-up: compile, settle the loss scale
    with expert_choices(tr.model) as choices0:
        loss, grads = step_loss_and_grads(cfg, rt, tr, batches)
    g = [grads.get(p, torch.zeros_like(p, dtype=torch.float32)) for p in params]
    scales = [max(p.detach().float().square().mean().sqrt().item(), 0.02) for p in params]
    sizes = _view_sums(held, views, [s * s * float(x.double().square().sum())
                                     for s, x in zip(scales, g)], rt.device)
    theta = [p.detach().clone() for p in params]
    res = LayoutResult(loss, _loss_spread(loss, rt.device), 0.0, views, [])
    try:
        for i in range(count):
            d = [_direction(h, i, seed, s) for h, s in zip(held, scales)]
            gd = _view_sums(held, views, [float((x.double() * y.double()).sum())
                                          for x, y in zip(g, d)], rt.device)
            for h in (eps, eps / 3, eps / 10, eps / 30):
                fd = _difference(cfg, rt, tr, batches, params, theta, d, h, choices0)
                if fd is not None:
                    res.slopes.append((h, fd, gd))
                    res.error = max([res.error] + [abs(fd - v) / max(math.sqrt(n), 1e-30)
                                                   for v, n in zip(gd, sizes)])
                    break
            else:
                res.skipped += 1
    finally:
        _set_params(params, theta, theta, 0.0)
    if not res.slopes:
        res.error = math.inf
    return res


def audit_layout(case: LayoutCase, device: torch.device, eps: float = EPS) -> AuditRow:
    """Build this rank's shard of the layout on `device` and run the check; every rank
    returns the same row (collective). TF32 off, dynamo's caches reset first."""
    if dist.get_world_size() != case.world_size:
        raise ValueError(f"{case.name} needs {case.world_size} ranks, not "
                         f"{dist.get_world_size()}")
    torch._dynamo.reset()
    with fp32_matmuls():
        cfg, rt, tr = build_layout_trainer(case.argv(), device)
        res = layout_directional_error(cfg, rt, tr, layout_micro_batches(cfg, rt), eps,
                                       case.directions)
    error = torch.tensor([res.error], dtype=torch.float64, device=rt.device)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)  # the same on every rank: a guard
    ok = error.item() <= case.tolerance and res.loss_spread <= LOSS_SPREAD
    slopes = ", ".join(f"{fd:.4g}/" + "|".join(f"{v:.4g}" for v in gd)
                       + (f" (eps {h:.0e})" if h != eps else "") for h, fd, gd in res.slopes)
    spread = (f", the ranks' losses differ by {res.loss_spread:.1e}"
              if res.loss_spread > LOSS_SPREAD else "")
    skipped = f", {res.skipped} skipped (expert choices)" if res.skipped else ""
    views = f"{res.views} view" + ("s" if res.views > 1 else "")
    return AuditRow(case.name, views, error.item(), ok,
                    f"loss {res.loss:.4f}, fd/<g,d> {slopes}{spread}{skipped}")


def audit_layouts(rank: int, world_size: int, names: Sequence[str],
                  device_type: str = "cpu") -> List[AuditRow]:
    """Every named layout (all for `world_size` ranks) in this process group, one after
    the other; the rows (the same on every rank). For run_distributed and the ranks of
    benchmarks/grad_audit.py --layouts."""
    device = torch.device(device_type)
    return [audit_layout(layout(n), device) for n in names]
