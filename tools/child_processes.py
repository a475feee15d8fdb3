"""Child processes that end with the tool that started them.

A tool that runs other programs (pretrain_gpt.py ranks, tools/benchmark.py, torchrun)
must not leave them running when it stops early. Two ways it used to:

* SIGTERM to the tool alone (`kill`, a scheduler ending the job's main process,
  `timeout --foreground`) ends a Python process at once, running no clean-up, and its
  children go on without it (holding the GPU). `sigterm_as_exit()`, called by the tool's
  `__main__`, turns SIGTERM into SystemExit(143) so that the clean-up below runs.
* An exception while the tool waits (Ctrl-C, SystemExit from SIGTERM, a timeout):
  `subprocess.run` then SIGKILLs its child, and a child that is torchrun cannot pass that
  on -- its workers run in sessions of their own and are orphaned. `stopping(procs)` and
  `run(...)` stop the children with SIGTERM first (torchrun forwards it to its workers
  and waits for them), SIGKILL after `grace_s`.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from typing import Iterator, List

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/child_processes.py is a library module (the clean-up of the child "
                     "processes other tools start); run python tools/benchmark.py --help")

# how long a child gets to end after SIGTERM before SIGKILL: torchrun waits up to 30 s for
# its workers after forwarding it
GRACE_S = 40.0


def exit_on_sigterm(signum, _frame) -> None:
    """A SIGTERM handler: SystemExit(128 + SIGTERM), so that `finally` blocks, `with`
    exits and `stopping` run instead of the process vanishing at once."""
    raise SystemExit(128 + signum)


def sigterm_as_exit() -> None:
    """Install `exit_on_sigterm` (in the main thread; elsewhere nothing)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_on_sigterm)


def stop(procs: List[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """End every process of `procs` still running: SIGTERM, then SIGKILL to those left
    after `grace_s` (0: SIGKILL at once); waits for all of them. SIGTERM to this process
    is ignored meanwhile."""
    main = threading.current_thread() is threading.main_thread()
    # a second SIGTERM (`timeout` signals the whole process group: this tool and a child
    # that is itself stopping its own) must not cut this clean-up short
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        live = [p for p in procs if p.poll() is None]
        if grace_s > 0:
            for p in live:
                p.terminate()
            deadline = time.monotonic() + grace_s
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in live:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stopping(procs: List[subprocess.Popen], grace_s: float = GRACE_S) -> Iterator[None]:
    """`with stopping(procs):` -- an exception inside (Ctrl-C, SIGTERM through
    `sigterm_as_exit`, a timeout) stops `procs` (`stop`) before it propagates."""
    try:
        yield
    except BaseException:
        stop(procs, grace_s)
        raise


def run(cmd: List[str], *, capture_output: bool = False, timeout=None, check: bool = False,
        grace_s: float = GRACE_S, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, ...) whose child is stopped by `stop` (SIGTERM first) on any
    exception, a timeout included (subprocess.TimeoutExpired, with the output so far)."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(cmd, **kwargs) as proc:
        try:
            with stopping([proc], grace_s):
                out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            exc.stdout, exc.stderr = proc.communicate()
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
