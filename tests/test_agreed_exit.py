"""Load-time errors under several ranks: every rank exits (status 1), rank 0 alone prints the
message, naming the ranks that met it unless all did; no rank is left waiting in a
collective. In a single process the message is printed as before (megatron/agreed_exit.py)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from megatron import arguments
from megatron.agreed_exit import (
    AgreedExit,
    agree,
    agreed_report,
    exit_on_every_rank,
    rank_ranges,
    silent_ranks_wait,
)
from tests import forked_script
from tests.dist_utils import cpu_env, free_port, run_distributed
from tests.forked_script import PRETRAIN

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
        "--use-distributed-optimizer", "--tensor-model-parallel-size", "2",
        "--eval-iters", "0"]
TIMEOUT_S = 180  # a rank left waiting in a collective would hang far longer


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in arguments.LAUNCHER_ENV}
    return cpu_env(env, **extra)


def launch_two(args, tmp: Path):
    """pretrain_gpt.py as ranks 0 and 1 of 2 (env:// rendezvous, no launcher: nothing
    ends the other rank), forked from this process (tests/forked_script.py), their output
    to files under `tmp`. Returns ([rank 0's status, rank 1's], combined output)."""
    port = free_port()
    logs = [tmp / f"launch_{port}_rank{r}.log" for r in range(2)]
    pids = forked_script.start_ranks(PRETRAIN, args, _env(), port, [[log] for log in logs])
    codes = forked_script.wait(pids, TIMEOUT_S)
    return codes, "".join(log.read_text() for log in logs)


def torchrun_two(args, tmp: Path):
    """torchrun --nproc-per-node 2 pretrain_gpt.py, the launcher forked from this process
    (its workers are fresh processes), its output to files under `tmp`: (its status, its
    output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), PRETRAIN, *args]
    out, err = tmp / "torchrun.out", tmp / "torchrun.err"
    [code] = forked_script.wait([forked_script.start_command(cmd, _env(), out, err)],
                                TIMEOUT_S)
    return code, out.read_text() + err.read_text()


def torchrun_failures(out: str):
    """(root cause, every failure): (rank, exit code) pairs of torchrun's summary."""
    def pairs(text):
        found = re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)",
                           text)
        return [(int(r), int(c)) for r, c in found]

    return pairs(out.split("Root Cause")[-1])[0], pairs(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tensor-parallel-2 checkpoint at iteration 4 (two ranks), distributed optimizer."""
    root = tmp_path_factory.mktemp("agreed") / "ck"
    codes, out = launch_two(BASE + ["--save", str(root), "--save-interval", "4"], root.parent)
    assert codes == [0, 0], out
    return root


def test_schedule_mismatch_printed_once_every_rank_exits(checkpoint, tmp_path):
    codes, out = launch_two(BASE + ["--load", str(checkpoint), "--lr", "5e-4"], tmp_path)
    assert codes == [1, 1], (codes, out)
    assert out.count("optimizer-parameter-scheduler value 'max_lr' (--lr) from the "
                     "checkpoint (0.001) differs from the command line (0.0005)") == 1, out
    assert out.count("error:") == 1, out
    assert "(of 2)" not in out, out  # both ranks met it: no rank list


def test_argument_mismatch_under_torchrun_printed_once_by_rank_zero(checkpoint, tmp_path):
    code, out = torchrun_two([a if a != "64" else "128" for a in BASE]
                             + ["--load", str(checkpoint)], tmp_path)
    assert code != 0, out
    assert out.count("was saved with other model arguments than this run's") == 1, out
    assert out.count("--hidden-size: checkpoint 64, this run 128") == 1, out
    root_cause, failures = torchrun_failures(out)
    assert root_cause == (0, 1), out  # rank 0, which printed; rank 1 waited
    assert sorted(r for r, c in failures if c != 0) == [0, 1], out


def test_one_rank_unreadable_shard_named_once_no_rank_hangs(checkpoint, tmp_path):
    damaged = tmp_path / "ck"
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    code, out = torchrun_two(BASE + ["--load", str(damaged)], tmp_path)  # within TIMEOUT_S
    assert code != 0, out
    assert out.count(f"rank 1 (of 2): error: cannot read checkpoint file {shard}") == 1, out
    assert out.count("error:") == 1, out
    assert torchrun_failures(out)[0] == (0, 1), out  # the root cause: rank 0


def test_one_rank_missing_optimizer_shard_fails_after_weights_every_rank_exits(
        checkpoint, tmp_path):
    """A failure in the last step (restoring the states) on one rank only. The message
    was `checkpoint file ... not found`, without `error:` or a fix; it now names the
    checkpoint as incomplete, as the dry run does, and --no-load-optim."""
    damaged = tmp_path / "ck"
    shutil.copytree(checkpoint, damaged)
    missing = damaged / "iter_0000004" / "mp_rank_01" / "distrib_optim.pt"
    missing.unlink()
    codes, out = launch_two(BASE + ["--load", str(damaged)], tmp_path)
    assert codes == [1, 1], (codes, out)
    assert out.count(f"rank 1 (of 2): error: checkpoint {damaged / 'iter_0000004'} is "
                     "incomplete: mp_rank_01/distrib_optim.pt is missing (distrib_optim.pt "
                     "holds the optimizer state; --no-load-optim loads the checkpoint without "
                     "it, with a fresh optimizer). It was copied in part") == 1, out


def test_single_process_prints_the_message_as_before(checkpoint, tmp_path):
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    pid = forked_script.start(PRETRAIN, [*BASE[:-4], "--eval-iters", "0", "--load",
                                         str(checkpoint), "--lr", "5e-4"], _env(),
                              stdout, stderr)
    err = stderr.read_text() if forked_script.wait([pid], TIMEOUT_S) == [1] else None
    assert err is not None, stdout.read_text() + stderr.read_text()
    assert err.count(f"error: loading {checkpoint / 'iter_0000004'}: optimizer-"
                     "parameter-scheduler value 'max_lr'") == 1, err
    assert "Traceback" not in err and "(of " not in err, err


# ------------------------------------------------------------------- the utility itself
def _agree_worker(rank, world_size, errors):
    try:
        agree(errors[rank])
    except AgreedExit as exc:
        return type(exc).__name__, exc.code, str(exc)
    return None


def test_agree_on_an_error_of_one_rank():
    results = run_distributed(_agree_worker, 3, [None, "error: x", None])
    report = "rank 1 (of 3): error: x"
    assert results[0] == ("AgreedExit", report, report)  # printed when uncaught
    assert results[1] == ("AgreedExit", 1, report) and results[2] == results[1]  # silent


def test_agree_without_errors_returns_on_every_rank():
    assert run_distributed(_agree_worker, 2, [None, None]) == [None, None]


def test_single_process_raises_a_plain_system_exit():
    with pytest.raises(SystemExit) as exc:
        agree("error: x")
    assert type(exc.value) is SystemExit and exc.value.code == "error: x"
    assert agree(None, value=5) == [5]
    assert type(exit_on_every_rank("error: y")) is SystemExit


def test_report_groups_ranks_by_message():
    assert agreed_report([None, None]) is None
    assert agreed_report(["error: a", "error: a"]) == "error: a"
    assert agreed_report(["error: b", None, "error: a", "error: a", "error: b", None]) == (
        "ranks 0, 4 (of 6): error: b\nranks 2-3 (of 6): error: a")
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert rank_ranges([3]) == "rank 3"


def test_a_pair_of_messages_tells_every_rank_from_some():
    """(every, some): a file every rank rejects means other flags; one rank's alone, a bad
    file -- the report picks by whether any rank passed."""
    pair = ("error: run with other flags", "error: this file alone is bad")
    assert agreed_report([pair, pair]) == "error: run with other flags"
    assert agreed_report([None, pair]) == "rank 1 (of 2): error: this file alone is bad"
    assert agreed_report([pair, "error: x"]) == (
        "rank 0 (of 2): error: run with other flags\nrank 1 (of 2): error: x")
    with pytest.raises(SystemExit) as exc:  # one process: every rank failed
        agree(pair)
    assert exc.value.code == "error: run with other flags"


def test_silent_rank_waits_only_under_a_launcher(monkeypatch):
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    launched = {"TORCHELASTIC_RUN_ID": "x"}
    for rank, env, expected in [(1, launched, [arguments.SILENT_EXIT_DELAY_S]),
                                (0, launched, []), (1, {}, [])]:
        waits.clear()
        with pytest.raises(AgreedExit):
            with silent_ranks_wait(env):
                raise AgreedExit("error: x", rank, 2)
        assert waits == expected, (rank, env)


# A rank 1 that leaves its error to rank 0 and waits for the launcher to end it, with
# --exit-signal-handler's SignalHandler installed; {when}: the SIGTERM comes during the
# wait ("during") or came before it ("before", as launcher_watch's once torchrun died).
SILENT_WAIT_SCRIPT = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from megatron.agreed_exit import AgreedExit, silent_ranks_wait
from megatron.signals import SignalHandler

handler = SignalHandler()
if {when!r} == "before":
    os.kill(os.getpid(), signal.SIGTERM)
else:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
start = time.monotonic()
try:
    with silent_ranks_wait({{"TORCHELASTIC_RUN_ID": "x"}}):
        raise AgreedExit("error: x", 1, 2)
except AgreedExit:
    print(f"waited {{time.monotonic() - start:.1f}} s, noted {{handler.received}}")
"""


@pytest.mark.parametrize("when", ["during", "before"])
def test_a_noted_sigterm_ends_the_silent_ranks_wait(tmp_path, when):
    """torchrun ends every worker with SIGTERM once rank 0 has failed, and a silent rank
    waits (30 s) for it; with --exit-signal-handler the SIGTERM was only noted, so the rank
    waited on until torchrun's SIGKILL 30 s later (after a load error on rank 0, or a
    signal to the job while it resharded a checkpoint)."""
    script = tmp_path / "silent_wait.py"
    script.write_text(SILENT_WAIT_SCRIPT.format(root=str(ROOT), when=when))
    log = tmp_path / "log"  # forked: the script's imports are this process's
    code = forked_script.wait([forked_script.start(str(script), [], _env(), log, log)], 20)
    assert code == [0], log.read_text()
    waited = float(re.search(r"waited ([0-9.]+) s", log.read_text()).group(1))
    assert waited < 5, log.read_text()
    assert f"noted {int(signal.SIGTERM)}" in log.read_text()
