"""A table-printing tool piped into a reader that stops early (`... | head`): status 141 and
no BrokenPipeError traceback (tools/cli_exit.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_closed_pipe_ends_the_tool_quietly():
    """1024 ranks: about ten times a pipe's buffer of table."""
    argv = ["tools/parallel_groups.py", "--world-size", "1024",
            "--tensor-model-parallel-size", "8"]
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline()  # the reader takes one line and goes away
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
