"""One rank stuck or gone under torchrun (2 gloo processes): how long until every process
has ended, what each prints, its exit status, and what stays under --save.

A wrapper runs pretrain_gpt.py with --distributed-timeout-minutes shortened to seconds (and
with it the watchdog's wait before a reporting rank exits) and one call on one rank
replaced: it sleeps (stuck), raises, or SIGKILLs its process. Every process records its
exit status (os._exit included). The watchdog gets that short timeout once training
begins (generation: the process group, once the model is loaded); through start-up it
waits STARTUP_TIMEOUT_S (see there).
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron.checkpointing import read_tracker
from megatron.rank_failure import (
    describe_failure,
    first_failure,
    output_place,
    peer_failure,
    peer_failure_message,
    record_failure,
)
from megatron.watchdog import EXIT_CODE
from tests import forked_script
from tests.dist_utils import cpu_env, free_port
from tests.test_preemption import MODEL, RUN_RECORDING_STATUS, read_statuses

ROOT = Path(__file__).resolve().parents[1]

# A rank whose watchdog fired lingers until every rank has printed its stop message (so
# that the others see its report), at most max(POLL_S, its poll interval) + 1 s: that
# longest wait (a rank that never prints) is 3 s here, not the production POLL_S's 6 s.
# With the 3-s collective timeout here every rank polls each 0.75 s either way.
LINGER_POLL_S = 2.0

# The watchdog's timeout until training begins (the wrapper's `train`), and the process
# group's until the generation cases' model is loaded (GENERATE_FAULT). Start-up's
# collectives (the timers' barriers, the data set-up's, the checkpoint load's) wait for
# ranks that import, build the model and set up at their own pace: on a loaded machine
# they arrive seconds apart, and the 3-s timeout fired there ("barrier of timer
# train/valid/test-data-iterators-setup did not complete within 3 s during start-up"; a
# rank 1 that builds its model 5 s late has the generation's rank 0 report "a collective
# timed out"). No fault here comes before training or generation. In training, below the
# process group's timeout (the collective timeout + 60 s): a start-up hang still ends with
# the watchdog's report.
STARTUP_TIMEOUT_S = 30.0

FAULT_WRAPPER = """
import dataclasses, importlib, os, runpy, signal, sys, time
sys.path.insert(0, {root!r})
import megatron.arguments as arguments
import megatron.watchdog as watchdog
_parse = arguments.parse_and_validate

def parse_and_validate(*args, **kwargs):
    config = _parse(*args, **kwargs)
    config.parallel = dataclasses.replace(config.parallel,
                                          distributed_timeout_minutes={minutes!r})
    return config

arguments.parse_and_validate = parse_and_validate
watchdog.POLL_S = {poll_s!r}
import megatron.training as training
_build_watchdog, _train = training.build_watchdog, training.train

def build_watchdog(timeout_s, *args, **kwargs):
    # built with the short timeout: it polls and publishes as often from the start
    wd = _build_watchdog(timeout_s, *args, **kwargs)
    wd.timeout_s = {startup_s!r}  # a watched block's deadline is set from it as it begins
    return wd

def train(tr, *args, **kwargs):
    tr.watchdog.timeout_s = 60 * {minutes!r}
    return _train(tr, *args, **kwargs)

training.build_watchdog, training.train = build_watchdog, train
owner = importlib.import_module({module!r})
*path, attr = {name!r}.split(".")  # a function of the module, or a method of its class
for part in path:
    owner = getattr(owner, part)
original, calls = getattr(owner, attr), [0]

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

setattr(owner, attr, faulty)
""" + RUN_RECORDING_STATUS


@pytest.fixture(autouse=True)
def forked_ranks(monkeypatch):
    """Torchrun's ranks forked from their launcher (tests/forked_script.py: ForkedPopen),
    which has torch and megatron imported: what they print and how they end is the
    subject here, not their imports (some 3 s of CPU per rank)."""
    forked_script.fork_torchrun_workers(monkeypatch)


def run_agents(tmp_path, cmds: list, timeout: float) -> tuple:
    """Each torchrun command line in `cmds` forked from this process (tests/forked_script.py:
    the launcher's imports come free; its ranks fork from it, see `forked_ranks`), its output and its
    ranks' (stderr with stdout) in a file. ([the output of each], seconds until the last
    ended); a torchrun still running after `timeout` seconds is killed, and the test fails."""
    env = cpu_env(PYTHONUNBUFFERED="1")
    logs = [tmp_path / f"torchrun{i}.log" for i in range(len(cmds))]
    started = time.monotonic()
    pids = [forked_script.start_command(cmd, env, log) for cmd, log in zip(cmds, logs)]
    forked_script.wait(pids, timeout)
    return [log.read_text() for log in logs], time.monotonic() - started


def run_with_fault(tmp_path, module: str, name: str, action: str, args: list, call: int = 1,
                   rank: int = 1, minutes: float = 0.05, timeout: float = 60,
                   nodes: int = 1, world: int = 2) -> tuple:
    """pretrain_gpt.py under torchrun (`world` ranks; with `nodes` 2, half on each, as on
    two machines) with `module.name`'s `call`-th call on `rank` replaced by `action`
    (sleep, raise, kill) and the collective timeout shortened to `minutes`. (output of
    each torchrun, {rank: exit status}, seconds until the last torchrun ended)."""
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    wrapper = tmp_path / "fault.py"
    wrapper.write_text(FAULT_WRAPPER.format(
        root=str(ROOT), minutes=minutes, module=module, name=name, call=call, rank=rank,
        action=action, status_dir=str(status_dir), script=str(ROOT / "pretrain_gpt.py"),
        poll_s=LINGER_POLL_S, startup_s=STARTUP_TIMEOUT_S))
    port = free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
             "--node-rank", str(node), "--nproc-per-node", str(world // nodes), "--master-addr",
             "127.0.0.1", "--master-port", str(port), str(wrapper), *MODEL, *args]
            for node in range(nodes)]
    outs, seconds = run_agents(tmp_path, cmds, timeout)
    statuses = read_statuses(status_dir)
    return (outs[0] if nodes == 1 else outs), statuses, seconds


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


def _assert_rank_1_shown_and_all_ended(log, statuses, seconds):
    """Rank 1's stack shows where it sleeps, every process ended with the watchdog's
    status within 45 s, and no traceback from the project's code."""
    stuck = log[log.index("rank 1's main thread is here"):]
    assert "time.sleep(300)" in stuck.split("\n\n")[0], log[-4000:]
    assert statuses and set(statuses.values()) == {EXIT_CODE}, statuses
    assert seconds < 45
    assert not re.search(r'File ".*(/megatron/|pretrain_gpt)', log), log[-4000:]


def _assert_reported_once(log: str, first_line: str) -> int:
    """Ranks 0 and 1 are both in the watched block (rank 1 stuck inside it), so both
    deadlines pass, and which rank counts itself in first -- it reads the other's
    check-ins and gives the details -- is the scheduler's choice (rank 1 at times under
    load). Exactly one rank gives `first_line` as the full report (the first whose report
    came, FIRED_KEY). The other either gives the same line as a second report or, when its
    poll found the first report's ABORT_KEY before it read the verdict, stops quoting that
    line: both are the watchdog's. Returns the rank that gave the full report."""
    full = re.findall(rf"^\[watchdog rank (\d+)\] {first_line}$", log, re.M)
    assert len(full) == 1 and full[0] in ("0", "1"), log[-4000:]
    first, other = int(full[0]), 1 - int(full[0])
    assert re.search(rf"^\[watchdog rank {other}\] (?:{first_line} \(another rank's watchdog "
                     rf"reported it first\)|stopping [^\n]*, because another rank's watchdog "
                     rf"fired:\n  \[watchdog rank {first}\] {first_line})$", log, re.M), \
        log[-4000:]
    return first


@pytest.mark.slow
def test_a_rank_stuck_in_the_tied_embedding_all_reduce_is_named_in_bounded_time(tmp_path):
    """pp2 with tied word embeddings: after the gradient reduction the first and last
    stage sum their embedding gradients (the embedding group). Rank 1 (the last stage)
    stops in its second one, inside the step, before issuing it. That all-reduce was not
    watched: rank 0 waited in it until the process group's own timeout (+1 minute) and
    died with gloo's error naming no rank. Now a watchdog names rank 1 and the phase
    after --distributed-timeout-minutes, comparing the collectives each member issued
    (both entered the block: either rank may report), and every process ends with 124,
    no traceback."""
    log, statuses, seconds = run_with_fault(
        tmp_path, "megatron.core.models.gpt.stages", "allreduce_embedding_grads", "sleep",
        ["--pipeline-model-parallel-size", "2", "--train-iters", "20"], call=2)
    stuck = log[log.index("rank 1's main thread is here"):]
    assert "time.sleep(300)" in stuck.split("\n\n")[0], log[-4000:]
    _assert_reported_once(log, r"collective tied word-embedding gradient all-reduce "
                               r"\(embedding group: first and last pipeline stage\) did not "
                               r"complete within 3 s at iteration 1; ranks that did not "
                               r"arrive: \[1\]")
    assert re.search(r"rank 1 has issued \d+ collectives on its group and rank 0 \d+: rank 1 "
                     r"did not reach the collective the others wait in", log), log[-4000:]
    assert statuses and set(statuses.values()) == {EXIT_CODE}, statuses
    assert seconds < 45
    assert not re.search(r'File ".*(/megatron/|pretrain_gpt)', log), log[-4000:]


# A rank sleeps inside one micro-batch of the schedule: (args, function, its call that
# sleeps, the rank). pp2: rank 1 in its attention (`sdpa_backend`, every layer's forward;
# one layer per stage, 4 calls an iteration) in iteration 3's micro-batch 2; tp2: rank 1
# in iteration 2's micro-batch 1, at its second layer (8 calls an iteration); pp2, last
# backward: rank 0 in iteration 3's micro-batch 3 backward, its last action.
IN_SCHEDULE = {
    "pp2": (["--pipeline-model-parallel-size", "2"],
            "megatron.core.models.gpt.transformer", "sdpa_backend", 11, 1),
    "tp2": (["--tensor-model-parallel-size", "2"],
            "megatron.core.models.gpt.transformer", "sdpa_backend", 12, 1),
    "pp2, last backward": (["--pipeline-model-parallel-size", "2"],
                           "torch.autograd", "backward", 12, 0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(IN_SCHEDULE))
def test_a_rank_stuck_in_a_micro_batch_is_named_in_bounded_time(tmp_path, case):
    """A rank hangs inside a micro-batch's forward or backward. pp2: rank 0 (stage 0)
    waits for its transfers with stage 1; tp2: rank 0 waits in the tensor-parallel
    all-reduce after the attention, inside the same forward; last backward: rank 1 (the
    last stage) waits in the broadcast of the loss. None of these waits was watched: the
    waiting rank died at the process group's timeout (+1 minute) with gloo's error naming
    no rank, and on another node nothing ended the stuck one. Now a watchdog line names
    the stuck rank and the phase after --distributed-timeout-minutes (3 s here); the
    stuck rank says where it is; every process ends with 124 and no traceback."""
    args, module, name, call, rank = IN_SCHEDULE[case]
    log, statuses, seconds = run_with_fault(tmp_path, module, name, "sleep",
                                            args + ["--train-iters", "20"], call=call, rank=rank)
    stuck = log[log.index(f"rank {rank}'s main thread is here"):]
    assert "time.sleep(300)" in stuck.split("\n\n")[0], log[-4000:]
    if case == "tp2":  # both deadlines pass; the first to report gives the details
        _assert_reported_once(log, r"collective micro-batch 1 forward did not complete within "
                                   r"3 s at iteration 1; ranks that did not arrive: \[1\]")
        counts = re.search(r"every rank entered it, but rank 1 has issued (\d+) collectives on "
                           r"its group and rank 0 (\d+): rank 1 did not reach the collective "
                           r"the others wait in", log)
        assert counts and int(counts[2]) == int(counts[1]) + 1, log[-4000:]
    else:
        waiting, phase, report = (
            (0, "micro-batch 2 forward (pipeline stage 1)",
             r"collective pipeline transfers \(micro-batch 3 activation from pipeline stage 0 "
             r"to 1, micro-batch 2 gradient from pipeline stage 1 to 0\) did not complete within "
             r"3 s at iteration 2; ranks that did not arrive: \[1\]\n  rank 1 reached "
             r"'micro-batch 3 activation from pipeline stage 0 to 1' 2 times by its last "
             r"published check-ins \(published every [0-9.]+ s, so it may have got "
             r"further\); this rank is at its call number 3") if case == "pp2" else
            (1, "micro-batch 3 backward (pipeline stage 0)",
             r"collective loss broadcast \(pipeline group\) did not complete within 3 s at "
             r"iteration 2; ranks that did not arrive: \[0\]"))
        assert re.search(rf"\[watchdog rank {waiting}\] {report}", log), log[-4000:]
        assert (f"[watchdog rank {rank}] stopping at iteration 2, in {phase}, in no watched "
                "collective, because another rank's watchdog fired:") in log, log[-4000:]
    # the first to report waits for the others to see it; torchrun may end it first (SIGTERM)
    assert statuses and set(statuses.values()) == {EXIT_CODE}, statuses
    if case != "tp2":  # the stuck rank ends as soon as it sees the report
        assert statuses[rank] == EXIT_CODE, statuses
    assert seconds < 45
    assert not re.search(r'File ".*(/megatron/|pretrain_gpt)', log), log[-4000:]  # no traceback


# After the gradient reduction: (args, module, function, its call that sleeps on rank 1,
# the watchdog's first line on rank 0, whether rank 1 sleeps inside the watched block).
# dp2 distributed optimizer: rank 1 in its 3rd grad norm (one an iteration, iteration 3),
# inside the optimizer step, before the norm's all-reduce over all ranks; or in its 2nd
# step after that all-reduce, before the parameter all-gather over the data-parallel
# group (level with rank 0 on all ranks' group, behind on the data-parallel one). dp2: rank 1
# before its 2nd loss average. tp2 sequence parallel: rank 1 in its 2nd layer-norm/bias
# gradient all-reduce, inside the block before its collective.
AFTER_GRADS = {
    "grad norm": (["--use-distributed-optimizer"],
                  "megatron.core.optimizer.clip_grads", "_global_norm", 3,
                  r"collective optimizer step \(grad-norm all-reduce over all ranks, parameter "
                  r"all-gather over the data-parallel group\) did not complete within 3 s at "
                  r"iteration 2; ranks that did not arrive: \[1\]", True),
    "parameter all-gather": (["--use-distributed-optimizer"],
                             "megatron.core.optimizer.distrib_optimizer",
                             "DistributedOptimizer._start_param_gather", 2,
                             r"collective optimizer step \(grad-norm all-reduce over all ranks, "
                             r"parameter all-gather over the data-parallel group\) did not "
                             r"complete within 3 s at iteration 1; ranks that did not arrive: "
                             r"\[1\]", True),
    "loss average": ([], "megatron.train_step", "_average_loss", 2,
                     r"collective loss average \(data-parallel group\) did not complete within "
                     r"3 s at iteration 1; ranks that did not arrive: \[1\]\n  rank 1 reached "
                     r"'loss average \(data-parallel group\)' 1 times by its last published "
                     r"check-ins \(published every [0-9.]+ s, so it may have got further\); "
                     r"this rank is at its call number 2", False),
    "sequence parallel": (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                          "megatron.train_step", "allreduce_sequence_parallel_grads", 2,
                          r"collective sequence-parallel layer-norm and bias gradient "
                          r"all-reduce \(tensor-parallel group\) did not complete within 3 s at "
                          r"iteration 1; ranks that did not arrive: \[1\]", True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(AFTER_GRADS))
def test_a_rank_stuck_after_the_gradient_reduction_is_named_in_bounded_time(tmp_path, case):
    """Rank 1 hangs after the gradient reduction: in the optimizer step before its
    grad-norm all-reduce, or after it before the parameter all-gather (watched, but
    counted on all ranks' group only, where rank 1 was level: the block's deadline was
    moved on until the process group's timeout), before the loss average, or in the
    sequence-parallel gradient all-reduce. Before, rank 0 waited in the collective until
    the process group's own timeout (--distributed-timeout-minutes + 1 minute, past this
    test's limit) and died with gloo's error naming no rank. Now a watchdog names rank 1
    and the phase after --distributed-timeout-minutes (3 s here) -- rank 0's, or, when
    rank 1 sleeps inside the block, either rank's, by the collectives each issued --,
    rank 1 says where it is stuck, and every process ends with 124, no traceback."""
    args, module, name, call, first_line, inside = AFTER_GRADS[case]
    log, statuses, seconds = run_with_fault(tmp_path, module, name, "sleep",
                                            args + ["--train-iters", "20"], call=call)
    if inside:  # rank 1's deadline in the block passes too
        _assert_reported_once(log, first_line)
        group = {"grad norm": "all ranks",  # the distributed optimizer's groups are named
                 "parameter all-gather": "the data-parallel group"}.get(case, "its group")
        assert re.search(rf"rank 1 has issued \d+ collectives on {group} and rank 0 \d+: "
                         r"rank 1 did not reach the collective the others wait in", log), \
            log[-4000:]
    else:
        assert re.search(r"\[watchdog rank 0\] " + first_line, log), log[-4000:]
        assert re.search(r"\[watchdog rank 1\] stopping at iteration 1, in no watched "
                         r"collective, because another rank's watchdog fired:", log), log[-4000:]
    _assert_rank_1_shown_and_all_ended(log, statuses, seconds)


@pytest.mark.slow
def test_a_rank_stuck_before_the_overlapped_parameter_all_gather_is_named(tmp_path):
    """dp2, distributed optimizer, --overlap-param-gather: rank 1 stops in its 2nd step
    after the grad-norm all-reduce, before it launches the parameter all-gather. Rank 0
    launched its own and left the step; the next forward waits for it, at tp 1 in no
    watched block. Before, only rank 1's own overrun of the step ended the run, naming no
    rank (rank 0 had left the step), and rank 0 said it was in no watched collective. Now
    that wait is watched: rank 0 names rank 1 after --distributed-timeout-minutes, rank 1
    (named, inside its step's block) says where it is, every process ends with 124, no
    traceback."""
    log, statuses, seconds = run_with_fault(
        tmp_path, "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._start_param_gather", "sleep",
        ["--use-distributed-optimizer", "--overlap-param-gather", "--log-interval", "100",
         "--train-iters", "20"], call=2)
    assert re.search(r"\[watchdog rank 0\] collective parameter all-gather of the optimizer "
                     r"step, waited for in the forward \(data-parallel group, "
                     r"--overlap-param-gather\) did not complete within 3 s at iteration 2; "
                     r"ranks that did not arrive: \[1\]", log), log[-4000:]
    _assert_rank_1_shown_and_all_ended(log, statuses, seconds)


@pytest.mark.slow
def test_at_tp_2_the_rank_upstream_of_the_overlapped_parameter_all_gather_is_named(tmp_path):
    """tp2 dp2 (4 ranks), the same stop on rank 3. Its data-parallel partner, rank 1,
    waits for the all-gather in its next forward, a block nested in the forward's (over
    the tensor-parallel group (0, 1)), so rank 1 has issued one tensor-parallel collective
    fewer than rank 0: the forward's overrun named rank 1. Now a rank behind that waits
    in a nested watched block is left to that block's overrun: every report names rank 3."""
    log, statuses, seconds = run_with_fault(
        tmp_path, "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer._start_param_gather", "sleep",
        ["--use-distributed-optimizer", "--overlap-param-gather", "--log-interval", "100",
         "--train-iters", "20", "--tensor-model-parallel-size", "2"], call=2, rank=3, world=4)
    named = re.findall(r"ranks that did not arrive: \[([\d, ]*)\]", log)
    assert named and set(named) == {"3"}, log[-6000:]
    # the ranks the report does not name wait for rank 3 to say where it is
    stuck = log[log.index("rank 3's main thread is here"):]
    assert "time.sleep(300)" in stuck.split("\n\n")[0], log[-4000:]
    assert statuses and set(statuses.values()) == {EXIT_CODE}, statuses
    assert seconds < 45
    assert not re.search(r'File ".*(/megatron/|pretrain_gpt)', log), log[-4000:]


# --------------------------------------------------------------------------- a rank stops
@pytest.mark.slow
@pytest.mark.parametrize("action", ["raise", "kill"])
def test_the_other_node_names_the_rank_that_stopped_in_one_line(tmp_path, action):
    """Rank 1, on a second node, fails in the evaluation at iteration 4 (an exception, or
    SIGKILL). Rank 0's evaluation reduction then fails with gloo's 'Connection closed (or
    reset) by peer'; it printed that error's traceback, naming neither rank 1 nor the phase. Now it
    prints one line: where the run was, the rank that stopped first and its error (or that
    none reported one: killed), and the checkpoint to resume from; status 1."""
    ckpt = tmp_path / "ck"
    args = ["--train-iters", "20", "--eval-interval", "4", "--eval-iters", "1",
            "--save", str(ckpt), "--save-interval", "2"]
    (node0, node1), statuses, seconds = run_with_fault(
        tmp_path, "megatron.training", "evaluate", action, args, nodes=2)
    assert seconds < 40
    lines = [line for line in node0.splitlines() if line.startswith("[rank 0]")]
    assert len(lines) == 1, node0[-4000:]
    head = "[rank 0] stopped during the evaluation at iteration 4: a collective failed ("
    assert lines[0].startswith(head), lines
    if action == "raise":
        assert ("because rank 1 stopped first, during the evaluation at iteration 4, with "
                f"RuntimeError: injected failure in evaluate -- its traceback is in "
                f"{tmp_path / 'torchrun1.log'} on {socket.gethostname()}") in lines[0]
        assert "RuntimeError: injected failure in evaluate" in node1  # rank 1's traceback
        assert statuses == {0: 1, 1: 1}
    else:
        assert "none reported an error: it was killed" in lines[0]
        assert statuses == {0: 1}
    # the evaluation at 4 comes before the save at 4
    assert lines[0].endswith(f"; the last checkpoint is {ckpt}/iter_0000002: relaunch with "
                             f"--load {ckpt} to resume from it")
    assert not re.search(r'File ".*(/megatron/|pretrain_gpt)', node0), node0[-4000:]
    assert read_tracker(str(ckpt)) == (2, False)


# --------------------------------------------------------------------------- the pieces
def test_peer_failure_recognises_the_backends_words():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
                        " Connection closed by peer [127.0.0.1]:41095. This is typically "
                        "caused by a remote worker crashing. Check the logs of the remote "
                        "worker before reporting an error. GLHF!")
    assert peer_failure(gloo) == "Connection closed by peer [127.0.0.1]:41095"
    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                           "Timed out waiting 66000ms for recv operation to complete")
    assert peer_failure(timeout) == "Timed out waiting 66000ms for recv operation to complete"
    assert peer_failure(dist.DistBackendError("NCCL communicator was aborted on rank 3")) \
        == "NCCL communicator was aborted on rank 3"
    assert peer_failure(RuntimeError("shape mismatch")) is None  # this rank's own error
    assert peer_failure(ValueError("Connection closed by peer")) is None


def test_a_survivor_names_the_first_recorded_failure():
    store = dist.HashStore()
    assert first_failure(store, wait_s=0.1) is None
    record_failure(1, "RuntimeError: CUDA error: an illegal memory access", "at iteration 7",
                   store=store)
    record_failure(3, "RuntimeError: later", "at iteration 7", store=store)
    first = first_failure(store)
    assert first == ("rank 1 stopped first, at iteration 7, with RuntimeError: CUDA error: an "
                     f"illegal memory access -- {output_place()}")
    line = peer_failure_message(0, "Connection reset by peer", "at iteration 7", first,
                                "; the last checkpoint is /ck/iter_0000006: ...")
    assert line == ("[rank 0] stopped at iteration 7: a collective failed (Connection reset by "
                    "peer) because rank 1 stopped first, at iteration 7, with RuntimeError: "
                    f"CUDA error: an illegal memory access -- {output_place()}; "
                    "the last checkpoint is /ck/iter_0000006: ...")
    timed_out = peer_failure_message(2, "Timed out waiting 66000ms", "", None, " (no --save)")
    assert timed_out == ("[rank 2] stopped: a collective timed out (Timed out waiting 66000ms): "
                         "another rank did not take part in time (stuck, or in another "
                         "collective; its own output says where) (no --save)")


def test_the_line_says_where_the_failing_ranks_traceback_is(tmp_path):
    """'-- its traceback is in its output' was said of every launch, also where that output
    is a file the user must find (torchrun --redirect/--tee/--log-dir: stderr.log under a
    temporary directory) or was dropped (torchrun --local-ranks-filter: /dev/null)."""
    log = tmp_path / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    with open(log, "w") as f:
        assert output_place(f.fileno(), "node7") == f"its traceback is in {log} on node7"
    with open("/dev/null", "w") as f:
        place = output_place(f.fileno(), "node7")
    assert place.startswith("its traceback was not kept: its stderr is /dev/null")
    assert "--local-ranks-filter" in place and "--log-dir DIR --redirect 3" in place
    read_end, write_end = os.pipe()
    try:
        assert output_place(write_end, "node7") == "its traceback is in its output (stderr on node7)"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_survivor_waits_for_a_record_as_long_as_WAIT_FOR_RECORD_S(monkeypatch):
    """The wait is read when a survivor looks, not when the module was loaded: set to 0,
    one look at the store (its failure record, then a watchdog's report) and no wait."""
    import megatron.rank_failure as rank_failure

    looked = []

    class CountingStore(dist.HashStore):
        def check(self, keys):
            looked.append(keys)
            return super().check(keys)

    monkeypatch.setattr(rank_failure, "WAIT_FOR_RECORD_S", 0.0)
    assert first_failure(CountingStore()) is None
    assert len(looked) == 2, looked


def test_each_torchrun_agent_of_a_shared_host_prints_its_line(monkeypatch):
    """Two torchrun agents of one job on one host (`--nnodes 2` on one machine): rank 2,
    of agent 1, meets the failure first and takes the count, then is ended by its agent
    before it prints. Rank 0, of agent 0, carried no line (the count was per host name):
    that agent's ranks left in silence after 30 s. Now each agent's first rank prints."""
    import megatron.rank_failure as rank_failure

    store = dist.HashStore()
    monkeypatch.setattr(rank_failure, "_default_store", lambda: store)
    monkeypatch.setattr(rank_failure, "WAIT_FOR_RECORD_S", 0.0)
    gloo = RuntimeError("Connection closed by peer [127.0.0.1]:41095")
    no_launcher = {"LOCAL_RANK": "0"}  # no waiting for a printing rank
    agent = lambda n: dict(no_launcher, GROUP_RANK=str(n))  # noqa: E731
    first = rank_failure.stopped_by_peer(gloo, 2, "at iteration 7", env=agent(1))
    second = rank_failure.stopped_by_peer(gloo, 3, "at iteration 7", env=agent(1))
    other = rank_failure.stopped_by_peer(gloo, 0, "at iteration 7", env=agent(0))
    assert str(first.code).startswith("[rank 2] stopped at iteration 7: a collective failed")
    assert second.code == 1  # the same agent's second rank leaves it to rank 2
    assert str(other.code).startswith("[rank 0] stopped at iteration 7: a collective failed")
    assert rank_failure.launcher_node(agent(1)) != rank_failure.launcher_node(agent(0))
    assert rank_failure.launcher_node(no_launcher) == socket.gethostname()  # srun, by hand


def test_what_is_recorded_and_what_is_not():
    from megatron.agreed_exit import AgreedExit

    assert describe_failure(RuntimeError("boom\nmore")) == "RuntimeError: boom"
    assert describe_failure(SystemExit("error: bad file")) == "error: bad file"
    assert describe_failure(SystemExit(3)) == "exit status 3"
    assert describe_failure(SystemExit(0)) is None
    assert describe_failure(AgreedExit("error: every rank", 1, 2)) is None


# --------------------------------------------------------------------------- generation
# tools/generate.py on two nodes (one torchrun each) at tensor-parallel size 2; rank 1's
# {call}th all-reduce (mid-decoding) raises or sleeps. The process group's timeout (what
# ends rank 0 here: decoding has no watched collectives) is STARTUP_TIMEOUT_S through
# start-up, as the watchdog's in the training cases (its collectives: the groups' set-up,
# the checkpoint load's), and 3 s once the model is loaded; the watchdog's grace after a
# lost store is cut to 2 s.
GENERATE_FAULT = """
import datetime, os, runpy, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
import megatron.initialize as initialize
import megatron.watchdog as watchdog
import tools.generate_tp as generate_tp
watchdog.STORE_GRACE_S = 2.0
watchdog.POLL_S = {poll_s!r}
initialize.datetime = type("D", (), dict(
    timedelta=lambda **k: datetime.timedelta(seconds={startup_s!r})))
_load = generate_tp.load_model_tp

def load_model_tp(*args, **kwargs):
    loaded = _load(*args, **kwargs)
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=3), group)
    return loaded

generate_tp.load_model_tp = load_model_tp
original, calls = dist.all_reduce, [0]

def faulty(*args, **kwargs):
    calls[0] += 1
    if calls[0] == {call} and os.environ["RANK"] == "1":
        print("test: {action} rank 1 mid-decoding", flush=True)
        if {action!r} == "sleep":
            time.sleep(300)
        raise RuntimeError("injected failure mid-decoding")
    return original(*args, **kwargs)

dist.all_reduce = faulty
script = os.path.join({root!r}, "tools", "generate.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    from tests.test_generate import _train

    path = tmp_path_factory.mktemp("ck")
    _train(path, "--make-vocab-size-divisible-by 32", steps=1)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["raise", "sleep"])
def test_generate_on_two_nodes_when_rank_1_fails_or_hangs(tmp_path, small_ckpt, action):
    """Rank 1 raises: rank 0 printed gloo's 'Connection closed by peer' traceback; now one
    line naming rank 1 and its error. Rank 1 hangs: rank 0 ends at the collective timeout
    (now one line) and, with it, node 0's torchrun and the job's store; rank 1 slept on
    for ever on its node. Now its watchdog sees the store gone and ends it (status 124),
    printing where it was stuck."""
    wrapper = tmp_path / "generate_fault.py"
    wrapper.write_text(GENERATE_FAULT.format(root=str(ROOT), call=30, action=action,
                                             poll_s=LINGER_POLL_S, startup_s=STARTUP_TIMEOUT_S))
    port = free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
             "--master-port", str(port), str(wrapper), "--load", small_ckpt,
             "--tensor-model-parallel-size", "2", "--prompt", "5 6 7", "--max-new-tokens",
             "10", "--greedy", "--no-stop-at-eod"] for node in (0, 1)]
    (node0, node1), seconds = run_agents(tmp_path, cmds, 60)
    assert seconds < 45
    assert "test: " + action in node1, node1[-3000:]
    lines = [line for line in node0.splitlines() if line.startswith("[rank 0]")]
    assert len(lines) == 1, node0[-4000:]
    assert not re.search(r'File ".*(/megatron/|/tools/)', node0), node0[-4000:]
    if action == "raise":
        assert lines[0].startswith("[rank 0] stopped during generation: a collective failed (")
        assert lines[0].endswith("because rank 1 stopped first, during generation, with "
                                 "RuntimeError: injected failure mid-decoding -- its "
                                 f"traceback is in {tmp_path / 'torchrun1.log'} on "
                                 f"{socket.gethostname()}"), lines
        return
    assert lines[0].startswith("[rank 0] stopped during generation: a collective timed out (")
    assert ("[watchdog rank 1] stopping, in no watched collective, because the job has ended "
            "elsewhere:\n  the job's rendezvous store stopped answering") in node1, node1[-3000:]
    stuck = node1[node1.index("rank 1's main thread is here"):]
    assert "time.sleep(300)" in stuck, node1[-3000:]
    assert "exitcode  : 124" in node1
