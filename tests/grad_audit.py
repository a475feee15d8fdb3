"""The gradient audit: the gradient a training step hands the optimizer is the derivative
of the loss that step reports.

A model is built from pretrain_gpt.py flags as the entry point builds it (parse, validate,
seed, `build_trainer`: the DDP wrapper with its grad buffers, the optimizer wrapper). One
step runs as `train_step` runs it -- its micro-batches, the schedule's forward/backward
(each micro-batch loss / num_micro), the gradient reductions, the optimizer's reading of
the gradients (main grads, unscaled by any loss scale) -- except that the update itself
(the inner torch optimizer's step, or the Triton AdamW kernel) is replaced by a copy of
the gradients it would have read (`capture_update`). g is that copy, per model parameter.

`directional_error`: along fixed random directions d over all parameters, the slope <g, d>
against a five-point central difference of the step's reported loss L (the mean of the
micro-batch losses) at theta + k eps d, k = -2, -1, 1, 2. Every evaluation reseeds the
generators as training seeds them (`set_random_seed`: the default generators and the
model-parallel tracker), so dropout draws the same masks at every point. d is Gaussian,
scaled per tensor by the tensor's RMS (at least 0.02: biases start at 0), so that eps is
a relative perturbation of every tensor. The error is |fd - <g, d>| over
||g * s|| (s: those scales), the RMS of <g, d> over such directions, so a direction along
which the loss happens to be flat does not inflate it. Everything in fp32 (TF32 off).

Measured (tiny models, eps 3e-2): correct configurations 6e-5 to 2e-4 on CPU; deliberate
breaks 5e-2 to 6e-1 -- a recompute that draws other dropout masks, a cross-entropy or
rotary backward off, micro-batch losses not divided, a loss scale left in the gradient.
On an H100 it found compiled selective recompute with attention dropout wrong (error 2.5;
fixed in ParallelAttention._recompute_core); benchmarks/grad_audit.py runs the matrix.

`precision_error`: with --bf16 or --fp16 the loss cannot be differenced finely enough in
16-bit math, so the mixed-precision step's gradient (fp32 main grads, unscaled) is
compared with the fp32 step's on the same weights and data at dropout 0: cosine
similarity and norm ratio (a scale left in the gradient shows in the ratio only).

Legend: L the step's loss, g the step's gradient, d a direction, s the per-tensor scales.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# A tiny GPT-2-like model (learned positions, LayerNorm, GeLU, biases), one micro-batch,
# no clipping (a clipped gradient is not the derivative). Init std 0.05, not 0.02: sharper
# attention makes the query/key paths matter to the loss (a rotary backward with the wrong
# sign: error 3e-3 at 0.02, 5e-2 at 0.05). No whole-step CUDA graph: a replayed step runs
# no Python, so its update could not be replaced by a copy.
BASE_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
    "--train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
    "--clip-grad 0 --log-interval 1 --seed 1234 --cuda-graph-step off "
    "--init-method-std 0.05").split()
DROPOUT = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
EPS = 3e-2
# Directional error: correct steps measure 6e-5 to 2e-4 on CPU, 4e-5 to 9e-4 on an H100
# (the largest: the switch MLP at eps 1e-3); the smallest break seen (a rotary backward
# with the wrong sign) 5e-2.
TOLERANCE = 3e-3
# 16-bit against fp32, the larger of 1 - cosine and |norm ratio - 1|: bf16 measures 2e-4
# on CPU and 7e-5 on an H100, fp16 below 3e-5; a loss scale left in or applied twice >= 1.
PRECISION_TOLERANCE = 5e-2


@dataclass(frozen=True)
class AuditCase:
    """One row of the matrix: extra flags on BASE_FLAGS; `precision`: a 16-bit case,
    checked against fp32 (`precision_error`) instead of by differences."""

    name: str
    flags: Tuple[str, ...]
    precision: bool = False
    directions: int = 2
    tolerance: float = TOLERANCE

    def argv(self) -> List[str]:
        return BASE_FLAGS + list(self.flags)


RECOMPUTE = {
    "none": (),
    "selective": ("--recompute-activations",),
    "full-uniform": ("--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"),
    "full-block": ("--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "1"),
}
LLAMA = ("--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights")


def _grid() -> List[AuditCase]:
    cases = []
    for compiled in ("eager", "compiled"):
        flag = "--compile" if compiled == "compiled" else "--no-compile"
        for name, flags in RECOMPUTE.items():
            cases.append(AuditCase(f"gpt2/{compiled}/{name}", DROPOUT + (flag,) + flags))
    for name in ("none", "selective"):  # full recompute refuses the block scope
        cases.append(AuditCase(f"gpt2/compiled-block/{name}",
                               DROPOUT + ("--compile", "--compile-scope", "block")
                               + RECOMPUTE[name]))
    return cases


# The features beyond the GPT-2 grid run with the device's default compile setting (on
# with CUDA, off on CPU), as a run without --compile/--no-compile would.
CASES: Tuple[AuditCase, ...] = tuple(_grid()) + (
    AuditCase("llama/selective", DROPOUT + LLAMA + RECOMPUTE["selective"]),
    # Expert choices flip under small perturbations: one sequence a step (fewer tokens to
    # flip), three directions, and a looser bound for the smaller eps that some may need
    # (1.3e-3 at eps 1e-3 with two sequences).
    AuditCase("moe-2-experts", DROPOUT + ("--num-experts", "2", "--micro-batch-size", "1",
                                          "--global-batch-size", "1"),
              directions=3, tolerance=1e-2),
    AuditCase("post-layernorm", DROPOUT + ("--apply-residual-connection-post-layernorm",)),
    AuditCase("2-micro-batches/selective",
              DROPOUT + ("--global-batch-size", "4") + RECOMPUTE["selective"]),
    # fp32 with a constant loss scale: the distributed optimizer (dp 1) scales the loss
    # and unscales the grads, checked in fp32 math
    AuditCase("distopt/loss-scale-4096",
              DROPOUT + ("--use-distributed-optimizer", "--loss-scale", "4096")),
    AuditCase("bf16", NO_DROPOUT + ("--bf16",), precision=True),
    AuditCase("fp16/dynamic-scale", NO_DROPOUT + ("--fp16", "--initial-loss-scale", "65536"),
              precision=True),
)
# --quick: one of each kind; on CPU the compiled one costs most of the time
QUICK = ("gpt2/eager/none", "gpt2/eager/selective", "gpt2/compiled/selective",
         "llama/selective", "moe-2-experts", "2-micro-batches/selective",
         "distopt/loss-scale-4096", "bf16", "fp16/dynamic-scale")


def case(name: str) -> AuditCase:
    return next(c for c in CASES if c.name == name)


# --------------------------------------------------------------------------- building
def build_audit_trainer(argv: Sequence[str], device: torch.device):
    """(config, runtime, trainer) for one process on `device`, built as pretrain_gpt.py
    builds it (tests/gpt_helpers.cli_trainer on the default device; on another, its
    Runtime by hand), validated for that device (compile on by default with CUDA)."""
    from megatron.arguments import parse_and_validate
    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel.random import RNGStatesTracker
    from megatron.initialize import Runtime, set_random_seed
    from megatron.training import build_trainer
    from tests.gpt_helpers import cli_trainer

    cuda = device.type == "cuda"
    if cuda == torch.cuda.is_available():
        return cli_trainer(argv, cuda_available=cuda)
    cfg = parse_and_validate(list(argv), world_size=1, env={"RANK": "0"}, cuda_available=cuda)
    rt = Runtime(ps=ParallelState.build(), device=device,
                 rng_tracker=RNGStatesTracker(device.type), backend="nccl" if cuda else "gloo")
    set_random_seed(cfg.training.seed, rt)
    return cfg, rt, build_trainer(cfg, rt)


def step_micro_batches(cfg, rt) -> List[dict]:
    """The first step's micro-batches from the run's train data, read once so that every
    evaluation sees the same ones."""
    from megatron.training import data_iterator

    data = data_iterator(cfg, rt, "train", 0)
    return [next(data) for _ in range(cfg.data.num_micro_batches)]


@contextlib.contextmanager
def fp32_matmuls():
    """TF32 off (CUDA matmuls, inductor's included, and cuDNN), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# --------------------------------------------------------------------------- the step
def _model_param_of(opt) -> Dict[torch.Tensor, Tuple[torch.Tensor, Optional[int]]]:
    """The optimizer's stepped parameter -> (the model parameter it stands for, where its
    elements start in that parameter's flat view, or None for the whole of it): itself
    (fp32), the 16-bit model parameter of an fp32 main copy, or the model parameter of a
    distributed-optimizer shard (with dp > 1 often a part of it)."""
    shards = getattr(opt, "shards", None)
    if shards is not None:
        out = {}
        for shard in shards:
            lo = shard.bucket.shard_range[0]
            for e in shard.entries:
                start = shard.bucket.param_ranges[e.param][0]
                whole = e.main.numel() == e.param.numel()
                out[e.main] = (e.param, None if whole else e.start + lo - start)
        return out
    pairs = getattr(opt, "_model_main_pairs", None)
    out = {main: model for model, main in pairs()} if pairs is not None else {}
    return {p: (out.get(p, p), None) for p in opt.get_parameters()}


@contextlib.contextmanager
def capture_update(opt):
    """Within: the optimizer's update copies the gradients it would apply instead, into
    the dict yielded (model parameter -> fp32 gradient, divided by the scale the update
    would divide by; with the distributed optimizer at dp > 1, zeros outside this rank's
    shard). Covers torch's step (reads `param.grad` of the stepped parameters)
    and the Triton AdamW kernel (reads the grad buffers, divides by the loss scale)."""
    model_of, grads = _model_param_of(opt), {}
    inner, multi = opt.optimizer, opt._multi_tensor()

    def keep(param, grad, scale):
        g = torch.zeros_like(param, dtype=torch.float32) if grad is None else grad.float()
        if scale is not None:
            g = g / scale
        model, offset = model_of[param]
        if offset is None:
            grads[model] = g.detach().clone().view(model.shape)
            return
        whole = grads.setdefault(model, torch.zeros_like(model, dtype=torch.float32))
        whole.view(-1)[offset:offset + g.numel()] = g.detach().reshape(-1)

    def torch_step(closure=None):
        for group in inner.param_groups:
            for p in group["params"]:
                keep(p, p.grad, getattr(inner, "grad_scale", None))

    def kernel_step(grad_scale=None, skip=None):
        given = multi._grads() if multi._grads is not None else None
        for i, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                keep(p, given[i][j] if given is not None else p.grad, grad_scale)
        return True

    inner.step = torch_step
    if multi is not None:
        multi.step = kernel_step
    try:
        yield grads
    finally:
        del inner.step
        if multi is not None:
            del multi.step


def _finish_param_sync(tr) -> None:
    """Wait for the distributed optimizer's parameter all-gather of the step when it is
    left in flight for the next forward (--overlap-param-gather): else it lands after
    the audit has set the next point's parameters, and writes the last point's back."""
    from megatron.train_step import model_chunks

    for chunk in model_chunks(tr):
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()


def step_loss_and_grads(cfg, rt, tr, batches, max_tries: int = 40
                        ) -> Tuple[float, Dict[torch.Tensor, torch.Tensor]]:
    """(the loss `train_step` reports, the gradient its update would apply), the
    generators seeded as training seeds them. A step whose update is skipped (fp16
    overflow: the dynamic scale backs off) is run again, up to `max_tries` times."""
    from megatron.initialize import set_random_seed
    from megatron.training import train_step

    for _ in range(max_tries):
        set_random_seed(cfg.training.seed, rt)
        with capture_update(tr.optimizer) as grads:
            loss, ok, _, _ = train_step(tr, iter(batches))
        _finish_param_sync(tr)
        if ok and grads:
            return float(loss), grads
    raise RuntimeError(f"no step of {max_tries} reached the update (loss scale overflow)")


# --------------------------------------------------------------------------- the checks
def _directions(params: List[torch.Tensor], count: int, seed: int):
    """`count` directions (per parameter, on its device) and the per-tensor scales s."""
    gen = torch.Generator().manual_seed(seed)
    scales = [max(p.detach().float().square().mean().sqrt().item(), 0.02) for p in params]
    dirs = [[(torch.randn(p.shape, generator=gen) * s).to(p.device) for p, s in
             zip(params, scales)] for _ in range(count)]
    return dirs, scales


@torch.no_grad()
def _set_params(params, theta, d, step: float) -> None:
    for p, t, x in zip(params, theta, d):
        p.copy_(t + step * x)


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return math.fsum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))


@contextlib.contextmanager
def expert_choices(model):
    """Within: the list yielded collects every switch MLP's top-1 expert choices, call by
    call. Where a choice changes, the loss jumps (another smooth piece): no difference
    quotient may straddle that."""
    from megatron.core.models.gpt.transformer import SwitchMLP

    choices: List[torch.Tensor] = []
    hooks = [m.router.register_forward_hook(
        lambda mod, args, out: choices.append(out.detach().argmax(-1)))
        for m in model.modules() if isinstance(m, SwitchMLP)]
    try:
        yield choices
    finally:
        for h in hooks:
            h.remove()


def _same_choices(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@dataclass
class DirectionalResult:
    loss: float
    error: float  # the largest over the directions used (inf: none could be used)
    slopes: List[Tuple[float, float, float]]  # per direction used: (eps, difference, <g, d>)
    skipped: int = 0  # directions along which every eps changed an expert choice


def _difference(cfg, rt, tr, batches, params, theta, d, eps, choices0) -> Optional[float]:
    """The five-point difference quotient of the step's loss along d at eps, or None
    when one of its points makes another expert choice than theta does."""
    losses = {}
    for k in (-2, -1, 1, 2):
        _set_params(params, theta, d, k * eps)
        with expert_choices(tr.model) as choices:
            losses[k] = step_loss_and_grads(cfg, rt, tr, batches)[0]
        if not _same_choices(choices, choices0):
            return None
    return (8 * (losses[1] - losses[-1]) - (losses[2] - losses[-2])) / (12 * eps)


def directional_error(cfg, rt, tr, batches, eps: float = EPS, count: int = 2,
                      seed: int = 0) -> DirectionalResult:
    """The step's gradient against five-point differences of its loss along `count`
    random directions (see the module doc). Along a direction where a point of the
    stencil changes an expert choice, eps / 3, / 10, / 30 are tried before it is skipped.
    The parameters end as they started."""
    params = [p for p in tr.model.parameters() if p.requires_grad]
    step_loss_and_grads(cfg, rt, tr, batches)  # warm-up: compile, settle the loss scale
    with expert_choices(tr.model) as choices0:
        loss, grads = step_loss_and_grads(cfg, rt, tr, batches)
    g = [grads.get(p, torch.zeros_like(p, dtype=torch.float32)) for p in params]
    dirs, scales = _directions(params, count, seed)
    size = math.sqrt(math.fsum(s * s * float(x.double().square().sum())
                               for s, x in zip(scales, g)))
    theta = [p.detach().clone() for p in params]
    result = DirectionalResult(loss, 0.0, [])
    try:
        for d in dirs:
            for h in (eps, eps / 3, eps / 10, eps / 30):
                fd = _difference(cfg, rt, tr, batches, params, theta, d, h, choices0)
                if fd is not None:
                    gd = _dot(g, d)
                    result.slopes.append((h, fd, gd))
                    result.error = max(result.error, abs(fd - gd) / max(size, 1e-30))
                    break
            else:
                result.skipped += 1
    finally:
        _set_params(params, theta, theta, 0.0)  # theta + 0 theta: theta exactly
    if not result.slopes:
        result.error = math.inf
    return result


def precision_error(case_: AuditCase, device: torch.device) -> Tuple[float, float, float]:
    """(1 - cosine, |norm ratio - 1|, loss scale) of the 16-bit step's gradient against
    the fp32 step's, same weights (the fp32 model's, copied in) and data, dropout 0.
    The ratio is what a wrongly unscaled gradient changes; the cosine cannot see it."""
    argv = case_.argv()
    cfg32, rt32, tr32 = build_audit_trainer(
        [a for a in argv if a not in ("--bf16", "--fp16")], device)
    batches = step_micro_batches(cfg32, rt32)
    _, ref = step_loss_and_grads(cfg32, rt32, tr32, batches)
    cfg, rt, tr = build_audit_trainer(argv, device)
    with torch.no_grad():
        for p, q in zip(tr.model.parameters(), tr32.model.parameters()):
            assert p.shape == q.shape
            p.copy_(q)
    tr.optimizer.reload_model_params()
    step_loss_and_grads(cfg, rt, tr, batches)  # warm-up, as for the fp32 checks
    _, grads = step_loss_and_grads(cfg, rt, tr, batches)
    pairs = list(zip(tr.model.parameters(), tr32.model.parameters()))
    a = [grads[p] for p, _ in pairs]
    b = [ref[q] for _, q in pairs]
    na, nb = math.sqrt(_dot(a, a)), math.sqrt(_dot(b, b))
    cosine = _dot(a, b) / max(na * nb, 1e-30)
    return 1.0 - cosine, abs(na / max(nb, 1e-30) - 1.0), float(tr.optimizer.get_loss_scale())


@dataclass
class AuditRow:
    name: str
    check: str
    error: float
    ok: bool
    detail: str = ""


def audit_case(case_: AuditCase, device: torch.device, eps: float = EPS) -> AuditRow:
    """Build the case's model on `device` and run its check (fp32: directional; 16-bit:
    against fp32). TF32 off, dynamo's caches reset first."""
    torch._dynamo.reset()
    with fp32_matmuls():
        if case_.precision:
            one_minus_cos, norm_dev, scale = precision_error(case_, device)
            error = max(one_minus_cos, norm_dev)
            return AuditRow(case_.name, "vs fp32", error, error <= PRECISION_TOLERANCE,
                            f"1-cos {one_minus_cos:.1e}, norm ratio off by {norm_dev:.1e}, "
                            f"loss scale {scale:g}")
        cfg, rt, tr = build_audit_trainer(case_.argv(), device)
        res = directional_error(cfg, rt, tr, step_micro_batches(cfg, rt), eps,
                                case_.directions)
    slopes = ", ".join(f"{fd:.4g}/{gd:.4g}" + (f" (eps {h:.0e})" if h != eps else "")
                       for h, fd, gd in res.slopes)
    skipped = f", {res.skipped} skipped (expert choices)" if res.skipped else ""
    return AuditRow(case_.name, "directional", res.error, res.error <= case_.tolerance,
                    f"loss {res.loss:.4f}, fd/<g,d> {slopes}{skipped}")
