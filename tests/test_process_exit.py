"""megatron/process_exit.py: `run(main)` exits as `sys.exit(main())` does -- same status,
same message, the threads waited for, the atexit functions run, the output flushed --
without tearing the modules down."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import atexit, sys, threading, time
sys.path.insert(0, {root!r})
from megatron.process_exit import run

class TornDown:  # a module global: freed by the teardown, which run skips
    def __del__(self):
        sys.stderr.write("torn down\\n")

kept = TornDown()

def late_write():
    time.sleep(0.3)
    with open({marker!r}, "w") as f:
        f.write("written")

def main():
    threading.Thread(target=late_write, daemon=False).start()
    atexit.register(print, "atexit ran")
    print("buffered line")  # stdout is a pipe: held in the buffer until the exit flushes it
    return {result}

run(main)
"""


def _run(tmp_path: Path, result: str) -> subprocess.CompletedProcess:
    marker = tmp_path / "marker"
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(root=str(ROOT), marker=str(marker), result=result))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("result,status,stderr", [
    ("None", 0, ""),
    ("3", 3, ""),
    ("sys.exit(4)", 4, ""),
    ("sys.exit('error: a message')", 1, "error: a message\n"),
])
def test_run_exits_as_sys_exit_does(tmp_path, result, status, stderr):
    proc = _run(tmp_path, result)
    assert (proc.returncode, proc.stderr) == (status, stderr), proc  # not "torn down"
    assert proc.stdout == "buffered line\natexit ran\n"
    assert (tmp_path / "marker").read_text() == "written"  # the thread was waited for


def test_an_exception_keeps_the_usual_exit_and_its_traceback(tmp_path):
    proc = _run(tmp_path, "1 / 0")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ZeroDivisionError" in proc.stderr
    assert proc.stderr.endswith("torn down\n")  # the modules were torn down
    assert proc.stdout == "buffered line\natexit ran\n"
    assert (tmp_path / "marker").read_text() == "written"
