"""Whole-step CUDA graphs (`--cuda-graph-step`, megatron/step_graph.py).

On the CPU the step is driven through `StepGraph(simulated=True)`: the recorded step
function is re-run at each "replay" with `capturing()` true, so everything the host must
do around a replay is exercised -- the micro-batches copied into the static buffers, the
step's lr / weight decay / bias corrections written to the device tensor the Triton AdamW
kernel reads (`prepare_replay`), the step counted once. With a cosine schedule the lr
changes every step, so a missed or doubled upload changes the weights: losses, grad
norms and final weights must equal an eager run's exactly (same kernels, same order).
The CUDA test captures a real graph and compares it with eager steps on the GPU.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the graph needs "
                                              "the Triton AdamW kernel)")

from megatron.arguments_common import ArgumentsError  # noqa: E402
from megatron.step_graph import (  # noqa: E402
    WARMUP_STEPS,
    StepGraph,
    _copy_into,
    runner_for,
    settings_reason,
    settle,
)
from tests.gpt_helpers import cli_trainer  # noqa: E402

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--clip-grad", "0.05",
        "--weight-decay", "0.1", "--seed", "5", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--adam-kernel", "triton"]


# fp16 from a loss scale that overflows now and then, and grows back after two clean
# steps: among the replays every transition occurs (skip after skip, after an update, ...)
FP16_OVERFLOWING = ["--fp16", "--initial-loss-scale", "1048576", "--loss-scale-window", "2"]


@pytest.fixture(autouse=True)
def _interpret(request, monkeypatch):
    """CPU tests run the AdamW kernel in Triton's interpreter; the CUDA test compiles it."""
    from megatron.core.optimizer import multi_tensor_adam

    on_cuda = "cuda" in request.keywords
    if on_cuda:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", not on_cuda)


def _run(argv, steps: int, runner=None, oks=None):
    """(losses, grad norms, trainer) after `steps` steps on the CPU; `runner` preset as
    the graph; each step's update flag appended to `oks` when given (else every step must
    update). Skips where CUDA is visible: Triton was imported there without
    TRITON_INTERPRET (tests/conftest.py), and its interpreter cannot run the kernel."""
    from megatron.training import data_iterator, train_step

    if torch.cuda.is_available():
        pytest.skip("CPU-interpreter test; the CUDA test covers this machine")

    cfg, rt, tr = cli_trainer(list(argv))
    if runner is not None:
        tr.step_graph = runner
    data = data_iterator(cfg, rt, "train", 0)
    losses, norms = [], []
    for _ in range(steps):
        loss, ok, grad_norm, _ = train_step(tr, data)
        ok = bool(ok)  # an fp16 replay's is a 0-dim tensor
        if oks is None:
            assert ok
        else:
            oks.append(ok)
        losses.append(loss)
        norms.append(grad_norm)
        tr.state.iteration += 1
    settle(tr)
    return losses, norms, tr


def _weights(tr):
    return [p.detach().clone() for p in tr.model.unwrapped()[0].parameters()]


@pytest.mark.parametrize("precision", ["--fp32", "--bf16"])
def test_simulated_replays_equal_eager_steps(precision):
    argv = ARGV + ([precision] if precision == "--bf16" else [])
    steps = WARMUP_STEPS + 4
    eager_losses, eager_norms, eager = _run(argv + ["--cuda-graph-step", "off"], steps)
    runner = StepGraph(simulated=True)
    losses, norms, graphed = _run(argv, steps, runner)
    assert runner.body is not None and runner.failed is None, "no step was replayed"
    assert [float(x) for x in losses] == [float(x) for x in eager_losses]
    assert [float(x) for x in norms] == [float(x) for x in eager_norms]
    for a, b in zip(_weights(graphed), _weights(eager)):
        assert torch.equal(a, b)
    multi = graphed.optimizer._multi
    assert multi.step_count == steps, "each replay must count exactly one optimizer step"
    assert torch.equal(multi.hyper, eager.optimizer._multi.hyper)  # the last step's lr, wd, ...
    assert graphed.scheduler.num_steps == eager.scheduler.num_steps


def _eager_and_replayed(argv, steps: int):
    """The same run eagerly and through a simulated graph: two tuples (losses, grad norms,
    trainer, update flags); fails unless steps were replayed."""
    eager_oks, oks = [], []
    eager = _run(argv + ["--cuda-graph-step", "off"], steps, oks=eager_oks)
    runner = StepGraph(simulated=True)
    graphed = _run(argv, steps, runner, oks=oks)
    assert runner.body is not None and runner.failed is None, "no step was replayed"
    return (*eager, eager_oks), (*graphed, oks)


@pytest.mark.parametrize("precision", [["--bf16"], FP16_OVERFLOWING])
def test_distributed_optimizer_on_one_rank_replays_like_eager_steps(precision):
    """--use-distributed-optimizer with one data-parallel rank: nothing to reduce-scatter
    or all-gather, so the step may be captured; replays must equal eager steps (losses,
    update flags, grad norms, weights), and the optimizer names the DP all-gather as the
    reason not to capture once its buckets have a DP group."""
    argv = ARGV + precision + ["--use-distributed-optimizer"]
    (eager_losses, eager_norms, eager, eager_oks), (losses, norms, graphed, oks) = \
        _eager_and_replayed(argv, WARMUP_STEPS + 6)
    assert type(graphed.optimizer).__name__ == "DistributedOptimizer"
    assert graphed.optimizer.graph_capture_reason() is None
    assert oks == eager_oks
    assert [float(x) for x in losses] == [float(x) for x in eager_losses]
    assert [float(x) for x, ok in zip(norms, oks) if ok] == \
        [float(x) for x, ok in zip(eager_norms, oks) if ok]
    for a, b in zip(_weights(graphed), _weights(eager)):
        assert torch.equal(a, b)
    graphed.optimizer.shards[0].bucket.dp_group = object()  # as with several DP ranks
    assert "all-gathers the parameters" in graphed.optimizer.graph_capture_reason()


def test_simulated_fp16_replays_skip_overflows_like_eager_steps():
    """fp16 with a loss scale that overflows now and then: a replayed step decides on the
    device (the kernel masks itself off) and the host learns it after the replay; the
    skip pattern, losses, grad norms, loss scales, weights and step counts must equal an
    eager run's, which decides before launching the kernel."""
    (eager_losses, eager_norms, eager, eager_oks), (losses, norms, graphed, oks) = \
        _eager_and_replayed(ARGV + FP16_OVERFLOWING, WARMUP_STEPS + 10)
    assert oks == eager_oks
    replayed = oks[WARMUP_STEPS:]
    pairs = set(zip(replayed, replayed[1:]))
    assert len(pairs) == 4, f"not every transition among the replays: {oks}"
    assert [float(x) for x in losses] == [float(x) for x in eager_losses]
    # An eager step that skipped returns no norm; a replay returns its non-finite one.
    assert all((n is None) == (not ok) for n, ok in zip(eager_norms, oks))
    assert [float(x) for x, ok in zip(norms, oks) if ok] == \
        [float(x) for x, ok in zip(eager_norms, oks) if ok]
    assert all(not torch.isfinite(x) for x, ok in zip(norms[WARMUP_STEPS:], replayed) if not ok)
    for a, b in zip(_weights(graphed), _weights(eager)):
        assert torch.equal(a, b)
    assert graphed.optimizer._multi.step_count == sum(oks) == eager.optimizer._multi.step_count
    assert float(graphed.optimizer.get_loss_scale()) == float(eager.optimizer.get_loss_scale())
    assert graphed.optimizer.grad_scaler.state_dict()["growth_tracker"] == \
        eager.optimizer.grad_scaler.state_dict()["growth_tracker"]
    assert graphed.scheduler.num_steps == eager.scheduler.num_steps
    state = graphed.optimizer.optimizer.state
    assert {float(s["step"]) for s in state.values()} == {float(sum(oks))}


def _log_run(argv, runner, tb_dir, capsys, extra=()):
    """Run the training loop (megatron.training.train) for ARGV's 8 iterations, logging
    every 3 (lines at 3 and 6); the iteration lines without their timings, tensorboard's
    per-iteration scalars (all 8), and the trainer."""
    import re

    from megatron.logging_utils import read_scalars
    from megatron.training import data_iterator, train

    if torch.cuda.is_available():
        pytest.skip("CPU-interpreter test; the CUDA test covers this machine")
    cfg, rt, tr = cli_trainer(list(argv) + ["--log-interval", "3", "--tensorboard-dir",
                                            str(tb_dir), "--eval-iters", "0", *extra])
    if runner is not None:
        tr.step_graph = runner
    capsys.readouterr()
    train(tr, data_iterator(cfg, rt, "train", 0), None)
    tr.tb.close()
    timing = re.compile(r" (elapsed time per iteration \(ms\)|tokens/s/GPU|TFLOP/s/GPU): [^|]*\|")
    lines = [timing.sub("", line) for line in capsys.readouterr().out.splitlines()
             if line.startswith(" iteration ")]
    scalars = read_scalars(str(tb_dir))
    keep = ("learning-rate", "loss-scale", "grad-norm", "lm loss")
    return lines, {k: sorted(v) for k, v in scalars.items() if k in keep}, tr


def test_fp16_replays_log_what_eager_steps_log(tmp_path, capsys):
    """The training loop over fp16 replays, whose update flags stay on the device until
    the log line: the same iteration lines (skipped count, learning rate, loss scale,
    grad norm of the last step, averaged loss) and tensorboard scalars as eager steps,
    and exact step counts when training ends."""
    argv = ARGV + FP16_OVERFLOWING
    eager_lines, eager_tb, eager = _log_run(argv + ["--cuda-graph-step", "off"], None,
                                            tmp_path / "eager", capsys)
    runner = StepGraph(simulated=True)
    lines, tb, graphed = _log_run(argv, runner, tmp_path / "graphed", capsys)
    assert runner.body is not None and runner.failed is None and runner.unread is None
    assert len(lines) == 2 and lines == eager_lines  # 3 and 6: none off --log-interval
    skipped = [int(line.split("number of skipped iterations:")[1].split("|")[0])
               for line in lines]
    assert 0 < sum(skipped) < 8, f"no mix of skipped and updated steps: {skipped}"
    assert tb == eager_tb and len(tb["learning-rate"]) == 8
    assert graphed.scheduler.num_steps == eager.scheduler.num_steps
    assert graphed.optimizer._multi.step_count == eager.optimizer._multi.step_count


def _saved_checkpoints(argv, tmp_path, capsys, files):
    """The training loop eagerly and through a simulated graph, saving at 3, 6 and 8:
    {"eager"|"graphed": [{file: its loaded payload} per saved iteration]}."""
    runs = {}
    for name, runner, mode in (("eager", None, ["--cuda-graph-step", "off"]),
                               ("graphed", StepGraph(simulated=True), [])):
        save = tmp_path / name
        _log_run(argv + mode, runner, tmp_path / f"tb-{name}", capsys,
                 extra=["--save", str(save), "--save-interval", "3", "--log-interval", "4"])
        runs[name] = [{f: torch.load(save / f"iter_{it:07d}" / "mp_rank_00" / f,
                                     weights_only=False) for f in files} for it in (3, 6, 8)]
    return runs


def test_fp16_checkpoints_saved_between_replays_equal_eager_ones(tmp_path, capsys):
    """A checkpoint saved right after an fp16 replay, whose update flag the host had not
    read yet, holds exact counts: the scheduler's, Adam's per-parameter steps and the loss
    scaler's, as an eager run's checkpoint at the same iteration (saves at 3 and 6 after
    replays that skipped, no log line there to read the flag first, and at 8)."""
    from megatron.checkpointing import MODEL_FILENAME

    runs = _saved_checkpoints(ARGV + FP16_OVERFLOWING, tmp_path, capsys, [MODEL_FILENAME])
    for eager, graphed in zip(*([r[MODEL_FILENAME] for r in runs[k]]
                                for k in ("eager", "graphed"))):
        assert graphed["opt_param_scheduler"] == eager["opt_param_scheduler"]
        opt_e, opt_g = eager["optimizer"], graphed["optimizer"]
        assert opt_g["grad_scaler"]["growth_tracker"] == opt_e["grad_scaler"]["growth_tracker"]
        assert opt_g["grad_scaler"]["hysteresis_tracker"] == \
            opt_e["grad_scaler"]["hysteresis_tracker"]
        assert float(opt_g["grad_scaler"]["scale"]) == float(opt_e["grad_scaler"]["scale"])
        steps = [{float(s["step"]) for s in o["optimizer"]["state"].values()}
                 for o in (opt_e, opt_g)]
        assert steps[0] == steps[1] and len(steps[0]) == 1
    kept = [{float(s["step"]) for s in ck["optimizer"]["optimizer"]["state"].values()}
            for ck in (r[MODEL_FILENAME] for r in runs["graphed"])]
    assert kept[0] != {3.0} and kept[1] != {6.0}, f"saves not after skips: steps {kept}"


def test_returned_loss_is_not_overwritten_by_the_next_replay():
    runner = StepGraph(simulated=True)
    losses, _, _ = _run(ARGV, WARMUP_STEPS + 3, runner)
    kept = [float(x) for x in losses]
    assert len(set(kept)) == len(kept), f"losses repeat: {kept}"


def test_a_failed_capture_falls_back_to_eager_steps_unless_insisted(capsys):
    class Failing(StepGraph):
        def _capture(self, tr, body):
            raise RuntimeError("operation not permitted when stream is capturing")

    steps = WARMUP_STEPS + 3
    eager_losses, _, _ = _run(ARGV + ["--cuda-graph-step", "off"], steps)
    runner = Failing(simulated=True)
    losses, _, _ = _run(ARGV, steps, runner)
    assert [float(x) for x in losses] == [float(x) for x in eager_losses]
    assert "operation not permitted" in runner.failed
    assert "whole-step CUDA graph capture failed" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="operation not permitted"):
        _run(ARGV, steps, Failing(strict=True, simulated=True))


def test_auto_stays_eager_on_the_cpu_quietly(capsys):
    _, _, tr = _run(ARGV, 1)
    assert runner_for(tr) is None and tr.step_graph is False
    assert "whole-step CUDA graph" not in capsys.readouterr().out


def _settings(**changes):
    base = dict(device_type="cuda", world_size=1, hidden_dropout=0.0, attention_dropout=0.0,
                nan_loss_policy="stop", timing_log_level=0, rampup_batch_size=None,
                empty_unused_memory_level=0, compile_mode="default", adam_kernel="auto",
                optimizer="adam")
    base.update(changes)
    return settings_reason(**base)


@pytest.mark.parametrize("change,phrase", [
    ({"device_type": "cpu"}, "needs CUDA"),
    ({"world_size": 2}, "2 ranks"),
    ({"hidden_dropout": 0.1}, "dropout is on"),
    ({"nan_loss_policy": "skip"}, "--nan-loss-policy skip"),
    ({"timing_log_level": 1}, "--timing-log-level 1"),
    ({"rampup_batch_size": [4, 4, 100]}, "--rampup-batch-size"),
    ({"empty_unused_memory_level": 1}, "--empty-unused-memory-level"),
    ({"compile_mode": "reduce-overhead"}, "reduce-overhead"),
    ({"adam_kernel": "torch"}, "--adam-kernel torch"),
    ({"optimizer": "sgd"}, "--optimizer sgd"),
])
def test_settings_that_rule_out_a_captured_step_are_named(change, phrase):
    assert _settings() is None
    assert phrase in _settings(**change)


def test_insisting_where_it_cannot_capture_is_refused_at_parse_time():
    from megatron.arguments import parse_and_validate

    argv = ARGV + ["--bf16", "--cuda-graph-step", "on"]
    parse_and_validate(argv, cuda_available=True)  # allowed
    parse_and_validate([a for a in argv if a != "--bf16"] + ["--fp16"], cuda_available=True)
    with pytest.raises(ArgumentsError, match="needs CUDA; use --cuda-graph-step auto"):
        parse_and_validate(argv, cuda_available=False)


def test_a_batch_of_another_shape_is_refused_with_the_fix():
    static = [{"text": torch.zeros(2, 17, dtype=torch.int64)}]
    _copy_into(static, [{"text": torch.ones(2, 17, dtype=torch.int64)}])
    assert static[0]["text"].sum() == 34
    with pytest.raises(RuntimeError, match="use --cuda-graph-step off for varying batch"):
        _copy_into(static, [{"text": torch.ones(3, 17, dtype=torch.int64)}])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_flag,precision", [
    ("--no-compile", ["--bf16"]), ("--compile", ["--bf16"]),
    ("--compile", FP16_OVERFLOWING), ("--compile", ["--bf16", "--use-distributed-optimizer"])])
def test_captured_steps_equal_eager_steps_on_cuda(compile_flag, precision):
    """A real capture: 6 replays after the warm-up give the eager run's losses and update
    flags (bitwise: the same kernels on the same data), and the returned losses stay
    distinct. fp16 starts at a loss scale that overflows now and then: replays that skip
    on the device must skip as the eager steps do."""
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed, set_random_seed
    from megatron.training import build_trainer, data_iterator, train_step

    def run(mode):
        cfg = parse_and_validate(ARGV + precision + [compile_flag, "--cuda-graph-step", mode],
                                 env={"RANK": "0"}, cuda_available=True)
        rt = initialize_distributed(cfg.parallel, 0, 1, 0)
        set_random_seed(cfg.training.seed, rt)
        tr = build_trainer(cfg, rt)
        data = data_iterator(cfg, rt, "train", 0)
        out = []
        for _ in range(WARMUP_STEPS + 6):
            loss, ok, *_ = train_step(tr, data)
            out.append((float(loss), bool(ok)))
            tr.state.iteration += 1
        return out, tr

    eager, _ = run("off")
    graphed, tr = run("on")
    assert tr.step_graph and tr.step_graph.graph is not None
    assert graphed == eager
    assert len({loss for loss, _ in graphed}) == len(graphed)
    if "--fp16" in precision:
        print("fp16 update flags:", [ok for _, ok in graphed])


def test_distributed_optimizer_checkpoints_between_replays_equal_eager_ones(tmp_path, capsys):
    """--use-distributed-optimizer on one rank, fp16 with overflowing replays: the
    checkpoints saved by the training loop at 3, 6 and 8 (after replays whose flags the
    host had not read yet) hold what an eager run's hold: the scheduler, the loss scaler,
    and in distrib_optim.pt the fp32 parameters and both Adam moments, bitwise."""
    from megatron.checkpoint_reshard import DISTRIB_FILENAME
    from megatron.checkpointing import MODEL_FILENAME

    runs = _saved_checkpoints(ARGV + FP16_OVERFLOWING + ["--use-distributed-optimizer"],
                              tmp_path, capsys, [MODEL_FILENAME, DISTRIB_FILENAME])
    for eager, graphed in zip(runs["eager"], runs["graphed"]):
        model_e, model_g = eager[MODEL_FILENAME], graphed[MODEL_FILENAME]
        assert model_g["opt_param_scheduler"] == model_e["opt_param_scheduler"]
        scaler_e, scaler_g = (m["optimizer"]["grad_scaler"] for m in (model_e, model_g))
        assert float(scaler_g["scale"]) == float(scaler_e["scale"])
        assert scaler_g["growth_tracker"] == scaler_e["growth_tracker"]
        flat_e, flat_g = eager[DISTRIB_FILENAME], graphed[DISTRIB_FILENAME]
        assert flat_g.keys() == flat_e.keys()
        assert flat_g.get("checkpoint_identity") == flat_e.get("checkpoint_identity")
        for chunk in (c for c in flat_e if c != "checkpoint_identity"):
            for dtype, entry in flat_e[chunk].items():
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(flat_g[chunk][dtype][key], entry[key]), (chunk, key)
    first, last = (runs["eager"][i][DISTRIB_FILENAME] for i in (0, -1))
    chunk, dtype = next((c, d) for c in first if c != "checkpoint_identity" for d in first[c])
    assert not torch.equal(first[chunk][dtype]["exp_avg"], last[chunk][dtype]["exp_avg"]), \
        "the moments did not move between the checkpoints: nothing was compared"


@pytest.mark.parametrize("precision", [[], FP16_OVERFLOWING])
def test_state_saved_after_replays_resumes_like_an_eager_run(precision):
    """The step count lives on the device (optimizer state) and on the host (the kernel's
    bias corrections); after replays both must agree, so a checkpoint taken then resumes
    eagerly with the losses of an uninterrupted eager run. fp16 with overflowing replays:
    the loss scaler's state (scale, trackers) too."""
    from megatron.training import data_iterator, train_step

    argv = ARGV + precision
    steps = WARMUP_STEPS + 4
    oks = [] if precision else None
    expected, _, _ = _run(argv + ["--cuda-graph-step", "off"], steps + 2, oks=oks)
    _, _, graphed = _run(argv, steps, StepGraph(simulated=True), oks=[] if precision else None)
    if precision:
        assert not all(oks[WARMUP_STEPS:steps]), f"no replay overflowed: {oks}"
    cfg, rt, resumed = cli_trainer(argv + ["--cuda-graph-step", "off"])
    resumed.model.unwrapped()[0].load_state_dict(graphed.model.unwrapped()[0].state_dict())
    resumed.optimizer.load_state_dict(graphed.optimizer.state_dict())
    resumed.scheduler.load_state_dict(graphed.scheduler.state_dict())
    data = data_iterator(cfg, rt, "train", 0)
    for _ in range(steps * cfg.data.num_micro_batches):
        next(data)
    got = [float(train_step(resumed, data)[0]) for _ in range(2)]
    assert got == [float(x) for x in expected[steps:]]
