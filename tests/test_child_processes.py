"""tools/child_processes.py: the children a tool started end with it (SIGTERM first, so a
torchrun child can pass it on to its workers; SIGKILL after the grace)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tools import child_processes

# a child that says when its SIGTERM handler is in place, and what ended it
TRAPS_TERM = ("import signal, sys, time\n"
              "def term(*_):\n    print('got SIGTERM', flush=True); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, term)\n"
              "print('ready', flush=True)\ntime.sleep(60)\n")
IGNORES_TERM = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(60)\n")


def _started(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_an_exception_stops_the_children_with_sigterm_first():
    proc = _started(TRAPS_TERM)
    try:
        with pytest.raises(KeyboardInterrupt):
            with child_processes.stopping([proc], grace_s=30):
                raise KeyboardInterrupt
        assert proc.returncode == 0 and proc.stdout.read().strip() == "got SIGTERM"
    finally:
        proc.kill()
        proc.wait()


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _started(IGNORES_TERM)
    start = time.monotonic()
    try:
        child_processes.stop([proc], grace_s=0.3)
        assert proc.returncode == -signal.SIGKILL and time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.wait()


def test_run_stops_its_child_on_a_timeout_and_keeps_the_output():
    with pytest.raises(subprocess.TimeoutExpired) as exc:
        child_processes.run([sys.executable, "-c", TRAPS_TERM], capture_output=True,
                            text=True, timeout=0.5)
    # SIGTERM reached the child unless it came before the handler was in place
    assert exc.value.stdout in ("", "ready\n", "ready\ngot SIGTERM\n")


def test_run_is_subprocess_run_otherwise():
    done = child_processes.run([sys.executable, "-c", "print('out'); raise SystemExit(3)"],
                               capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (3, "out\n")
    with pytest.raises(subprocess.CalledProcessError):
        child_processes.run([sys.executable, "-c", "raise SystemExit(1)"], check=True)
