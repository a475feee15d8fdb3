"""--profile writes a trace for its iteration window."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron.profiling import StepProfiler
from megatron.training import data_iterator, train
from tests.test_training_policies import _trainer


def test_profile_window_writes_a_trace(tmp_path, capsys):
    tr = _trainer(tmp_path, iters=5)
    tr.config.logging = dataclasses.replace(tr.config.logging, tensorboard_dir=str(tmp_path / "tb"))
    tr.config.args.update(profile=True, profile_step_start=2, profile_step_end=4, profile_ranks=[0])
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    traces = [f for _, _, files in os.walk(tmp_path / "tb" / "profile") for f in files]
    assert any(f.endswith(".pt.trace.json") or ".pt.trace.json" in f for f in traces), traces
    assert "profiler trace written under" in capsys.readouterr().out


def _profiled_iterations(trace_dir) -> set:
    names = set()
    for root, _, files in os.walk(trace_dir):
        for f in files:
            with open(os.path.join(root, f)) as fh:
                names |= {e.get("name") for e in json.load(fh)["traceEvents"]}
    return {n for n in names if n and n.startswith("iteration ")}


@pytest.mark.parametrize("start, end, expected", [
    (2, 4, {"iteration 3", "iteration 4"}),
    (0, 1, {"iteration 1"}),  # wrote no trace at all: iteration 0 never runs
])
def test_profile_window_is_megatrons(tmp_path, start, end, expected):
    """Megatron-LM 23.05 starts profiling once --profile-step-start iterations are done and
    stops once --profile-step-end are: the log's iterations start + 1 to end."""
    tr = _trainer(tmp_path, iters=5)
    tr.config.logging = dataclasses.replace(tr.config.logging, tensorboard_dir=str(tmp_path / "tb"))
    tr.config.args.update(profile=True, profile_step_start=start, profile_step_end=end,
                          profile_ranks=[0])
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert _profiled_iterations(tmp_path / "tb" / "profile") == expected


def test_a_window_past_the_runs_end_writes_what_it_profiled(tmp_path, capsys):
    """A window ending after --train-iters wrote no trace at all (the profiler was left
    open when the loop ended): now iterations start + 1 to the last, with a warning."""
    tr = _trainer(tmp_path, iters=5)
    tr.config.logging = dataclasses.replace(tr.config.logging, tensorboard_dir=str(tmp_path / "tb"))
    tr.config.args.update(profile=True, profile_step_start=3, profile_step_end=20,
                          profile_ranks=[0])
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert _profiled_iterations(tmp_path / "tb" / "profile") == {"iteration 4", "iteration 5"}
    out = capsys.readouterr().out
    assert ("WARNING: the --profile window (iterations 4-20) ends after this run's last "
            "iteration 5: the trace covers iterations 4-5") in out
    assert "profiler trace written under" in out


def test_a_window_the_run_never_reaches_is_warned():
    p = StepProfiler(True, 10, 12, "x")
    assert p.window_note(1, 20) is None
    assert p.window_note(1, 5) == (
        "WARNING: the --profile window (iterations 11-12) starts after this run's last "
        "iteration 5: no trace will be written; pass --profile-step-start 0 (and "
        "--profile-step-end at most 5) or a longer run")
    assert p.window_note(16, 30).startswith(
        "WARNING: the --profile window (iterations 11-12) starts before this run's first "
        "iteration 16 (resumed from iteration 15): no trace will be written; pass "
        "--profile-step-start 15 or more")
    assert StepProfiler(False, 10, 12, "x").window_note(1, 5) is None


def test_profile_window_must_be_ordered():
    with pytest.raises(ValueError, match="--profile-step-end"):
        StepProfiler(True, 5, 5, "x")
