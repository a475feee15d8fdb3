"""initialize_distributed on a node with fewer GPUs than processes: a clean error naming
the GPU count and the fix, before any CUDA call (was 'CUDA error: invalid device ordinal')."""
from __future__ import annotations

import pytest
import torch

import megatron.initialize as init
from megatron.config import ParallelConfig


def test_a_local_rank_without_a_gpu_is_refused_with_the_fix():
    init.check_local_rank(0, 1)
    init.check_local_rank(7, 8)
    with pytest.raises(SystemExit, match=r"local rank 1 has no GPU: this node has 1 visible "
                                         r"GPU\(s\).*--nproc-per-node 1.*CUDA_VISIBLE_DEVICES="):
        init.check_local_rank(1, 1)


def test_initialize_checks_before_touching_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_cuda_call(*args, **kwargs):
        raise AssertionError("set_device called for a GPU that does not exist")

    monkeypatch.setattr(torch.cuda, "set_device", no_cuda_call)
    with pytest.raises(SystemExit, match="local rank 1 has no GPU"):
        init.initialize_distributed(ParallelConfig(), rank=1, world_size=2, local_rank=1)


# ------------------------------------------------------------- srun without torchrun


def test_srun_tasks_without_torchrun_variables_are_refused():
    """`srun -n 2 python pretrain_gpt.py` (no torchrun): each task would train alone as a
    one-process run, both writing the same --save. A batch shell or one task is fine, and
    so is any launch that sets RANK / WORLD_SIZE (torchrun, or a wrapper)."""
    message = init.srun_tasks_without_launcher({"SLURM_STEP_NUM_TASKS": "8",
                                                "SLURM_PROCID": "3"})
    assert "task 3 of the 8 that srun started" in message
    assert "srun --ntasks-per-node=1 python -m torch.distributed.run" in message
    for env in ({}, {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "8"}, {"SLURM_STEP_NUM_TASKS": "1"},
                {"SLURM_STEP_NUM_TASKS": "8", "RANK": "3", "WORLD_SIZE": "8"}):
        assert init.srun_tasks_without_launcher(env) is None


def test_pretrain_gpt_under_srun_without_torchrun_stops_with_the_fix():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0")
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--mock-data"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "error: this process is task 0 of the 2 that srun started" in proc.stderr
    env["SLURM_PROCID"] = "1"  # the other task: silent (no launcher variable to wait under)
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--mock-data"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (1, "")


@pytest.mark.parametrize("script", ["pretrain_gpt.py", "tasks/main.py"])
def test_a_launcher_variable_that_is_no_number_stops_with_its_value(script):
    """A wrapper's `WORLD_SIZE=two` (or `RANK=-1`) was a ValueError traceback from int()
    on every process; now one line names the variable, its value and the fix, as
    tools/doctor.py does. An empty one counts as unset there too (and here)."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(WORLD_SIZE="two", RANK="-1")
    proc = subprocess.run([sys.executable, script, "--help"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "RANK='-1' is not a whole number >= 0" in proc.stderr
    assert "WORLD_SIZE='two' is not a whole number >= 1" in proc.stderr
    env.update(WORLD_SIZE="", RANK="")
    proc = subprocess.run([sys.executable, script, "--help"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, "Traceback" in proc.stderr) == (0, False), proc.stderr


def test_gpu_without_local_rank_is_rank_modulo_the_gpus_as_in_megatron(monkeypatch):
    """A launch that exports RANK / WORLD_SIZE itself (an srun wrapper: RANK=$SLURM_PROCID,
    no LOCAL_RANK) gets Megatron-LM 23.05's GPU, rank % the visible GPUs; every rank of a
    node took GPU 0 (NCCL: 'Duplicate GPU detected'). torchrun's LOCAL_RANK is kept."""
    assert init.local_gpu(11, 0, {}, 8) == 3
    assert init.local_gpu(11, 0, {}, 1) == 0  # one GPU per task (--gpus-per-task=1)
    assert init.local_gpu(11, 2, {"LOCAL_RANK": "2"}, 8) == 2
    assert init.local_gpu(3, 0, {}, 0) == 0
    class Stop(Exception):
        """raised where initialisation would touch the (absent) GPU"""

    def initialize_distributed(parallel, rank, world_size, local_rank, agent_store, store):
        raise Stop(local_rank)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(init, "initialize_distributed", initialize_distributed)
    with pytest.raises(Stop) as stop:
        init.initialize_entry_point(ParallelConfig(), "torch", 6, 8, 0, {"RANK": "6"})
    assert stop.value.args == (2,)


def test_a_warning_every_rank_gives_alike_shows_once(monkeypatch):
    """The first rank to give a warning shows it (a count in the job's store, here one
    HashStore standing for it); the same text from another rank does not show, another
    text does. Every rank of a run that loads an fp16 checkpoint into a bf16 run printed
    the loss-scaler warning: thousands of copies at scale."""
    import warnings

    import torch.distributed as dist

    from megatron import rank_failure
    from megatron.initialize import warnings_once_per_job

    store, shown = dist.HashStore(), []
    monkeypatch.setattr(rank_failure, "_default_store", lambda: store)
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args: shown.append(str(message)))
    warnings_once_per_job(3)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for message in ("the checkpoint has a dynamic loss scaler", "the checkpoint has a "
                        "dynamic loss scaler", "another warning"):  # the second: another rank
            warnings.warn(message)
    assert shown == ["the checkpoint has a dynamic loss scaler", "another warning"]


def test_project_warnings_print_as_one_line_and_others_keep_pythons_format(monkeypatch):
    """A library warning (here: a checkpoint without a loss scaler loaded by an fp16 run)
    prints as `WARNING: <message>`, not as `<file>:<line>: UserWarning: ...` plus the
    source line of the call; another package's warning keeps Python's format."""
    import warnings

    from megatron.core.optimizer.grad_scaler import DynamicGradScaler, load_scaler_state
    from megatron.initialize import one_line_project_warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    one_line_project_warnings()
    one_line_project_warnings()  # twice (a second entry point in one process): same format
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_scaler_state(DynamicGradScaler(initial_scale=2.0 ** 16, min_scale=1.0), {})
    (w,) = caught
    text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
    assert text == ("WARNING: the checkpoint was saved with no loss scaler (bf16/fp32, or an "
                    "older checkpoint); the dynamic loss scale starts at --initial-loss-scale "
                    "65536\n")
    other = warnings.formatwarning("x", UserWarning, "/elsewhere/pkg/mod.py", 3)
    assert other.startswith("/elsewhere/pkg/mod.py:3: UserWarning: x")


@pytest.mark.parametrize("tool", ["preprocess_data", "merge_datasets", "checkpoint_util",
                                  "checkpoint_convert", "generate"])
def test_the_file_tools_print_library_warnings_in_one_line(tool, tmp_path, monkeypatch):
    """The file tools print the library's warnings (a merges.txt line the GPT-2 tokenizer
    does not read, a dataset whose index does not match its .bin) as pretrain_gpt.py does:
    `WARNING: <message>`, not Python's `<file>:<line>: UserWarning:` and the source line.
    Each tool's run (here replaced by a probe) sees the one-line format; the caller's
    comes back after it."""
    import importlib
    import warnings

    mod = importlib.import_module(f"tools.{tool}")
    caller_format = warnings.formatwarning
    seen = []

    def probe(*args, **kwargs):
        seen.append(warnings.formatwarning("a merge is not read", UserWarning,
                                           init.__file__, 86))
        return 0

    (tmp_path / "in.jsonl").write_text('{"text": "1 2"}\n')
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    argv = {
        "preprocess_data": ["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                            str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "10", "--workers", "1"],
        "merge_datasets": ["--input", str(tmp_path / "d"), "--output-prefix",
                           str(tmp_path / "merged")],
        "checkpoint_util": ["--model-type", "GPT", "--load-dir", str(tmp_path / "a"),
                            "--save-dir", str(tmp_path / "b")],
        "checkpoint_convert": ["reshard", "--load", str(tmp_path / "a"), "--save",
                               str(tmp_path / "b")],
        "generate": ["--load", str(tmp_path / "a"), "--prompt-ids", "1"],
    }[tool]
    if tool == "checkpoint_convert":
        monkeypatch.setitem(mod.SUBCOMMANDS, "reshard", (mod.SUBCOMMANDS["reshard"][0], probe))
    else:
        monkeypatch.setattr(mod, {"preprocess_data": "run", "merge_datasets": "merge",
                                  "checkpoint_util": "run", "generate": "_run"}[tool], probe)
    mod.main(argv)
    assert seen == ["WARNING: a merge is not read\n"]
    assert warnings.formatwarning is caller_format


# ------------------------------------------- env:// launch (RANK / WORLD_SIZE, no torchrun)


def test_an_env_launch_without_master_addr_stops_with_the_fix(monkeypatch):
    """An srun wrapper that exports RANK / WORLD_SIZE but not MASTER_ADDR / MASTER_PORT:
    one line naming the missing variables and what to set, not torch's traceback."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name, value in env.items():  # torch's env:// reads the process environment
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        init.initialize_entry_point(ParallelConfig(), "torch", 0, 2, 0, env)
    message = str(stop.value.code)
    assert message.startswith("error: RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR is not")
    assert "scontrol show hostnames" in message and "torchrun" in message


@pytest.fixture
def busy_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_rank_0_on_a_port_in_use_stops_with_the_fix(busy_port, monkeypatch):
    """Rank 0 hosts the env:// store: a MASTER_PORT in use is one line naming the port
    and the fix, at init and in the early store of the start-up reads."""
    from megatron.startup_store import JobStore

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(busy_port)}
    for name, value in env.items():  # torch's env:// reads the process environment
        monkeypatch.setenv(name, value)
    expected = rf"rank 0 cannot host the rendezvous store on MASTER_PORT={busy_port} .*free port"
    with pytest.raises(SystemExit, match=expected):
        init.initialize_entry_point(ParallelConfig(), "torch", 0, 2, 0, env)
    import datetime

    with pytest.raises(SystemExit, match=expected):
        JobStore(env, 0, 2).connect(datetime.timedelta(seconds=5))


# A few seconds' wait: --distributed-timeout-minutes less one minute, plus the minute that
# the start-up adds to it (the flag itself is at least 1: 2 minutes in all).
SHORT_WAIT_MINUTES = -0.95  # 3 s


def _env_launch(monkeypatch, rank: int, addr: str) -> dict:
    from tests.dist_utils import free_port

    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": addr,
           "MASTER_PORT": str(free_port())}
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for name, value in env.items():  # torch's env:// reads the process environment
        monkeypatch.setenv(name, value)
    return env


def test_an_env_launch_to_a_master_addr_that_does_not_resolve_stops_at_once(monkeypatch):
    """A tool without the start-up reads of pretrain_gpt.py (tasks/main.py, benchmark.py)
    went to torch's env:// with an unresolvable MASTER_ADDR: the store retried the name for
    the whole timeout (11 minutes by default), then blamed rank 0's process. Now one line
    at once, naming the address and the fix."""
    import time

    env = _env_launch(monkeypatch, 1, "no-such-host.invalid")
    started = time.monotonic()
    with pytest.raises(SystemExit, match=r"^error: rank 1 cannot resolve "
                       r"MASTER_ADDR='no-such-host.invalid' .*scontrol"):
        # a 90 s wait (0.5 min plus the added minute): the retrying it replaced waited all
        # of it, so a limit of 10 s tells the two apart on a busy machine too (a 3 s wait
        # against a 2.5 s limit did not leave a margin)
        init.initialize_entry_point(
            ParallelConfig(distributed_timeout_minutes=0.5), "torch", 1, 2, 0, env)
    assert time.monotonic() - started < 10


def test_rank_0_of_an_env_launch_names_the_ranks_that_never_connected(monkeypatch):
    """Rank 0 of an env:// launch whose other rank never comes: torch's `DistStoreError:
    Timed out after 3 seconds waiting for clients. 1/2 clients joined.` traceback (with
    the C++ frames) from the tools; now pretrain_gpt.py's line naming the missing rank."""
    env = _env_launch(monkeypatch, 0, "127.0.0.1")
    with pytest.raises(SystemExit) as stop:
        init.initialize_entry_point(
            ParallelConfig(distributed_timeout_minutes=SHORT_WAIT_MINUTES), "torch", 0, 2, 0,
            env)
    message = str(stop.value.code)
    assert message.startswith(f"error: rank 0 hosts the rendezvous store on MASTER_ADDR:"
                              f"MASTER_PORT (127.0.0.1:{env['MASTER_PORT']}) and waited 3 s")
    assert "1 of 2 never connected (rank(s) 1)" in message
