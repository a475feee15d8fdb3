"""tools/benchmark.py: one run prints a JSON line; scaling mode runs layouts via torchrun."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = str(ROOT / "tools" / "benchmark.py")


def test_single_run_reports_throughput_and_mfu():
    out = subprocess.run([sys.executable, TOOL, "--preset", "tiny", "--device", "cpu",
                          "--steps", "2", "--warmup", "1", "--", "--num-workers", "0"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert row["preset"] == "tiny" and row["layout"] == "tp1pp1dp1" and row["tokens_per_s"] > 0
    assert {"mfu", "tflops", "step_ms", "time_to_first_step_s", "est_mem_gb"} <= set(row)


@pytest.mark.slow
def test_scaling_mode_prints_efficiency_table():
    out = subprocess.run([sys.executable, TOOL, "--preset", "tiny", "--device", "cpu",
                          "--steps", "2", "--warmup", "1", "--scaling", "tp1,dp2,tp2pp2",
                          "--", "--num-workers", "0"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout.splitlines()[-4:]
    assert table[0].split() == ["layout", "GPUs", "tokens/s/GPU", "MFU", "efficiency"]
    assert [r.split()[0] for r in table[1:]] == ["tp1pp1dp1", "tp1pp1dp2", "tp2pp2dp1"]
    assert table[1].split()[-1] == "100.0%"
