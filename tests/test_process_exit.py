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


def test_an_exception_is_printed_as_usual_and_skips_the_teardown(tmp_path):
    """A failing rank printed its traceback and then spent 1-5 s tearing down torch and
    its process group before the launcher saw it exit; the exit is now the same as for
    a status, with the traceback printed by sys.excepthook first."""
    proc = _run(tmp_path, "1 / 0")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and proc.stderr.endswith("ZeroDivisionError: division "
                                                               "by zero\n"), proc.stderr
    assert "torn down" not in proc.stderr  # the modules were not torn down
    assert proc.stdout == "buffered line\natexit ran\n"
    assert (tmp_path / "marker").read_text() == "written"  # the thread was waited for


def test_ctrl_c_keeps_the_usual_exit(tmp_path):
    """KeyboardInterrupt still leaves through the interpreter, which ends the process by
    SIGINT so that a calling shell sees the interrupt."""
    proc = _run(tmp_path, "(_ for _ in ()).throw(KeyboardInterrupt)")
    assert proc.returncode == -2, proc
    assert "KeyboardInterrupt" in proc.stderr and proc.stderr.endswith("torn down\n")
    assert (tmp_path / "marker").read_text() == "written"
