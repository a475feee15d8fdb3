"""`--rampup-batch-size START INCR SAMPLES` (Megatron-LM's rule, facts a.3) and
sample-based runs (`--train-samples`).

The global batch grows from START by INCR every SAMPLES / ((GBS - START) / INCR) consumed
samples, then stays at --global-batch-size; the micro-batch count, consumed samples and
the lr schedule follow the current size. A DP=2 run ramps like the single process.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.microbatches import (
    current_global_batch_size,
    parse_rampup,
    rampup_consumed_samples,
    rampup_train_iters,
)
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed
from tests.gpt_helpers import tiny_config

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "100", "--num-workers", "0", "--eval-iters", "0"]


def test_megatron_rule():
    ramp, gbs = (2, 2, 24), 8  # 3 increments, one every 8 samples
    sizes, consumed = [], 0
    while consumed < 60:
        sizes.append(current_global_batch_size(consumed, ramp, gbs))
        consumed += sizes[-1]
    assert sizes == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    # 8 steps take 28 samples (> 24: ramp-up over), then (80 - 28) // 8 = 6 full batches.
    assert rampup_train_iters(80, ramp, gbs) == 14
    assert current_global_batch_size(24, ramp, gbs) == 8  # exactly SAMPLES: the last size
    assert current_global_batch_size(0, (8, 8, 100), 8) == 8  # START == GBS: no ramp


@pytest.mark.parametrize("values,gbs,mbs,dp,match", [
    (["2", "2"], 8, 2, 1, "expected 3 values"),
    (["2", "4", "24"], 8, 2, 1, "whole number of INCREMENTs"),
    (["12", "2", "24"], 8, 2, 1, "whole number"),
    (["2", "2", "24"], 8, 2, 2, "multiples of --micro-batch-size 2 x data-parallel size 2"),
    (["0", "2", "24"], 8, 2, 1, "must all be > 0"),
    (["2", "2", "x"], 8, 2, 1, "integers"),
])
def test_bad_rampup_values(values, gbs, mbs, dp, match):
    with pytest.raises(ValueError, match=match):
        parse_rampup(values, gbs, mbs, dp)


def test_cli_rules_and_derived_values():
    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "80",
                                     "--rampup-batch-size", "2", "2", "24"])
    assert cfg.data.rampup_batch_size == [2, 2, 24] and cfg.data.target_global_batch_size == 8
    assert cfg.training.train_iters == 14 and cfg.optimizer.lr_decay_steps == 80
    with pytest.raises(ArgumentsError, match="sample-based run"):
        parse_and_validate(BASE + ["--train-iters", "10", "--rampup-batch-size", "2", "2", "8"])
    # A run that ends inside the ramp-up is allowed (with a warning), with Megatron's count:
    # the ramp takes 2, 2, 2, 2, 4, 4, 6, 6 (28 samples), then (20 - 28) // 8 = -1 step.
    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "20",
                                     "--rampup-batch-size", "2", "2", "24"])
    assert cfg.training.train_iters == 7 == rampup_train_iters(20, (2, 2, 24), 8)
    assert rampup_consumed_samples(7, (2, 2, 24), 8) == 22
    # --train-samples without ramp-up: train_samples // gbs iterations, schedule in samples.
    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "44",
                                     "--lr-warmup-samples", "8"])
    assert cfg.training.train_iters == 5 and cfg.data.rampup_batch_size is None
    assert (cfg.optimizer.lr_warmup_steps, cfg.optimizer.lr_decay_steps) == (8, 44)


def test_a_rampup_starting_at_the_global_batch_is_warned(caplog):
    """START == --global-batch-size: no ramp-up at all (Megatron-LM divides by its zero
    increments); said instead of running a constant batch in silence."""
    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "80",
                                     "--rampup-batch-size", "8", "2", "24"])
    assert cfg.training.train_iters == 10
    assert ("--rampup-batch-size 8 2 24: START is already --global-batch-size 8, so the batch "
            "never ramps up") in caplog.text
    caplog.clear()
    parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "80",
                               "--rampup-batch-size", "2", "2", "24"])
    assert "never ramps up" not in caplog.text
    # a run shorter than the (empty) ramp: its batch is the global batch throughout, so
    # no warning says the run ends "before the global batch reaches" it
    caplog.clear()
    parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "16",
                               "--rampup-batch-size", "8", "2", "24"])
    assert "never ramps up" in caplog.text and "during the ramp-up" not in caplog.text


def test_rampup_run_from_the_cli(capsys, monkeypatch):
    import pretrain_gpt
    from megatron import interval_log

    paced = []  # the progress line counts samples under a ramp, to the 76 the run takes
    monkeypatch.setattr(interval_log, "progress_line", lambda *a: paced.append(a) or "")
    argv = BASE + ["--global-batch-size", "8", "--train-samples", "80", "--rampup-batch-size",
                   "2", "2", "24", "--log-interval", "1", "--min-lr", "1e-4"]
    assert pretrain_gpt.main(argv) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(" iteration ")]
    assert len(lines) == 14 and lines[-1].startswith(" iteration       14/      14 |")

    def field(line, name):
        return float(line.split(f" {name}: ")[1].split(" |")[0])

    sizes = [int(field(x, "global batch size")) for x in lines]
    consumed = [int(field(x, "consumed samples")) for x in lines]
    assert sizes == [2, 2, 2, 2, 4, 4, 6, 6] + [8] * 6
    assert consumed == [sum(sizes[:i + 1]) for i in range(14)] and consumed[-1] == 76
    assert [(a[:3], a[4]) for a in paced] == [((n, 76, 0), "samples") for n in consumed]
    # linear decay over 80 samples, stepped by the current batch: lr after n samples
    for line, n in zip(lines, consumed):
        assert field(line, "learning rate") == pytest.approx(1e-4 + 9e-4 * (1 - n / 80),
                                                             rel=1e-3)


def _ramp_losses(rank, world):
    cfg = tiny_config(world_size=world, mbs=1, gbs=8, iters=5)
    cfg.data = dataclasses.replace(cfg.data, num_workers=0, rampup_batch_size=[2, 2, 12],
                                   target_global_batch_size=8)
    ps = ParallelState.build(world, rank)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    data = data_iterator(cfg, rt, "train", 0)
    out = []
    for _ in range(5):
        loss, ok, _, _ = train_step(tr, data)
        assert ok
        tr.state.consumed_train_samples += cfg.data.global_batch_size  # as the loop does
        out.append((cfg.data.global_batch_size, cfg.data.num_micro_batches, float(loss)))
    return out


def test_rampup_dp2_matches_single_process():
    ref = _ramp_losses(0, 1)
    assert [(g, m) for g, m, _ in ref] == [(2, 2), (2, 2), (4, 4), (6, 6), (8, 8)]
    for rank, got in enumerate(run_distributed(_ramp_losses, 2)):
        assert [(g, m) for g, m, _ in got] == [(2, 1), (2, 1), (4, 2), (6, 3), (8, 4)]
        torch.testing.assert_close(torch.tensor([x for _, _, x in got]),
                                   torch.tensor([x for _, _, x in ref]), rtol=1e-5, atol=0,
                                   msg=f"rank {rank}")


def test_rampup_tensorboard_batch_size_and_throughput_per_step(tmp_path, capsys):
    """Under --rampup-batch-size each TensorBoard `batch-size` point is its own step's batch,
    and the line's tokens/s/GPU counts the interval's own samples: both took the batch size
    at the log line for every step of the interval (iterations 7-9 of 6, 6 and 8 samples
    were written as 8 each, and tokens/s/GPU read 24 samples for 20)."""
    import re

    import pretrain_gpt
    from megatron.logging_utils import read_scalars

    tb = str(tmp_path / "tb")
    argv = BASE + ["--global-batch-size", "8", "--train-samples", "80", "--rampup-batch-size",
                   "2", "2", "24", "--log-interval", "3", "--min-lr", "1e-4",
                   "--tensorboard-dir", tb, "--log-batch-size-to-tensorboard"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    scalars = read_scalars(tb)
    sizes = [2, 2, 2, 2, 4, 4, 6, 6] + [8] * 6
    assert scalars["batch-size"] == [(i + 1, size) for i, size in enumerate(sizes)]
    # x = the samples consumed after the step: each point's value is that step's increase
    assert scalars["batch-size vs samples"] == [(sum(sizes[:i + 1]), size)
                                                for i, size in enumerate(sizes)]
    lines = re.findall(r"consumed samples: +(\d+) \| elapsed time per iteration \(ms\): "
                       r"([0-9.]+) \|.*tokens/s/GPU: (\d+) \|", out)
    previous = 0
    for samples, ms, tokens in lines:
        interval = int(samples) - previous
        previous = int(samples)
        expected = interval * 16 / (3 * float(ms) / 1000.0)
        assert int(tokens) == pytest.approx(expected, rel=0.05), (samples, ms, tokens)


def _ramped_pretrain(extra):
    """pretrain() on 20 samples ramped 2 2 24 to --global-batch-size 8 (7 steps: 2, 2, 2, 2,
    4, 4, 6 samples) with 2 evaluation iterations at the end: (trainer, output)."""
    import contextlib
    import io

    from megatron import training
    from megatron.initialize import initialize_distributed

    argv = BASE[:-2] + ["--eval-iters", "2", "--global-batch-size", "8", "--train-samples", "20",
                        "--rampup-batch-size", "2", "2", "24"] + extra
    cfg = parse_and_validate(argv, world_size=1, env={"RANK": "0"}, cuda_available=False)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tr = training.pretrain(cfg, rt)
    return tr, out.getvalue()


@pytest.mark.parametrize("skip_train", [False, True])
def test_final_evaluation_under_rampup_is_megatrons(skip_train):
    """Megatron-LM labels the final evaluation --eval-iters x --global-batch-size (the final
    size) and evaluates with the current batch: the last step's after training; with
    --skip-train and nothing loaded, the ramp's START (its batch calculator starts at 0
    consumed samples). The label said the current size (12 samples after a run ending in
    the ramp) and --skip-train evaluated at the final size (16 samples)."""
    tr, out = _ramped_pretrain(["--log-interval", "1"] + (["--skip-train"] if skip_train else []))
    iteration = 0 if skip_train else 7
    assert (" progress: " in out) != skip_train  # none without training steps
    for name in ("validation", "test"):
        assert f" validation loss at iteration {iteration} on 16-sample draw from {name} set" \
            in out, out
    # the validation draw: 2 iterations of the last step's 6 samples, or of START's 2
    assert tr.state.consumed_valid_samples == (4 if skip_train else 12)


def test_assumed_consumed_samples_under_rampup_are_described_as_the_ramps():
    """A checkpoint without sample counts resumed under --rampup-batch-size: the samples
    taken as consumed are the ramp's (2 + 2 + 2 + 4 + 4 = 14 after 5 steps of 2 2 16 to 8,
    per increment 16 / 3 samples), and the note says so, not "iterations x global batch 8"
    (40)."""
    from megatron.resume_samples import assumed_counters

    cfg = parse_and_validate(BASE + ["--global-batch-size", "8", "--train-samples", "80",
                                     "--rampup-batch-size", "2", "2", "16"],
                             world_size=1, env={}, cuda_available=False)
    per_increment = 16 / 3
    sizes, consumed = [], 0
    for _ in range(5):
        sizes.append(2 + int(consumed / per_increment) * 2)
        consumed += sizes[-1]
    assert sizes == [2, 2, 2, 4, 4]
    train, _, note = assumed_counters(cfg, 5, 0, 0)
    assert train == consumed == 14
    assert ("taking 14 training samples (the --rampup-batch-size 2 2 16 batches of its 5 "
            "iterations) as consumed") in note
    assert "x global batch" not in note
