"""One rank stuck or gone under torchrun (2 gloo processes): how long until every process
has ended, what each prints, its exit status, and what stays under --save.

A wrapper runs pretrain_gpt.py with --distributed-timeout-minutes shortened to seconds and
one call on one rank replaced: it sleeps (stuck), raises, or SIGKILLs its process. Every
process records its exit status (os._exit included).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.checkpointing import read_tracker
from megatron.watchdog import EXIT_CODE
from tests.dist_utils import free_port
from tests.test_preemption import MODEL

ROOT = Path(__file__).resolve().parents[1]

FAULT_WRAPPER = """
import dataclasses, importlib, os, runpy, signal, sys, time
sys.path.insert(0, {root!r})
import megatron.arguments as arguments
_parse = arguments.parse_and_validate

def parse_and_validate(*args, **kwargs):
    config = _parse(*args, **kwargs)
    config.parallel = dataclasses.replace(config.parallel,
                                          distributed_timeout_minutes={minutes!r})
    return config

arguments.parse_and_validate = parse_and_validate
module = importlib.import_module({module!r})
original, calls = getattr(module, {name!r}), [0]

def faulty(*args, **kwargs):
    calls[0] += 1
    if calls[0] == {call} and os.environ["RANK"] == "{rank}":
        print("test: {action} rank {rank} in {name}", flush=True)
        if {action!r} == "sleep":
            time.sleep(300)
        elif {action!r} == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure in {name}")
    return original(*args, **kwargs)

setattr(module, {name!r}, faulty)
status_file = os.path.join({status_dir!r}, "rank" + os.environ["RANK"])
os_exit = os._exit

def recording_exit(code):
    open(status_file, "w").write(str(code))
    os_exit(code)

os._exit = recording_exit
sys.argv[0] = {script!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exc:
    open(status_file, "w").write(str(exc.code))
    raise
except BaseException:
    open(status_file, "w").write("1")
    raise
"""


def run_with_fault(tmp_path, module: str, name: str, action: str, args: list, call: int = 1,
                   rank: int = 1, minutes: float = 0.05, timeout: float = 60) -> tuple:
    """pretrain_gpt.py under torchrun (2 ranks) with `module.name`'s `call`-th call on
    `rank` replaced by `action` (sleep, raise, kill) and the collective timeout shortened
    to `minutes`. (output, {rank: exit status}, seconds until torchrun ended)."""
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    wrapper = tmp_path / "fault.py"
    wrapper.write_text(FAULT_WRAPPER.format(
        root=str(ROOT), minutes=minutes, module=module, name=name, call=call, rank=rank,
        action=action, status_dir=str(status_dir), script=str(ROOT / "pretrain_gpt.py")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(wrapper),
           *MODEL, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    started = time.monotonic()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    seconds = time.monotonic() - started
    statuses = {int(p.name[4:]): int(p.read_text()) for p in status_dir.iterdir()}
    return run.stdout + run.stderr, statuses, seconds


# name: (module, function, call, extra args, what the watchdog's first line says)
HANGS = {
    "evaluation": ("megatron.training", "evaluate", 1,
                   ["--train-iters", "20", "--eval-interval", "2", "--eval-iters", "1",
                    "--save-interval", "100"],
                   r"collective validation loss all-reduce \(data-parallel group\) did not "
                   r"complete within 3 s during the evaluation at iteration 2; ranks that did "
                   r"not arrive: \[1\]"),
    "save": ("megatron.checkpointing", "_write_own_files", 2,
             ["--train-iters", "20", "--save-interval", "2", "--tensor-model-parallel-size",
              "2", "--eval-iters", "0"],
             r"collective agreement of the ranks in megatron\.checkpointing\._after_write did "
             r"not complete within 3 s while saving the checkpoint of iteration 4; ranks that "
             r"did not arrive: \[1\]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(HANGS))
def test_a_rank_stuck_outside_the_gradient_reduction_is_named_in_bounded_time(tmp_path, phase):
    """Rank 1 hangs while the other rank waits in a collective other than the gradient
    reduction (the evaluation's loss reduction; the agreement after the checkpoint files
    are written). Before, only the gradient reduction was watched: rank 0 waited for the
    process group's own timeout (--distributed-timeout-minutes + 1 minute) and died with a
    gloo traceback naming no rank. Now rank 0's watchdog names rank 1 and the phase after
    --distributed-timeout-minutes, rank 1 says where it is stuck and exits with 124, and
    the tracker still names the last complete checkpoint."""
    module, name, call, args, first_line = HANGS[phase]
    ckpt = tmp_path / "ck"
    log, statuses, seconds = run_with_fault(
        tmp_path, module, name, "sleep", args + ["--save", str(ckpt)], call=call)
    assert re.search(r"\[watchdog rank 0\] " + first_line, log), log[-4000:]
    assert re.search(r"\[watchdog rank 1\] stopping .*, in no watched collective, because "
                     r"another rank's watchdog fired:", log), log[-4000:]
    stuck = log[log.index("rank 1's main thread is here"):]
    assert "time.sleep(300)" in stuck.split("\n\n")[0], log[-4000:]
    # rank 0 waits for rank 1 to see its report; torchrun may end it first (SIGTERM)
    assert statuses[1] == EXIT_CODE and statuses.get(0, EXIT_CODE) == EXIT_CODE, statuses
    assert seconds < 45
    assert not re.search(r'File ".*(/megatron/|pretrain_gpt)', log), log[-4000:]  # no traceback
    if phase == "save":
        assert read_tracker(str(ckpt)) == (2, False)
