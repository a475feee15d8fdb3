"""A rank whose torchrun is killed (SIGKILL reaches torchrun only: its workers run in
sessions of their own) stops instead of running on orphaned.

Fast: a stand-in launcher starts a process that watches it, and is killed; the process
ends (at once without a SIGTERM handler; after the grace with one that ignores SIGTERM).
Slow: `kill -9` of a real torchrun of pretrain_gpt.py with --exit-signal-handler: both
ranks save at the iteration reached and end.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron.checkpointing import read_tracker
from megatron.launcher_watch import started_by_torchrun, watch_launcher
from tests import forked_script
from tests.dist_utils import ROOT, cpu_env, free_port

WATCHED = """
import signal, sys, time
from megatron.launcher_watch import watch_launcher
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
assert watch_launcher({"TORCHELASTIC_RUN_ID": "x"}, 3, poll_s=0.05, grace_s=1.0)
print("watching", flush=True)
time.sleep(120)
"""

LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                         stdout=sys.stdout, stderr=open(sys.argv[3], "w"),
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped by its new parent
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _orphan(mode: str, err: Path) -> tuple:
    """Start the stand-in launcher and its watched child, kill the launcher with SIGKILL
    once the child watches; (child pid, seconds until the child was gone or None)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WATCHED, mode, str(err)],
                                cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "watching"
        launcher.kill()
        launcher.wait(10)
        start = time.monotonic()
        while time.monotonic() - start < 20:
            if not _alive(child):
                return child, time.monotonic() - start
            time.sleep(0.05)
        return child, None
    finally:
        launcher.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_killed_launcher_ends_its_watched_process_at_once(tmp_path):
    _, gone_after = _orphan("default", tmp_path / "err")
    assert gone_after is not None and gone_after < 10, gone_after
    err = (tmp_path / "err").read_text()
    assert re.search(r"^error: rank 3: its launcher \(torchrun, pid \d+\) has ended without "
                     r"stopping it", err, re.M), err
    assert "still running" not in err


def test_a_rank_that_ignores_sigterm_ends_after_the_grace(tmp_path):
    _, gone_after = _orphan("ignore", tmp_path / "err")
    assert gone_after is not None and 1.0 <= gone_after < 10, gone_after
    assert "error: rank 3: still running 1 s after SIGTERM; ending it" in (
        tmp_path / "err").read_text()


def test_only_torchruns_workers_watch(monkeypatch):
    """A plain `python pretrain_gpt.py` (or srun's task) does not stop with its parent: a
    user may detach it (nohup) on purpose."""
    from megatron import launcher_watch

    assert not started_by_torchrun({"RANK": "0", "WORLD_SIZE": "1"})
    assert watch_launcher({"RANK": "0"}, 0) is None
    monkeypatch.setattr(launcher_watch, "_watching", False)
    monkeypatch.setattr(launcher_watch, "_watch", lambda *a: None)
    first = watch_launcher({"TORCHELASTIC_RUN_ID": "x"}, 0)
    assert isinstance(first, threading.Thread)
    assert watch_launcher({"TORCHELASTIC_RUN_ID": "x"}, 0) is None  # once per process


def test_the_grace_is_torchruns():
    from megatron.launcher_watch import STOP_GRACE_S, stop_grace_s

    assert stop_grace_s({}) == STOP_GRACE_S == 30
    assert stop_grace_s({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}) == 100
    assert stop_grace_s({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}) == STOP_GRACE_S


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--eval-iters", "0",
         "--log-interval", "1", "--train-iters", "100000"]


def _children(pid: int) -> list:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


@pytest.mark.slow
def test_kill_9_of_torchrun_stops_the_ranks_and_they_save(tmp_path):
    ckpt = tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_gpt.py"), *MODEL, "--save", str(ckpt), "--save-interval",
           "1000", "--exit-signal-handler"]
    log = tmp_path / "log"
    log.touch()  # read below before the child may have opened it
    # forked from this process (tests/forked_script.py): torchrun's imports come free; its
    # ranks are fresh processes of their own sessions, as under a torchrun started anew
    torchrun = forked_script.Child(forked_script.start_command(
        cmd, cpu_env(PYTHONUNBUFFERED="1"), log))
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while not re.search(r"iteration\s+3/", log.read_text()):
            assert torchrun.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        ranks = _children(torchrun.pid)
        assert len(ranks) == 2, ranks
        torchrun.kill()  # SIGKILL: torchrun cannot pass anything on
        torchrun.wait(10)
        deadline = time.monotonic() + 60
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert not any(_alive(r) for r in ranks), text[-3000:]
    finally:
        torchrun.kill()
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
    # the first rank to notice stops both: the other may exit (its signal agreed on at the
    # next iteration) before its own watch looks
    assert re.search(r"error: rank \d: its launcher \(torchrun", text), text[-3000:]
    assert "[exiting program after receiving SIGTERM.]" in text, text[-3000:]
    saved = int(re.findall(r"successfully saved checkpoint at iteration\s+(\d+)", text)[-1])
    assert read_tracker(str(ckpt)) == (saved, False) and saved >= 3


def test_a_launcher_that_took_stderr_with_it_still_ends_the_rank(tmp_path):
    """The rank's stderr is often a pipe the launcher (or a terminal it held) read: gone
    with it, the line cannot be printed -- the rank must stop all the same."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: a write fails with EPIPE
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.replace('stderr=open(sys.argv[3], "w")',
                                                "stderr=int(sys.argv[3]), pass_fds=[int(sys.argv[3])]"),
         WATCHED, "default", str(write_end)],
        cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE, text=True, pass_fds=[write_end])
    os.close(write_end)
    child = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "watching"
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        launcher.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)
