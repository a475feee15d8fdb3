"""A run can be stopped anywhere and picks up where its last complete checkpoint left off.

Fast: a process killed in the middle of a save (sync and async) leaves the previous
checkpoint as the one chosen; it loads, and the restarted run continues with the losses of
an uninterrupted run.

Slow (torchrun, 2 gloo processes): SIGTERM to torchrun with --exit-signal-handler saves at
the iteration reached and exits; SIGKILL of one rank under `torchrun --max-restarts 1`
with --load = --save resumes by itself with nothing lost beyond the last checkpoint (plain
--master-addr/--master-port launch and c10d rendezvous);
--exit-duration-in-mins saves and exits (2 ranks forked from the test process, no launcher).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron import checkpointing
from megatron.checkpointing import checkpoint_name, load_checkpoint, read_tracker
from megatron.core.parallel_state import ParallelState
from megatron.initialize import AgentStore, agent_store_from_env, attempt_store
from tests import forked_script
from tests.dist_utils import cpu_env, free_port
from tests.test_exact_resume import run_pretrain

ROOT = Path(__file__).resolve().parents[1]
CRASH_EXIT_CODE = 17


# --------------------------------------------------------------------------- killed mid-save
def _train_and_die_in_save(root: str, extra: list, crash_point: str) -> None:
    """Child process: save at 2 and 4; die inside the save of iteration 4."""
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
    saves = {"n": 0}
    if crash_point == "mid_file":
        original = torch.save

        def dying_save(obj, f, *args, **kwargs):
            saves["n"] += 1
            if saves["n"] == 2:  # the second file written: iteration 4's
                f.write(b"PK\x03\x04 a torn write")
                f.flush()
                os._exit(CRASH_EXIT_CODE)
            return original(obj, f, *args, **kwargs)

        torch.save = dying_save
    else:  # every file renamed into place, the tracker not yet rewritten
        original = checkpointing.write_tracker

        def dying_tracker(root_, iteration, release):
            if iteration == 4:
                os._exit(CRASH_EXIT_CODE)
            return original(root_, iteration, release)

        checkpointing.write_tracker = dying_tracker
    run_pretrain(extra + ["--save", root, "--save-interval", "2"])
    os._exit(0)  # not reached: the save of iteration 4 kills the process


@functools.lru_cache(maxsize=None)
def _uninterrupted_in_process() -> dict:
    """{iteration: loss} of one in-process run that nothing interrupts: the reference of
    the four cases below (the same flags and seed each time, so one run serves them)."""
    return run_pretrain([])[0]


@pytest.mark.parametrize("crash_point", ["mid_file", "before_tracker"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_mid_save_keeps_previous_checkpoint_and_restart_resumes(tmp_path, mode,
                                                                      crash_point):
    extra = ["--async-save"] if mode == "async" else []
    ref = _uninterrupted_in_process()
    root = str(tmp_path / "ck")
    child = multiprocessing.get_context("fork").Process(
        target=_train_and_die_in_save, args=(root, extra, crash_point))
    child.start()
    child.join(60)
    assert child.exitcode == CRASH_EXIT_CODE, "the save of iteration 4 should have died"

    # the tracker still names iteration 2, whose files are complete and load safely
    assert read_tracker(root) == (2, False)
    leftover = "iter_0000004.tmp" if crash_point == "mid_file" else "iter_0000004"
    assert leftover in os.listdir(root)
    iteration, state = load_checkpoint(root, ParallelState.build(1, 0))
    assert iteration == 2 and state["iteration"] == 2
    assert torch.load(checkpoint_name(root, 2, 0, 0, 1), weights_only=True)["iteration"] == 2

    # restarted with --load = --save: resumes at 2, same losses, the next saves succeed
    losses, tr = run_pretrain(extra + ["--load", root, "--save", root, "--save-interval", "2"])
    assert losses == {i: ref[i] for i in range(3, 7)}
    assert read_tracker(root) == (6, False)
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]


# --------------------------------------------------------------------------- agent store
def test_agent_store_keeps_each_start_apart():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "0", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert agent_store_from_env({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None  # srun etc.
    assert agent_store_from_env(dict(env, TORCHELASTIC_USE_AGENT_STORE="False")) is None
    with pytest.raises(ValueError, match="MASTER_PORT"):
        agent_store_from_env(dict(env, MASTER_PORT="x"))

    timeout = datetime.timedelta(seconds=5)
    server = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    agent = agent_store_from_env(dict(env, MASTER_PORT=str(server.port)))
    assert agent == AgentStore("127.0.0.1", server.port)
    first = attempt_store(agent, 0, 1, timeout)
    first.set("default_pg/0//cpu/rank_1", "a dead process's address")
    second = attempt_store(agent, 0, 1, timeout)  # the same count of restarts
    assert not second.check(["default_pg/0//cpu/rank_1"])  # the restart never reads it
    second.set("k", "v")
    assert first.check(["k"]) is False and second.get("k") == b"v"


# --------------------------------------------------------------------------- torchrun
MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--use-cpu-initialization", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
]

# Runs pretrain_gpt.py; on its first attempt (torchrun restart count 0) rank KILL_RANK
# SIGKILLs itself when about to run iteration KILL_AT + 1.
KILLING_WRAPPER = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
import megatron.training as training
_train_step = training.train_step

def train_step(tr, data, **kwargs):
    # once per job (a marker file): after a c10d restart rank {kill_rank} may be on the
    # node whose restart count stayed 0
    if (tr.state.iteration == {kill_at} and os.environ["RANK"] == "{kill_rank}"
            and not os.path.exists({marker!r})):
        open({marker!r}, "w").close()
        print("test: SIGKILL to rank {kill_rank} during iteration", tr.state.iteration + 1,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_step(tr, data, **kwargs)

training.train_step = train_step
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def _torchrun_cmd(nproc: int, script: str, args: list, launcher_args=()) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            *launcher_args, script, *args]


def _env() -> dict:
    return cpu_env(PYTHONUNBUFFERED="1")


def _start(cmd: list, log: Path, env_extra=None, new_session: bool = False) -> int:
    """Start `cmd` (`python -m torch.distributed.run ...` or `python script ...`) forked
    from this process (tests/forked_script.py: the launcher's imports come free; torchrun
    starts its workers as fresh processes), its output to the file `log`; its pid."""
    return forked_script.start_command(cmd, dict(_env(), **(env_extra or {})), log,
                                       new_session=new_session)


def _run(cmd: list, log_dir: Path, timeout: int = 90,
         env_extra=None) -> subprocess.CompletedProcess:
    """Run `cmd` (forked, as `_start`) to its end; its stdout and stderr (files under
    `log_dir`)."""
    log_dir.mkdir(exist_ok=True)
    out, err = (log_dir / f"run{len(os.listdir(log_dir))}.{n}" for n in ("out", "err"))
    pid = forked_script.start_command(cmd, dict(_env(), **(env_extra or {})), out, err)
    [code] = forked_script.wait([pid], timeout)
    return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


def _run_two_ranks(script: str, args: list, log_dir: Path, timeout: int = 90
                   ) -> subprocess.CompletedProcess:
    """`script` with `args` as ranks 0 and 1 of 2 (env:// rendezvous, as torchrun's workers
    see it, but no launcher), both forked from this process (tests/forked_script.py: a
    fresh worker's imports cost ~3 s of CPU); for runs whose subject is not the launcher.
    The status is the worst of the two; stdout and stderr hold both ranks' output."""
    log_dir.mkdir(exist_ok=True)
    n = len(os.listdir(log_dir))
    logs = [(log_dir / f"run{n}.rank{r}.out", log_dir / f"run{n}.rank{r}.err") for r in (0, 1)]
    pids = forked_script.start_ranks(script, args, _env(), free_port(), logs)
    codes = forked_script.wait(pids, timeout)
    return subprocess.CompletedProcess(
        [script, *args], max(codes, key=abs), *("".join(log[i].read_text() for log in logs)
                                                for i in (0, 1)))


def _losses(log: str) -> list:
    """(iteration, printed lm loss) in the order printed."""
    return [(int(i), v) for i, v in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)]


def _check_checkpoint(root: Path, iteration: int, tp_size: int = 1) -> None:
    """The tracker names `iteration`; its files (one per tensor-parallel rank) are
    complete and load weights_only."""
    assert read_tracker(str(root)) == (iteration, False)
    assert not [p for p in os.listdir(root) if p.endswith((".tmp", ".old"))]
    for tp_rank in range(tp_size):
        state = torch.load(checkpoint_name(str(root), iteration, tp_rank, 0, 1),
                           weights_only=True)
        assert state["iteration"] == iteration
        assert state["train_state"]["consumed_train_samples"] == iteration * 8


def _signal_when(log_dir: Path, args: list, when, sig: int, group: bool = False, script=None,
                 delay: float = 0.0) -> str:
    """`script` (default pretrain_gpt.py) with `args` under torchrun with 2 ranks; `sig`
    goes to torchrun (or, with `group`, to its whole process group, as a terminal's
    Ctrl-C does) `delay` seconds after the first output line matching the regex `when`
    (or once `when(output so far)` is true). Returns all the output (in a file under
    `log_dir`) once the launcher has ended."""
    ready = when if callable(when) else (lambda text: re.search(when, text.splitlines()[-1]))
    script = str(script or ROOT / "pretrain_gpt.py")
    log_path = log_dir / "torchrun.log"
    log_path.touch()
    pid = _start(_torchrun_cmd(2, script, args), log_path, new_session=group)
    try:
        deadline = time.monotonic() + 90
        with open(log_path) as log:
            text = ""
            while not (text.endswith("\n") and ready(text)):
                line = log.readline()
                text += line
                assert time.monotonic() < deadline, text[-5000:]
                time.sleep(0 if line else 0.02)
        time.sleep(delay)
        os.killpg(pid, sig) if group else os.kill(pid, sig)
        forked_script.wait([pid], 60)
    except BaseException:
        for end in (os.killpg, os.kill) if group else (os.kill,):
            with contextlib.suppress(ProcessLookupError):
                end(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise
    return log_path.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_to_torchrun_saves_at_the_iteration_reached(tmp_path, mode):
    ckpt = tmp_path / "ck"
    args = MODEL + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "5",
                    "--exit-signal-handler"] + (["--async-save"] if mode == "async" else [])
    log = _signal_when(tmp_path, args, r"iteration\s+7/", signal.SIGTERM)  # as slurm does to the job
    assert "[exiting program after receiving SIGTERM.]" in log, log[-4000:]
    reached = max(i for i, _ in _losses(log))
    assert 7 <= reached < 100000
    _check_checkpoint(ckpt, reached)
    saved = re.findall(r"successfully saved checkpoint at iteration\s+(\d+)", log)
    assert saved and int(saved[-1]) == reached, log[-3000:]
    if mode == "async":
        assert re.search(r"\(blocking [0-9.]+ s, writing [0-9.]+ s in the background\)", log)


# Runs pretrain_gpt.py (one process) and sends {sig} to it when {module}.{name} starts: a
# phase of the start-up reached without any timing.
SIGNAL_IN_PHASE_WRAPPER = """
import importlib, os, runpy, signal, sys
sys.path.insert(0, {root!r})
module = importlib.import_module({module!r})
original = getattr(module, {name!r})

def signalled(*args, **kwargs):
    print("test: {sig} during {name}", flush=True)
    os.kill(os.getpid(), signal.{sig})
    return original(*args, **kwargs)

setattr(module, {name!r}, signalled)
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.parametrize("sig, module, name", [
    ("SIGUSR1", "megatron.initialize", "initialize_entry_point"),  # the rendezvous
    ("SIGTERM", "megatron.training", "build_trainer"),  # the model build
])
def test_a_signal_during_start_up_is_noted_and_the_first_iteration_saves(tmp_path, sig,
                                                                         module, name):
    """With --exit-signal-handler the handler is installed once the arguments are read,
    as Megatron's is: a signal while the process group or the model is being set up is
    noted, and the run saves and exits at its first iteration check (status 0). The
    handler used to come only after the model was built: the signal killed the process
    (status 128 + signal number) with nothing saved."""
    ckpt = tmp_path / "ck"
    wrapper = tmp_path / "signal_in_phase.py"
    wrapper.write_text(SIGNAL_IN_PHASE_WRAPPER.format(
        root=str(ROOT), module=module, name=name, sig=sig, script=str(ROOT / "pretrain_gpt.py")))
    done = _run([sys.executable, str(wrapper)] + MODEL + [
        "--train-iters", "100000", "--save", str(ckpt), "--save-interval", "1000",
        "--exit-signal-handler"], tmp_path / "logs")
    log = done.stdout + done.stderr
    assert f"test: {sig} during {name}" in log, log[-4000:]
    assert done.returncode == 0, log[-4000:]
    assert f"[exiting program after receiving {sig}.]" in done.stdout, log[-4000:]
    assert [i for i, _ in _losses(done.stdout)] == [1]
    _check_checkpoint(ckpt, 1)


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> dict:
    """{iteration: printed lm loss} of a 2-rank run of 10 iterations that nothing
    interrupts (its ranks forked: the reference is about the numbers, not the launcher)."""
    ref = _run_two_ranks(str(ROOT / "pretrain_gpt.py"), MODEL + ["--train-iters", "10"],
                         tmp_path_factory.mktemp("uninterrupted"))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    return dict(_losses(ref.stdout))


# How torchrun finds its peers. "static" is plain `torchrun --master-addr A --master-port P`,
# what Megatron users type: one agent TCPStore serves every restart, so the workers must
# keep each start's keys apart (megatron/restart_epoch.py). "c10d-2-nodes" shares its
# rendezvous store with the workers the same way, with two agents of one process each
# (two "nodes"): only the node of the killed rank counts the restart, the other restarts
# its worker for the new membership with its count unchanged -- the restart counts differ
# between nodes. "c10d-own-store" opts out of the sharing, and torch's own env:// init
# (rank 0 hosts a fresh store per start) is what runs.
RENDEZVOUS = {
    "static": ([], {}),
    "c10d-2-nodes": (["--rdzv-backend", "c10d"], {}),
    "c10d-own-store": (["--rdzv-backend", "c10d"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}


def _run_nodes(cmds: list, env_extra: dict, log_path: Path, timeout: int = 90) -> tuple:
    """Run the launch commands of one job's nodes side by side, their processes writing to
    one file in the order they print: (worst exit status, the output)."""
    pids = [_start(c, log_path, env_extra) for c in cmds]
    statuses = forked_script.wait(pids, timeout)
    return max(abs(code) for code in statuses), log_path.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", list(RENDEZVOUS))
def test_sigkill_one_rank_then_torchrun_restart_resumes_without_loss(tmp_path, rendezvous,
                                                                     uninterrupted_losses):
    expected = uninterrupted_losses
    assert sorted(expected) == list(range(1, 11))

    ckpt = tmp_path / "ck"
    wrapper = tmp_path / "train_then_die.py"
    wrapper.write_text(KILLING_WRAPPER.format(root=str(ROOT), kill_at=6, kill_rank=1,
                                              script=str(ROOT / "pretrain_gpt.py"),
                                              marker=str(tmp_path / "killed")))
    rdzv_args, env_extra = RENDEZVOUS[rendezvous]
    nodes = 2 if rendezvous == "c10d-2-nodes" else 1
    cmd = _torchrun_cmd(2 // nodes, str(wrapper), MODEL + [
        "--train-iters", "10", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "4"],
        launcher_args=["--max-restarts", "1", "--monitor-interval", "0.2", *rdzv_args])
    if rdzv_args:  # c10d: its endpoint in place of --master-addr/--master-port
        at = cmd.index("--master-addr")
        cmd[at:at + 4] = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job",
                          "--nnodes", str(nodes)]
    status, log = _run_nodes([cmd] * nodes, env_extra, tmp_path / "job.log")
    assert status == 0, log[-4000:]
    assert "test: SIGKILL to rank 1 during iteration 7" in log
    assert re.search(r"loading checkpoint from \S+ at iteration 4", log), log[-4000:]
    printed = _losses(log)
    first_attempt = [i for i, _ in printed[:6]]
    assert first_attempt == [1, 2, 3, 4, 5, 6], printed
    assert [i for i, _ in printed[6:]] == list(range(5, 11)), "resumed at the checkpoint of 4"
    for i, loss in printed:  # every printed loss, before and after the restart
        assert loss == expected[i], (i, loss, expected[i])
    _check_checkpoint(ckpt, 10)


# --exit-duration-in-mins is an int flag (as in Megatron); a run of minutes is too long for
# a test, so this wrapper turns `--exit-duration-in-mins 1` into 0.02 minutes (1.2 s after
# the process started: the run exits at the first check past it).
SHORT_DURATION_WRAPPER = """
import dataclasses, runpy, sys
sys.path.insert(0, {root!r})
import megatron.arguments as arguments
_parse = arguments.parse_and_validate

def parse_and_validate(*args, **kwargs):
    config = _parse(*args, **kwargs)
    config.training = dataclasses.replace(config.training, exit_duration_in_mins=0.02)
    return config

arguments.parse_and_validate = parse_and_validate
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_exit_duration_saves_and_exits(tmp_path):
    ckpt = tmp_path / "ck"
    wrapper = tmp_path / "short_duration.py"
    wrapper.write_text(SHORT_DURATION_WRAPPER.format(root=str(ROOT),
                                                     script=str(ROOT / "pretrain_gpt.py")))
    run = _run_two_ranks(str(wrapper), MODEL + [
        "--train-iters", "100000", "--save", str(ckpt), "--save-interval", "100000",
        "--exit-duration-in-mins", "1"], tmp_path / "logs")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    # counted from the process start (as Megatron does): past 0.02 at the check that exits
    minutes = re.search(r"\[exiting program after (\d+\.\d+) minutes\]", log)
    assert minutes and float(minutes.group(1)) > 0.02, log[-3000:]
    assert "[after training is done]" not in log and "sample draw" not in log
    reached = max(i for i, _ in _losses(run.stdout))
    assert 0 < reached < 100000
    _check_checkpoint(ckpt, reached)


@pytest.mark.slow
def test_ctrl_c_prints_one_line_instead_of_every_ranks_traceback(tmp_path):
    """Ctrl-C in a terminal: SIGINT to torchrun and its workers (one process group). Each
    rank printed a KeyboardInterrupt or connection-closed traceback (some 400 lines for two
    ranks); now rank 0 prints where the run stopped and the checkpoint to resume from, the
    workers exit with status 130, and their frames appear in no traceback."""
    ckpt = tmp_path / "ck"
    args = MODEL + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "5"]
    log = _signal_when(tmp_path, args, r"iteration\s+7/", signal.SIGINT, group=True)  # Ctrl-C
    # the signal may come while the checkpoint of iteration 10 is being written (the
    # log is read ~15 ms steps behind under load): the line then says so
    found = re.findall(r"interrupted (?:at|while saving the checkpoint of) iteration (\d+) "
                       r"\(SIGINT, e\.g\. Ctrl-C\): stopped without saving(?: \(its partial "
                       r"iter_\d+\.tmp/ was removed\))?; the last checkpoint is (\S+): "
                       r"relaunch with --load (\S+) to resume from it", log)
    assert len(found) == 1, log[-4000:]
    iteration, last, load = found[0]
    # the last rank prints the iteration line; rank 0, which names its own iteration, may
    # not have counted that step yet when the signal comes
    assert int(iteration) >= 6 and load == str(ckpt)
    saved, _ = read_tracker(str(ckpt))
    assert last == f"{ckpt}/iter_{saved:07d}" and saved % 5 == 0 and saved <= int(iteration)
    assert not re.search(r'File ".*(pretrain_gpt\.py|/megatron/)', log), log[-4000:]
    assert "KeyboardInterrupt" not in log.replace("torch.distributed.elastic", ""), log[-4000:]


@pytest.mark.parametrize("removed", [True, False])
def test_the_ctrl_c_line_says_what_became_of_a_stopped_saves_directory(tmp_path, removed):
    """The line for a sync save stopped midway says whether its partial directory went
    (`RunProgress.save_stopped`, told by rank 0's save) and names the checkpoint to load."""
    import types

    from megatron.interrupt import RunProgress, interrupt_message

    root = str(tmp_path)
    checkpointing.save_checkpoint(root, 3, {"iteration": 3}, ParallelState.build(1, 0))
    progress = RunProgress()
    progress.trainer = types.SimpleNamespace(state=types.SimpleNamespace(iteration=6))
    progress.phase = "saving"
    progress.save_stopped(os.path.join(root, "iter_0000006.tmp"), removed)
    text = interrupt_message(progress, root)
    head = ("interrupted while saving the checkpoint of iteration 6 (SIGINT, e.g. Ctrl-C): "
            "stopped without saving (its partial iter_0000006.tmp/ ")
    assert text.startswith(head + ("was removed);" if removed else "stays: "))
    assert text.endswith(f"the last checkpoint is {root}/iter_0000003: relaunch with --load "
                         f"{root} to resume from it")


def test_the_checkpoint_load_is_a_phase_of_its_own():
    """Reading --load is named as such (by the Ctrl-C line and the watchdog's reports),
    not 'during start-up'."""
    from megatron.interrupt import RunProgress, interrupt_message

    progress = RunProgress()
    with progress.stage("loading"):
        assert progress.where() == "while loading the checkpoint"
        assert interrupt_message(progress, None) == (
            "interrupted while loading the checkpoint (SIGINT, e.g. Ctrl-C): stopped without "
            "saving (no --save)")
    assert progress.where() == "during start-up"


# The end of a wrapper script: runs {script} as __main__ and writes the process's exit
# status (os._exit, SystemExit or an exception: 1) to {status_dir}/rank<RANK>. Each record
# goes to a file of its own thread first and is renamed into place: a watchdog thread's
# os._exit while the main thread records its SystemExit once left an empty file behind.
RUN_RECORDING_STATUS = """
import threading
status_file = os.path.join({status_dir!r}, "rank" + os.environ["RANK"])
os_exit = os._exit

def record_status(code):
    own = "%s.%d.tmp" % (status_file, threading.get_ident())
    with open(own, "w") as f:
        f.write(str(code))
    os.replace(own, status_file)

def recording_exit(code):
    record_status(code)
    os_exit(code)

os._exit = recording_exit
sys.argv[0] = {script!r}
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exc:
    record_status(exc.code if isinstance(exc.code, int) else 1 if exc.code else 0)
    raise
except BaseException:
    record_status(1)
    raise
"""


def read_statuses(status_dir: Path) -> dict:
    """{rank: exit status} from the files RUN_RECORDING_STATUS wrote (a record whose
    process was killed before its rename is left out)."""
    return {int(p.name[4:]): int(p.read_text()) for p in status_dir.iterdir()
            if not p.name.endswith(".tmp")}


# Runs pretrain_gpt.py with the {call}th call of {module}.{name} slowed by 30 s (printing
# "test: slowing" first, so that the test knows when to press Ctrl-C), and records the
# process's exit status in {status_dir}/rank<RANK> (os._exit included).
SLOW_PHASE_WRAPPER = """
import importlib, os, runpy, sys, time
sys.path.insert(0, {root!r})
module = importlib.import_module({module!r})
original, calls = getattr(module, {name!r}), [0]

def slowed(*args, **kwargs):
    calls[0] += 1
    if calls[0] == {call}:
        print("test: slowing {name} on rank", os.environ["RANK"], flush=True)
        time.sleep(30)
    return original(*args, **kwargs)

setattr(module, {name!r}, slowed)
""" + RUN_RECORDING_STATUS

CTRL_C_PHASES = {  # phase: (module, function, call slowed, ranks slowed, extra args, line)
    "start-up": ("megatron.initialize", "initialize_entry_point", 1, 2, [],
                 r"interrupted during start-up \(SIGINT, e\.g\. Ctrl-C\): stopped without "
                 r"saving; --save \S+ holds no checkpoint yet"),
    "data": ("megatron.training", "build_datasets", 1, 2, [],
             r"interrupted during start-up \(SIGINT, e\.g\. Ctrl-C\): stopped without saving; "
             r"--save \S+ holds no checkpoint yet"),
    "evaluation": ("megatron.training", "evaluate", 2, 2, ["--eval-interval", "2",
                                                           "--eval-iters", "5"],
                   r"interrupted during the evaluation at iteration 4 \(SIGINT, e\.g\. "
                   r"Ctrl-C\): stopped without saving; the last checkpoint is \S+/iter_0000003"),
    "sync save": ("megatron.checkpointing", "_torch_save_synced", 2, 1, [],
                  r"interrupted while saving the checkpoint of iteration 6 \(SIGINT, e\.g\. "
                  r"Ctrl-C\): stopped without saving \(its partial iter_0000006\.tmp/ was "
                  r"removed\); the last checkpoint is \S+/iter_0000003"),
    "sync save, two writers": ("megatron.checkpointing", "_torch_save_synced", 2, 2,
                               ["--tensor-model-parallel-size", "2"],
                               r"interrupted while saving the checkpoint of iteration 6 "
                               r"\(SIGINT, e\.g\. Ctrl-C\): stopped without saving \(its "
                               r"partial iter_0000006\.tmp/ was removed\); the last "
                               r"checkpoint is \S+/iter_0000003"),
    "async save": ("megatron.checkpointing", "_torch_save_synced", 2, 1, ["--async-save"],
                   r"interrupted (at iteration \d+|while saving the checkpoint of iteration "
                   r"\d+) \(SIGINT, e\.g\. Ctrl-C\): stopped without saving \(the background "
                   r"save of the checkpoint at iteration 6 to \S+ was abandoned\); the last "
                   r"checkpoint is \S+/iter_0000003"),
}


def _interrupt_in(tmp_path, phase: str) -> tuple:
    """Runs 2 ranks with --save-interval 3 and `phase` slowed; Ctrl-C (SIGINT to the
    process group) once it is slowed. (log, {rank: exit status}, checkpoint dir)."""
    module, name, call, slowed, extra, _ = CTRL_C_PHASES[phase]
    ckpt, status_dir = tmp_path / "ck", tmp_path / "status"
    status_dir.mkdir()
    wrapper = tmp_path / "slow_phase.py"
    wrapper.write_text(SLOW_PHASE_WRAPPER.format(
        root=str(ROOT), module=module, name=name, call=call, status_dir=str(status_dir),
        script=str(ROOT / "pretrain_gpt.py")))
    args = MODEL + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "3",
                    *extra]
    log = _signal_when(tmp_path, args, lambda text: text.count("test: slowing") == slowed, signal.SIGINT,
                       group=True, script=wrapper, delay=0.5)  # the terminal's Ctrl-C
    statuses = read_statuses(status_dir)
    return log, statuses, ckpt


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(CTRL_C_PHASES))
def test_ctrl_c_in_each_phase_prints_one_accurate_line_and_keeps_the_checkpoint(tmp_path,
                                                                                 phase):
    """Ctrl-C while starting (process group, data indices), evaluating, saving (sync) or
    writing in the background (--async-save): before, the first two gave every rank's
    KeyboardInterrupt traceback, and an interrupted background save could still be
    published after rank 0 had named the previous checkpoint. Now rank 0 prints one line
    saying where the run was, every worker exits with status 130, the tracker names a
    complete checkpoint (the interrupted save is never published) and --load resumes past
    what an abandoned background save leaves. An interrupted sync save (one writer or two)
    left its `iter_N.tmp/` until the next start warned of it: now rank 0 removes it once
    every writer has stopped, and says so."""
    log, statuses, ckpt = _interrupt_in(tmp_path, phase)
    assert "test: slowing" in log, log[-4000:]
    found = re.findall(r"^interrupted .*$", log, re.M)
    assert len(found) == 1 and re.match(CTRL_C_PHASES[phase][-1], found[0]), log[-4000:]
    assert statuses == {0: 130, 1: 130}, log[-4000:]
    assert not re.search(r'File ".*(pretrain_gpt\.py|/megatron/|slow_phase)', log), log[-4000:]
    assert "KeyboardInterrupt" not in log.replace("torch.distributed.elastic", ""), log[-4000:]
    if phase in ("start-up", "data"):
        assert read_tracker(str(ckpt)) == (None, False)
        return
    assert found[0].endswith(f"/iter_0000003: relaunch with --load {ckpt} to resume from it")
    assert read_tracker(str(ckpt)) == (3, False)
    assert not os.path.exists(ckpt / "iter_0000006"), "the interrupted save is not published"
    if phase != "async save":
        # nothing left of the interruption: the directory is what an uninterrupted run's
        # save of 3 leaves, and --load from that is what test_sigkill_... runs
        assert sorted(os.listdir(ckpt)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
        _check_checkpoint(ckpt, 3, tp_size=2 if "two writers" in phase else 1)
        return
    # the abandoned background save leaves its iter_0000006.tmp/: the next start copes
    resumed = _run_two_ranks(str(ROOT / "pretrain_gpt.py"), MODEL + [
        "--train-iters", "4", "--load", str(ckpt), "--save", str(ckpt), "--save-interval", "4",
        "--override-opt_param-scheduler"], tmp_path / "logs")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert re.search(r"loading checkpoint from \S+ at iteration 3", resumed.stdout)
    assert [i for i, _ in _losses(resumed.stdout)] == [4]
    assert read_tracker(str(ckpt)) == (4, False)


def test_a_dry_run_leaves_sigterm_to_stop_it(monkeypatch):
    """--exit-signal-handler's handler comes once the arguments are read, but not for
    --dry-run: a SIGTERM sent to stop a dry run stops it (it would be noted and ignored)."""
    import pretrain_gpt

    seen = []
    monkeypatch.setattr(pretrain_gpt, "_dry_run",
                        lambda *a: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
    before = signal.getsignal(signal.SIGTERM)
    assert pretrain_gpt.main(MODEL + ["--train-iters", "10", "--exit-signal-handler",
                                      "--dry-run"]) == 0
    assert seen == [before]


@pytest.mark.slow
def test_a_load_error_with_the_exit_signal_handler_ends_every_rank_promptly(tmp_path):
    """Rank 0 prints a load error every rank agreed on and exits; rank 1 waits for torchrun
    to end it. torchrun's SIGTERM used to be only noted by --exit-signal-handler's handler,
    so rank 1 waited on until torchrun's SIGKILL 30 s later ('Unable to shutdown process')."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7\n")
    run = _run(_torchrun_cmd(2, str(ROOT / "pretrain_gpt.py"), MODEL + [
        "--train-iters", "10", "--load", str(ckpt), "--exit-signal-handler"]),
               tmp_path / "logs")
    log = run.stdout + run.stderr
    assert run.returncode != 0 and "iter_0000007 does not exist" in log, log[-3000:]
    assert "Unable to shutdown process" not in log, log[-3000:]  # (SIGKILL after 30 s)
