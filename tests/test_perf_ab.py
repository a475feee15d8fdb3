"""benchmarks/perf_ab.py: variants from a file (flags, environment, extra pretrain flags)
run through tools/benchmark.py one after another; one table at the end, every run's
output in runs.log, a failing variant reported as failed without stopping the others."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find the child")
def test_sigterm_ends_the_running_variant_too(tmp_path):
    """`kill` (SIGTERM) of perf_ab.py alone -- a scheduler's or `timeout --foreground`'s
    -- ends the benchmark it is running too, not only perf_ab.py. The variant's `tree`
    column points at a stand-in tools/benchmark.py that writes its pid and sleeps."""
    (tmp_path / "tree" / "tools").mkdir(parents=True)
    pid_file = tmp_path / "child.pid"
    (tmp_path / "tree" / "tools" / "benchmark.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n")
    variants = tmp_path / "v.txt"
    variants.write_text(f"stand-in | tiny | - | - | - | {tmp_path / 'tree'}\n")
    tool = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "perf_ab.py"),
                             str(variants), "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.time() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        tool.send_signal(signal.SIGTERM)
        assert tool.wait(timeout=30) != 0
        deadline = time.time() + 5
        while _running(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the benchmark outlived perf_ab.py"
    finally:
        tool.kill()
        tool.wait()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)
