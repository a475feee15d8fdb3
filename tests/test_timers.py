"""Megatron's level-1 and level-2 timers beyond forward-backward and the gradient
reductions (`--timing-log-level`, megatron/core/timing.py):

* the optimizer's phases (optimizer-copy-to-main-grad, -unscale-and-check-inf,
  -clip-main-grad, -count-zeros, -inner-step, -copy-main-to-model-params), each timed only
  when it runs, on torch's path and on the Triton kernel's;
* params-all-gather and grads-reduce-scatter with the distributed optimizer;
* the pipeline transfers at level 2, each batch named after the Megatron p2p function
  doing the same exchange (forward-send-backward-recv, ...), for 1F1B and interleaved;
* the timer block in Megatron's order and the `<timer>-time` TensorBoard scalars;
* level 0: core code gets no hook (so it calls no timer) and no block follows the
  iteration lines.
"""
from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

import megatron.train_step as train_step_module
import megatron.training as training
from megatron.arguments import parse_and_validate
from megatron.core.config import OptimizerConfig, ParallelConfig
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import build_optimizer, multi_tensor_adam
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.p2p import timer_name
from megatron.core.pipeline_parallel.schedules import (
    COMM,
    P2P,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    build_schedule,
)
from megatron.initialize import initialize_distributed, set_random_seed
from megatron.logging_utils import Timer, read_scalars
from megatron.train_step import OPTIMIZER_TIMER_NAMES, P2P_TIMER_NAMES, TIMER_NAMES, StepLog
from tests.dist_utils import run_distributed

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
    "--tokenizer-type NullTokenizer --vocab-size 256 --eval-iters 0 --mock-data "
    "--num-workers 0 --use-cpu-initialization --train-iters 2 --log-interval 2"
).split()
LEVEL_2_COMPUTE = ("forward-compute", "backward-compute", "batch-generator")


def _pretrain(rank: int, world: int, argv: list, tb=None) -> str:
    """stdout of one pretrain() run (inside run_distributed the process group exists)."""
    extra = [] if tb is None else ["--tensorboard-dir", str(tb), "--log-timers-to-tensorboard"]
    cfg = parse_and_validate(BASE + list(argv) + extra, world_size=world,
                             env={"RANK": str(rank)}, cuda_available=False)
    rt = initialize_distributed(cfg.parallel, rank, world, 0)
    set_random_seed(cfg.training.seed, rt)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        training.pretrain(cfg, rt)
    return buf.getvalue()


_ROW = re.compile(r"^    (\S+) \.*: \((\d+\.\d\d), (\d+\.\d\d)\)$")


def _step_blocks(out: str) -> list:
    """The minmax timer blocks printed after iteration lines: [[(name, min, max)], ...]."""
    blocks, lines = [], out.splitlines()
    after_iteration = False
    for i, line in enumerate(lines):
        if line.startswith(" iteration "):
            after_iteration = True
        elif line == "(min, max) time across ranks (ms):" and after_iteration:
            rows = []
            for row in lines[i + 1:]:
                m = _ROW.match(row)
                if m is None:
                    break
                rows.append((m[1], float(m[2]), float(m[3])))
            blocks.append(rows)
            after_iteration = False
    return blocks


def _names(out: str) -> list:
    blocks = _step_blocks(out)
    assert len(blocks) == 1, out[-3000:]
    for name, lo, hi in blocks[0]:
        assert 0.0 <= lo <= hi, (name, lo, hi)
    return [name for name, _, _ in blocks[0]]


# --------------------------------------------------------------------------- p2p names
def test_p2p_batches_are_named_after_megatrons_p2p_functions():
    def ops(*kinds):
        return [P2P(k, 0, 0, 1) for k in kinds]

    assert timer_name(ops(RECV_FORWARD)) == "forward-recv"
    assert timer_name(ops(SEND_FORWARD)) == "forward-send"
    assert timer_name(ops(RECV_BACKWARD)) == "backward-recv"
    assert timer_name(ops(SEND_BACKWARD)) == "backward-send"
    assert timer_name(ops(SEND_FORWARD, RECV_FORWARD)) == "forward-send-forward-recv"
    assert timer_name(ops(RECV_BACKWARD, SEND_FORWARD)) == "forward-send-backward-recv"
    assert timer_name(ops(SEND_BACKWARD, RECV_FORWARD)) == "backward-send-forward-recv"
    assert timer_name(ops(SEND_BACKWARD, RECV_BACKWARD)) == "backward-send-backward-recv"
    assert timer_name(ops(SEND_FORWARD, SEND_FORWARD)) == "forward-send"  # two chunks
    both = "forward-backward-send-forward-backward-recv"
    assert timer_name(ops(SEND_FORWARD, SEND_BACKWARD, RECV_FORWARD, RECV_BACKWARD)) == both
    assert timer_name(ops(SEND_FORWARD, RECV_FORWARD, RECV_BACKWARD)) == both
    assert timer_name(ops(RECV_FORWARD, RECV_BACKWARD)) == both
    assert set(P2P_TIMER_NAMES) == {timer_name(ops(*k)) for k in [
        (RECV_FORWARD,), (SEND_FORWARD,), (RECV_BACKWARD,), (SEND_BACKWARD,),
        (SEND_FORWARD, RECV_FORWARD), (SEND_FORWARD, RECV_BACKWARD),
        (SEND_BACKWARD, RECV_FORWARD), (SEND_BACKWARD, RECV_BACKWARD),
        (RECV_FORWARD, RECV_BACKWARD)]}


def _plan_timers(pp: int, m: int, vpp: int = 1) -> list:
    return [{timer_name(a.ops) for a in plan if a.kind == COMM}
            for plan in build_schedule(pp, m, vpp)]


def test_1f1b_plans_use_megatrons_names():
    """pp = 2: exactly Megatron's 1F1B calls (first stage: forward-send in the warm-up,
    forward-send-backward-recv in the steady state, backward-recv in the cool-down; last
    stage: forward-recv, backward-send-forward-recv, backward-send). A middle stage
    combines a warm-up send with the next receive in one batch (Megatron makes two
    calls there): forward-send-forward-recv, and backward-send-backward-recv in the
    cool-down, the names Megatron gives those exchanges in its interleaved schedule."""
    assert _plan_timers(2, 4) == [
        {"forward-send", "forward-send-backward-recv", "backward-recv"},
        {"forward-recv", "backward-send-forward-recv", "backward-send"}]
    middle = _plan_timers(4, 8)[1]
    assert middle == {"forward-recv", "forward-send-forward-recv", "forward-send-backward-recv",
                      "backward-send-forward-recv", "backward-send-backward-recv",
                      "backward-send"}
    interleaved = set().union(*_plan_timers(2, 4, vpp=2))
    assert "forward-backward-send-forward-backward-recv" in interleaved


# --------------------------------------------------------------------------- optimizer
class _Recorder:
    """A timer hook that records the timers started, and checks that each is stopped
    before the next one starts (the phases do not nest)."""

    def __init__(self) -> None:
        self.names, self.running = [], None

    def __call__(self, name: str, level: int):
        recorder = self
        assert level == 1, (name, level)

        class _Timer:
            def start(self):
                assert recorder.running is None, (recorder.running, name)
                recorder.names.append(name)
                recorder.running = name

            def stop(self):
                assert recorder.running == name, (recorder.running, name)
                recorder.running = None

        return _Timer()

    def started(self) -> list:
        assert self.running is None, f"{self.running} was never stopped"
        return self.names


def _linear_step(dtype, timers, inf=False, **optim):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(dtype)
    config = OptimizerConfig(lr=1e-2, fp16=dtype == torch.float16,
                             bf16=dtype == torch.bfloat16, initial_loss_scale=256.0, **optim)
    opt = build_optimizer(config, [model], ParallelState.build())
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(dtype)
    if inf:
        model.weight.grad[0, 0] = float("inf")
    return opt.step(timers=timers)


@pytest.mark.parametrize("dtype,optim,inf,expected", [
    (torch.float32, dict(clip_grad=1.0), False,
     ["copy-to-main-grad", "clip-main-grad", "inner-step"]),
    (torch.float32, dict(clip_grad=0.0), False, ["copy-to-main-grad", "inner-step"]),
    (torch.bfloat16, dict(clip_grad=1.0, log_num_zeros_in_grad=True), False,
     ["copy-to-main-grad", "count-zeros", "clip-main-grad", "inner-step",
      "copy-main-to-model-params"]),
    (torch.float16, dict(clip_grad=1.0, log_num_zeros_in_grad=True), False,
     ["copy-to-main-grad", "unscale-and-check-inf", "count-zeros", "clip-main-grad",
      "inner-step", "copy-main-to-model-params"]),
    (torch.float16, dict(clip_grad=1.0), True, ["copy-to-main-grad", "unscale-and-check-inf"]),
], ids=["fp32", "fp32-no-clip", "bf16-zeros", "fp16-zeros", "fp16-overflow"])
def test_optimizer_times_the_phases_that_run(dtype, optim, inf, expected):
    """Level-1 timers, stopped after each phase; the overflow step stops after the check."""
    recorder = _Recorder()
    ok, _, _ = _linear_step(dtype, recorder, inf=inf, **optim)
    assert ok == (not inf)
    assert recorder.started() == ["optimizer-" + n for n in expected]
    assert _linear_step(dtype, None, inf=inf, **optim)[0] == (not inf)  # untimed: the same


@pytest.fixture
def interpret(triton_interpreter, monkeypatch):
    """The Triton AdamW kernel on CPU tensors, in Triton's interpreter."""
    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", True)


def test_kernel_step_times_its_phases_and_the_gather(interpret):
    """The distributed optimizer's Triton step (fp16, dp = 1): nothing is copied, so no
    copy phase; the norm is the overflow check; the gather follows a kept step only."""
    ps = ParallelState.build()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).half()
    ddp = DistributedDataParallel(model, ps, ParallelConfig(use_distributed_optimizer=True))
    opt = build_optimizer(OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=256.0,
                                          clip_grad=1.0, log_num_zeros_in_grad=True,
                                          adam_kernel="triton"), [ddp], ps)
    for inf in (False, True):
        for p in model.parameters():
            p.main_grad.copy_(torch.randn(p.shape))
        if inf:
            model[0].weight.main_grad.view(-1)[3] = float("inf")
        ddp.finish_grad_sync()
        recorder = _Recorder()
        ok, _, _ = opt.step(timers=recorder)
        assert opt._multi, "the kernel did not step"
        assert ok == (not inf)
        phases = ["optimizer-count-zeros", "optimizer-unscale-and-check-inf"]
        if not inf:
            phases += ["optimizer-clip-main-grad", "optimizer-inner-step", "params-all-gather"]
        assert recorder.started() == phases


# --------------------------------------------------------------------------- level 0
def test_level_0_gives_core_no_hook_and_prints_no_step_block(monkeypatch, capsys):
    """Level 0: the executor and the optimizer get timers=None (so they make no timer
    call at all) and no timer block follows the iteration line."""
    seen = []
    real_executor = train_step_module.ScheduleExecutor

    def executor(*args, **kwargs):
        seen.append(("executor", kwargs["timers"]))
        return real_executor(*args, **kwargs)

    monkeypatch.setattr(train_step_module, "ScheduleExecutor", executor)
    real_build = training.build_trainer

    def build(*args, **kwargs):
        tr = real_build(*args, **kwargs)
        step = tr.optimizer.step
        tr.optimizer.step = lambda **kw: seen.append(("optimizer", kw["timers"])) or step(**kw)
        return tr

    monkeypatch.setattr(training, "build_trainer", build)
    out = _pretrain(0, 1, [])
    assert {who for who, _ in seen} == {"executor", "optimizer"}
    assert all(hook is None for _, hook in seen), seen
    assert _step_blocks(out) == [] and " iteration        2/" in out
    assert not any(f"    {name} " in out for name in TIMER_NAMES)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_core_hooks_by_level(level):
    cfg = parse_and_validate(BASE + ["--timing-log-level", str(level)], world_size=1,
                             env={"RANK": "0"}, cuda_available=False)
    log = StepLog(cfg, torch.device("cpu"))
    assert (log.core_timers(1) is None) == (level < 1)
    assert (log.core_timers(2) is None) == (level < 2)


@pytest.mark.parametrize("flags,barrier", [([], True),
                                           (["--no-barrier-with-level-1-timing"], False)])
def test_level_1_core_timers_start_behind_the_barrier(flags, barrier, monkeypatch):
    """As Megatron's level-1 timers (optimizer phases, gradient reductions); level 2 never."""
    cfg = parse_and_validate(BASE + ["--timing-log-level", "2"] + flags, world_size=1,
                             env={"RANK": "0"}, cuda_available=False)
    log = StepLog(cfg, torch.device("cpu"))
    seen = []
    monkeypatch.setattr(Timer, "start", lambda self, barrier=False: seen.append((self.name,
                                                                                 barrier)))
    log.core_timers(1)("optimizer-inner-step", 1).start()
    log.core_timers(1)("forward-recv", 2).start()
    assert seen == [("optimizer-inner-step", barrier), ("forward-recv", False)]


# --------------------------------------------------------------------------- whole runs
def test_fp16_level_1_prints_the_optimizer_phases_in_megatrons_order(tmp_path):
    tb = tmp_path / "tb"
    out = _pretrain(0, 1, ["--fp16", "--initial-loss-scale", "1024", "--log-num-zeros-in-grad",
                           "--timing-log-level", "1"], tb)
    names = _names(out)
    assert [n for n in names if n.startswith("optimizer-")] == list(OPTIMIZER_TIMER_NAMES)
    # layernorm-grads-all-reduce is timed without sequence parallelism too, as by Megatron
    assert names == ["forward-backward", "layernorm-grads-all-reduce",
                     "embedding-grads-all-reduce", "grads-all-reduce",
                     *OPTIMIZER_TIMER_NAMES, "optimizer"]
    scalars = read_scalars(str(tb))
    for name in OPTIMIZER_TIMER_NAMES:
        assert [step for step, _ in scalars[f"{name}-time"]] == [1, 2], name
        assert all(seconds > 0 for _, seconds in scalars[f"{name}-time"]), name
    assert not any(f"{n}-time" in scalars for n in LEVEL_2_COMPUTE + P2P_TIMER_NAMES)


@pytest.mark.parametrize("vpp,p2p", [
    (None, ["forward-recv", "forward-send", "backward-recv", "backward-send",
            "forward-send-backward-recv", "backward-send-forward-recv"]),
    (1, list(P2P_TIMER_NAMES)),
], ids=["1f1b", "interleaved"])
def test_pipeline_level_2_prints_the_send_recv_timers(tmp_path, vpp, p2p):
    argv = ["--pipeline-model-parallel-size", "2", "--timing-log-level", "2"]
    if vpp is not None:
        argv += ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", str(vpp)]
    tb = tmp_path / "tb"
    outs = run_distributed(_pretrain, 2, argv, tb)  # the last rank writes
    assert _step_blocks(outs[0]) == []  # the last rank prints
    names = _names(outs[1])
    assert [n for n in names if n in P2P_TIMER_NAMES] == p2p
    assert names[:4] == ["forward-backward", *LEVEL_2_COMPUTE]
    assert names.index(p2p[-1]) < names.index("embedding-grads-all-reduce")
    scalars = read_scalars(str(tb))
    for name in p2p:
        assert [step for step, _ in scalars[f"{name}-time"]] == [1, 2], name
        assert all(seconds >= 0 for _, seconds in scalars[f"{name}-time"]), name


def test_distributed_optimizer_prints_reduce_scatter_and_all_gather():
    outs = run_distributed(_pretrain, 2, ["--use-distributed-optimizer", "--bf16",
                                          "--timing-log-level", "1"])
    names = _names(outs[1])
    assert names == ["forward-backward", "layernorm-grads-all-reduce",
                     "embedding-grads-all-reduce", "grads-reduce-scatter", "params-all-gather",
                     "optimizer-copy-to-main-grad", "optimizer-clip-main-grad", "optimizer-inner-step",
                     "optimizer-copy-main-to-model-params", "optimizer"]
