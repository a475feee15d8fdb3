"""benchmarks/perf_ab.py: variants from a file (flags, environment, extra pretrain flags)
run through tools/benchmark.py one after another; one table at the end, every run's
output in runs.log, a failing variant reported as failed without stopping the others."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_variants_run_and_table_lists_each(tmp_path):
    variants = tmp_path / "v.txt"
    variants.write_text(
        "# comment line\n"
        "plain | tiny | - | --steps 2 --warmup 1 --device cpu | -\n"
        "math | tiny | PYTHONHASHSEED=3 | --steps 2 --warmup 1 --device cpu"
        " | --attention-backend math\n"
        "broken | tiny | - | --steps 2 --warmup 1 --device cpu | --attention-backend nope\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "perf_ab.py"),
                           str(variants), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("variant")[-1].splitlines()
    rows = {line.split()[0]: line.split()[1] for line in table[1:] if line.strip()}
    assert rows["broken"] == "failed"
    assert int(rows["plain"].replace(",", "")) > 0 and int(rows["math"].replace(",", "")) > 0
    log = (out / "runs.log").read_text()
    assert "===== plain" in log and "env: PYTHONHASHSEED=3" in log
    assert "--attention-backend math" in log and "invalid choice: 'nope'" in log


def test_help_and_a_missing_variants_file_are_answered_without_a_traceback(tmp_path):
    script = str(ROOT / "benchmarks" / "perf_ab.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and "VARIANTS_FILE" in shown.stdout, shown.stderr
    missing = subprocess.run([sys.executable, script, str(tmp_path / "none.txt")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "none.txt not found" in missing.stderr
