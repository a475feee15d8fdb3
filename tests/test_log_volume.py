"""The output of a run does not grow with its data-parallel size where every rank would
say the same thing: at 1,000-8,000 ranks each such line is thousands of lines of the job's
log, and the one that matters is lost among them.

Fast: the pieces -- the first rank to report a failure (a count in the job's store), an
error every rank raises alike printed by one (warnings alike: tests/test_initialize.py), the out-of-memory report of the ranks after
the first one line each, a peer's failure and the watchdog's echoes left to the ranks that
speak for a node.

Slow (torchrun, gloo): the lines the ranks print (torchrun's --redirects: each rank's
stdout and stderr in files of their own, without the launcher's lines) at world size 1 or 2
against 4, for start-up to a normal exit and for failures: the same error on every rank,
one rank failing, NaN losses everywhere, every rank out of memory, a stalled rank; and a
warning every rank gives.
torchrun's own summary (some lines per failed rank) is the launcher's and is not counted.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron import oom_report
from megatron.agreed_exit import AgreedExit
from megatron.rank_failure import first_to_report, repeated_failure, stopped_by_peer
from megatron.watchdog import CollectiveWatchdog
from tests import forked_script
from tests.dist_utils import cpu_env, free_port
from tests.test_preemption import MODEL

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- fast
def test_the_first_rank_to_report_a_topic_is_named_to_the_others():
    store = dist.HashStore()
    assert first_to_report("disk full", 3, store) is None  # rank 3 prints
    assert first_to_report("disk full", 5, store) == 3
    assert first_to_report("disk full", 0, store) == 3
    assert first_to_report("another error", 5, store) is None


def test_an_error_every_rank_raises_alike_is_left_to_the_first():
    """The second rank raising the same error leaves in silence (status 1); another
    message, an exception of another type, an AgreedExit (rank 0 prints it) and a single
    process are raised as they are."""
    store = dist.HashStore()
    message = SystemExit("error: the validation set would run out of data")
    assert repeated_failure(message, 2, 4, {}, store) is None
    again = repeated_failure(SystemExit(message.code), 0, 4, {}, store)
    assert isinstance(again, SystemExit) and again.code == 1
    assert repeated_failure(SystemExit("error: something else"), 0, 4, {}, store) is None
    assert repeated_failure(ValueError(message.code), 1, 4, {}, store) is None  # another type
    assert isinstance(repeated_failure(ValueError(message.code), 3, 4, {}, store), SystemExit)
    assert repeated_failure(AgreedExit("error: x", 1, 4), 1, 4, {}, store) is None
    assert repeated_failure(SystemExit(1), 1, 4, {}, store) is None  # prints nothing anyway
    assert repeated_failure(SystemExit("error: y"), 0, 1, {}, store) is None


def test_a_peer_failure_is_one_line_from_the_first_rank_of_each_host(monkeypatch):
    """The ranks whose collective another rank broke: the first of this host says so
    (a count in the job's store), the next exits with status 1 and no message; without
    an answer from the store (lost with the host that held it), `prints` decides (rank 0
    and each node's first process)."""
    from megatron import rank_failure

    gone = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:4242")
    store = dist.HashStore()
    monkeypatch.setattr(rank_failure, "_default_store", lambda: store)
    monkeypatch.setattr(rank_failure, "first_failure", lambda: "rank 3 stopped first, "
                        "with RuntimeError: injected")
    first = stopped_by_peer(gone, 5, "at iteration 3", prints=False)
    assert str(first.code).startswith("[rank 5] stopped at iteration 3: a collective failed "
                                      "(Connection closed by peer [127.0.0.1]:4242) because "
                                      "rank 3 stopped first"), first.code
    second = stopped_by_peer(gone, 0, "at iteration 3", prints=True)
    assert isinstance(second, SystemExit) and second.code == 1
    monkeypatch.setattr(rank_failure, "_default_store", lambda: None)
    assert stopped_by_peer(gone, 6, "at iteration 3", prints=False).code == 1
    assert str(stopped_by_peer(gone, 0, "at iteration 3", prints=True).code).startswith(
        "[rank 0] stopped")


def test_a_rank_leaving_the_peer_line_to_another_waits_for_it_under_a_launcher(monkeypatch):
    """The silent ranks exited at once, and the launcher, seeing them fail, ended the rank
    that was to print (it waits up to a second for the failed rank's record; torchrun
    looks every 0.1 s): a host whose ranks met the failure could print nothing. They now
    wait under a launcher, as the ranks leaving an error to another do."""
    import megatron.arguments
    from megatron import rank_failure

    gone = RuntimeError("Connection closed by peer [127.0.0.1]:4242")
    store, waits = dist.HashStore(), []
    monkeypatch.setattr(rank_failure, "_default_store", lambda: store)
    monkeypatch.setattr(rank_failure, "first_failure", lambda: None)
    monkeypatch.setattr(rank_failure, "_world_size", lambda: 4)
    monkeypatch.setattr(megatron.arguments, "wait_for_printing_rank",
                        lambda world, env: waits.append((world, dict(env))))
    env = {"TORCHELASTIC_RUN_ID": "job"}
    assert str(stopped_by_peer(gone, 1, "at iteration 3", env=env).code).startswith("[rank 1]")
    assert waits == []  # the rank that prints does not wait
    assert stopped_by_peer(gone, 0, "at iteration 3", env=env).code == 1
    assert waits == [(4, env)]


def _ps(rank, world_size=8):
    return SimpleNamespace(rank=rank, world_size=world_size, tp_rank=0, tp_size=1, pp_rank=0,
                           pp_size=1, dp_rank=rank, dp_size=world_size)


def test_the_ranks_out_of_memory_after_the_first_print_one_line(monkeypatch, capsys):
    from tests.gpt_helpers import tiny_config

    config = tiny_config(iters=4)
    rt = SimpleNamespace(ps=_ps(5), device=torch.device("cpu"))
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    monkeypatch.setattr(oom_report, "first_to_report", lambda topic, rank: 2)
    with pytest.raises(oom_report.OutOfMemoryExit):
        with oom_report.OomReport(config, rt):
            raise error
    err = capsys.readouterr().err
    assert err.startswith("[rank 5] out of GPU memory in setting up, as rank 2 (its report "
                          "says what may help); host memory of this process: resident "), err
    assert err.count("\n") == 1
    monkeypatch.setattr(oom_report, "first_to_report", lambda topic, rank: None)
    with pytest.raises(oom_report.OutOfMemoryExit):
        with oom_report.OomReport(config, rt):
            raise error
    assert "what may help here" in capsys.readouterr().err  # the first: the whole report


def test_watchdog_echoes_are_left_to_the_ranks_that_announce():
    """Ranks 0 and 2 wait for rank 1; rank 2, which does not announce, leaves its echo of
    rank 0's report out, and so does rank 3, waiting in the block when the report comes;
    rank 1, the one stuck (in no watched block), still says where it is."""
    import contextlib
    import time

    store = dist.HashStore()
    fired = {}

    def wd(rank, timeout, poll):
        return CollectiveWatchdog(store, rank, 4, timeout, poll_s=poll, announces=rank == 0,
                                  on_timeout=lambda m, r=rank: fired.setdefault(r, m))
    dogs = [wd(0, 0.3, 10.0), wd(2, 0.4, 10.0), wd(3, 30.0, 0.1), wd(1, 30.0, 0.1)]
    with contextlib.ExitStack() as blocks:
        for dog in dogs[:3]:
            blocks.enter_context(dog.watch("grads", ranks=[0, 1, 2, 3]))
        time.sleep(1.0)
    for dog in dogs:
        dog.close()
    assert fired[0].startswith("[watchdog rank 0] collective grads did not complete")
    assert fired[2] == "" and fired[3] == ""
    assert fired[1].startswith("[watchdog rank 1] stopping, in no watched collective")
    assert "rank 1's main thread is here" in fired[1]


# --------------------------------------------------------------------------- torchrun
# Runs pretrain_gpt.py with megatron.training.{name} failing from its {call}-th call on
# the ranks in {ranks} (None: every rank): "raise" a RuntimeError, "warn" (a UserWarning,
# and no failure), "sleep" (a stalled rank;
# the collective timeout is shortened to seconds), or make the model's forward raise
# torch's out-of-memory error ("oom") or return NaN losses ("nan") in that call.
WRAPPER = """
import dataclasses, os, runpy, sys, time
import torch
sys.path.insert(0, {root!r})
import megatron.arguments as arguments
import megatron.training as training
from megatron.core.models.gpt.gpt_model import GPTModel
_parse = arguments.parse_and_validate

def parse_and_validate(*args, **kwargs):
    config = _parse(*args, **kwargs)
    config.parallel = dataclasses.replace(config.parallel, distributed_timeout_minutes=0.05)
    return config

arguments.parse_and_validate = parse_and_validate
original, forward, calls, armed = getattr(training, {name!r}), GPTModel.forward, [0], [False]
hit = {ranks!r} is None or int(os.environ["RANK"]) in {ranks!r}

def faulty(*args, **kwargs):
    calls[0] += 1
    armed[0] = calls[0] >= {call} and hit
    if armed[0] and {action!r} == "sleep":
        time.sleep(120)
    if armed[0] and {action!r} == "raise":
        raise RuntimeError("injected failure in {name}")
    if armed[0] and {action!r} == "warn":
        import warnings
        warnings.warn("injected warning in {name}")
    return original(*args, **kwargs)

def failing_forward(self, *args, **kwargs):
    if armed[0] and {action!r} == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    out = forward(self, *args, **kwargs)
    return out * float("nan") if armed[0] and {action!r} == "nan" else out

setattr(training, {name!r}, faulty)
GPTModel.forward = failing_forward
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""

FAILURES = {  # name: (megatron.training's function, from its call, ranks, action, flags)
    "the same error on every rank": ("train_step", 2, None, "raise", []),
    "one rank fails": ("train_step", 2, "last", "raise", []),
    "NaN on every replica": ("train_step", 2, None, "nan", []),
    "every rank out of memory": ("train_step", 2, None, "oom", []),
    "a stalled rank": ("evaluate", 1, "last", "sleep", ["--eval-interval", "2"]),
}


def _wrapper(tmp_path: Path, failure: str, world_size: int) -> Path:
    name, call, ranks, action, _ = FAILURES.get(failure, ("train_step", 2, None, failure, []))
    ranks = [world_size - 1] if ranks == "last" else ranks
    script = tmp_path / f"wrapper_{world_size}.py"
    script.write_text(WRAPPER.format(root=str(ROOT), name=name, call=call, ranks=ranks,
                                     action=action, script=str(ROOT / "pretrain_gpt.py")))
    return script


def rank_outputs(tmp_path: Path, world_size: int, args: list, script=None) -> tuple:
    """pretrain_gpt.py (or `script`) under torchrun with `world_size` ranks, each rank's
    stdout and stderr redirected to files of their own (torchrun's lines stay out).
    (exit status, [each rank's output])."""
    logs = tmp_path / f"logs_{world_size}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--log-dir", str(logs), "--redirects", "3",
           str(script or ROOT / "pretrain_gpt.py"), *MODEL, *args]
    # torchrun forked from this process (tests/forked_script.py: its imports come free;
    # its ranks stay fresh processes); its own lines go to a file nobody counts
    pid = forked_script.start_command(cmd, cpu_env(PYTHONUNBUFFERED="1"),
                                      tmp_path / f"torchrun_{world_size}.log")
    [status] = forked_script.wait([pid], 300)
    outs = []
    for rank in range(world_size):
        files = sorted(logs.glob(f"*/attempt_0/{rank}/std*.log"))
        outs.append("".join(f.read_text() for f in files))
    return status, outs


PEER_LINE = re.compile(r"^\[rank \d+\] stopped .*: a collective", re.M)
# a rank out of memory after the first: one line of its own figures, if torchrun has not
# ended it first (the first rank's exit and the others' one-liners race)
OOM_LINE = re.compile(r"^\[rank \d+\] out of GPU memory in .*, as rank \d+ ", re.M)


def _lines(outs: list) -> int:
    return sum(len(out.splitlines()) for out in outs)


@pytest.fixture(scope="module")
def normal_runs(tmp_path_factory) -> dict:
    """Runs to a normal exit (evaluations, saves) on 1 and on 4 ranks, every rank giving
    the same UserWarning from its second step on; one pair of launches serves both tests
    below. {world size: (exit status, [each rank's output])}."""
    tmp_path = tmp_path_factory.mktemp("normal_exit")
    args = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
            "--save-interval", "2"]
    return {world: rank_outputs(tmp_path, world, [*args, "--save", str(tmp_path / f"ck{world}")],
                                _wrapper(tmp_path, "warn", world))
            for world in (1, 4)}


@pytest.mark.slow
def test_start_up_to_a_normal_exit_prints_as_much_on_4_ranks_as_on_1(normal_runs):
    (status1, one), (status4, four) = normal_runs[1], normal_runs[4]
    assert status1 == status4 == 0, (one, four)
    assert "validation loss at iteration 4" in "".join(four)
    assert _lines(four) == _lines(one), (one, four)


@pytest.mark.slow
def test_a_warning_every_rank_gives_shows_once(normal_runs):
    status, outs = normal_runs[4]
    assert status == 0, outs
    assert "".join(outs).count("UserWarning: injected warning in train_step") == 1, outs


@pytest.mark.slow
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failure_is_explained_once_on_4_ranks_as_on_2(tmp_path, failure, monkeypatch):
    """Old output per extra rank: a traceback (the same error), a line naming the rank
    that stopped (one rank fails), a line naming its replica and the error again (NaN), the
    whole out-of-memory report, an echo of the watchdog's report. Now: nothing, except
    one line per rank that ran out of memory (its own figures). Torchrun forks the ranks
    from itself (forked_script.fork_torchrun_workers: some 3 s of imports saved per rank;
    what fresh ranks print at start-up is the normal runs' to check)."""
    forked_script.fork_torchrun_workers(monkeypatch)
    args = ["--train-iters", "6", "--eval-iters", "1", *FAILURES[failure][4]]
    counts, peer_lines, oom_lines = {}, {}, {}
    for world_size in (2, 4):
        status, outs = rank_outputs(tmp_path, world_size, args,
                                    _wrapper(tmp_path, failure, world_size))
        assert status != 0, outs
        # whether rank 0 gets to say that a peer stopped before torchrun ends it is a race
        peer_lines[world_size] = sum(len(PEER_LINE.findall(out)) for out in outs)
        oom_lines[world_size] = sum(len(OOM_LINE.findall(out)) for out in outs)
        counts[world_size] = _lines(outs) - peer_lines[world_size] - oom_lines[world_size]
    text = "\n".join(outs)  # the 4 ranks'
    assert peer_lines[4] <= 1, text
    assert text.count("what may help here") <= 1 and text.count("Traceback") <= 1, text
    if failure == "every rank out of memory":  # one line per extra rank: its own figures
        assert text.count("what may help here") == 1, text
        assert oom_lines[4] <= 3 and counts[4] == counts[2], (counts, oom_lines, text)
    elif failure == "a stalled rank":  # rank 0 echoes the report of rank 1 or 2, or gives it
        assert counts[4] - counts[2] <= 2, (counts, text)
        assert sum("[watchdog rank" in out for out in outs) <= 3, text
    else:
        assert oom_lines[4] == 0 and counts[4] == counts[2], (counts, text)
