"""benchmarks/baseline_gpt.py: the plain trainer that issue 7's targets are compared
against runs on the CPU, prints the benchmark's fields and learns its fixed batch."""
from __future__ import annotations

import contextlib
import io
import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(*argv: str) -> tuple:
    """benchmarks/baseline_gpt.py run as __main__ with `argv` in this process (no
    interpreter start and torch import per run): (exit status, stdout, stderr)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = sys.argv
    sys.argv = [str(ROOT / "benchmarks" / "baseline_gpt.py"), *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = saved
    return code, out.getvalue(), err.getvalue()


def _tiny(*flags: str) -> dict:
    code, out, err = _script("--device", "cpu", "--preset", "tiny", "--warmup", "1",
                             "--no-compile", "--lr-warmup", "1", *flags)
    assert code == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_tiny_baseline_runs_on_cpu_and_memorises_its_batch():
    row = _tiny("--steps", "20")
    assert row["trainer"] == "baseline" and row["steps"] == 20
    assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
    # 21 AdamW steps on one batch of random tokens: far below the uniform guess ln(128)
    assert row["loss"] < math.log(128) - 1.0, row


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_names_the_cpu_fix():
    code, _, err = _script()
    assert code == 2 and "--device cpu --preset tiny" in err


def test_accumulating_the_same_batch_three_times_trains_like_one_micro_batch():
    """--micro-batches N averages N losses of the (fixed) batch: the same gradients up to
    rounding, so the same losses; and N times the tokens per step."""
    one, three = _tiny("--steps", "8"), _tiny("--steps", "8", "--micro-batches", "3")
    assert three["micro_batches"] == 3
    assert math.isclose(one["loss"], three["loss"], rel_tol=2e-3), (one, three)
    per_step = three["tokens_per_s"] * three["step_ms"] / 1000
    assert math.isclose(per_step, 3 * 2 * 32, rel_tol=1e-2)


def test_profile_steps_prints_the_operator_table_and_rejects_negative_counts():
    base = ["--device", "cpu", "--preset", "tiny", "--warmup", "1", "--steps", "1",
            "--no-compile"]
    code, out, err = _script(*base, "--profile-steps", "2")
    assert code == 0, err[-2000:]
    assert "aten::" in err and "Self CPU time total" in err  # the op table
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 1
    code, _, err = _script(*base, "--profile-steps", "-1")
    assert code == 2 and "--profile-steps -1" in err


def test_gelu_tanh_reaches_the_model():
    """--gelu tanh swaps the MLP's activation for GPT-2's tanh form: a slightly different
    model (losses differ in fp32) that trains the same way (they stay close)."""
    erf, tanh = _tiny("--steps", "3"), _tiny("--steps", "3", "--gelu", "tanh")
    assert (erf["gelu"], tanh["gelu"]) == ("erf", "tanh")
    assert erf["loss"] != tanh["loss"]
    assert math.isclose(erf["loss"], tanh["loss"], rel_tol=1e-2), (erf, tanh)


def test_baseline_pairs_alternates_both_trainers_and_prints_ratios(tmp_path):
    """benchmarks/baseline_pairs.py on the CPU: one round of erf and tanh pairs, each a
    baseline run and a tools/benchmark.py run, the tanh pair with --openai-gelu; both
    eager (--no-compile: the baseline's cold torch.compile on the CPU took most of this
    test's time, ~20 s a run)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "baseline_pairs.py"),
                           "--preset", "tiny", "--device", "cpu", "--rounds", "1",
                           "--steps", "2", "--warmup", "1", "--no-compile",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| 1 |")]
    assert [r[1].strip() for r in rows] == ["erf", "tanh"]
    for r in rows:
        base, ours, ratio = (float(c.replace(",", "")) for c in r[2:5])
        # the ratio is printed with 3 decimals: within half a unit of the last one
        assert math.isclose(ratio, ours / base, rel_tol=2e-3, abs_tol=5e-4), r
    log = (tmp_path / "pairs.log").read_text()
    assert log.count("baseline_gpt.py") == 2 and log.count("benchmark.py --preset") == 2
    assert "--gelu tanh" in log and "-- --openai-gelu" in log
    commands = [line for line in log.splitlines() if line.startswith("$ ")]
    assert len(commands) == 4 and all("--no-compile" in c for c in commands), commands
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "baseline_pairs.py"),
                          "--gelu", "relu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gelu 'relu'" in bad.stderr
