"""A rank whose torchrun is gone stops as torchrun would have stopped it.

torchrun starts its workers in sessions of their own: when torchrun itself is killed with
SIGKILL (`kill -9`, the kernel's out-of-memory killer, a test's timeout), nothing reaches
them, and they train on -- orphaned, holding their GPUs -- until a collective times out,
or for ever where a rank waits outside one. A thread of each rank started by torchrun
notices the launcher's end (the rank's parent process changes) and does what torchrun
does on SIGTERM: SIGTERM to the rank (with --exit-signal-handler the loop saves at the
iteration reached and exits; without, the process ends at once), and the end of the
process STOP_GRACE_S later if it is still running.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Mapping, Optional

POLL_S = 1.0
STOP_GRACE_S = 30.0  # torchrun's wait for its workers after it forwards SIGTERM


def started_by_torchrun(env: Mapping[str, str]) -> bool:
    """torchrun's agent sets TORCHELASTIC_RUN_ID in every worker's environment."""
    return "TORCHELASTIC_RUN_ID" in env


def stop_grace_s(env: Mapping[str, str]) -> float:
    """torchrun's wait after SIGTERM: TORCH_ELASTIC_SHUTDOWN_TIMEOUT where set (torch
    versions that read it), else STOP_GRACE_S."""
    try:
        value = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", STOP_GRACE_S))
    except ValueError:
        return STOP_GRACE_S
    return value if value >= 0 else STOP_GRACE_S


def watch_launcher(env: Mapping[str, str], rank: int, poll_s: float = POLL_S,
                   grace_s: Optional[float] = None) -> Optional[threading.Thread]:
    """Start the watch on this process's parent when torchrun started it (else None);
    once per process (an entry point run again in one process keeps the first watch).
    `grace_s`: default `stop_grace_s(env)`."""
    global _watching
    parent = os.getppid()
    if _watching or not started_by_torchrun(env) or parent <= 1:
        return None
    grace_s = stop_grace_s(env) if grace_s is None else grace_s
    thread = threading.Thread(target=_watch, args=(parent, rank, poll_s, grace_s),
                              name="launcher-watch", daemon=True)
    thread.start()
    _watching = True
    return thread


_watching = False


def _watch(parent: int, rank: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _say(f"error: rank {rank}: its launcher (torchrun, pid {parent}) has ended without "
         f"stopping it (killed?); the rank stops as torchrun would have stopped it: "
         f"SIGTERM now (with --exit-signal-handler: a save at the iteration reached), "
         f"the end of the process {grace_s:.0f} s later")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    _say(f"error: rank {rank}: still running {grace_s:.0f} s after SIGTERM; ending it")
    os._exit(128 + signal.SIGKILL)


def _say(line: str) -> None:
    """Print to stderr, which may have gone with the launcher (a pipe nobody reads): then
    the process's output goes to /dev/null from here on, so that the prints of a save
    after SIGTERM do not fail it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:
            pass
