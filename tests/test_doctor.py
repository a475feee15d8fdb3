"""tools/doctor.py: the machine report, the port check, the store check-in that names a
missing rank, and the communication checks on 2 gloo processes (forked, and under torchrun)."""
from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import forked_script
from tests.dist_utils import cpu_env, free_port
from tools import doctor

ROOT = Path(__file__).resolve().parents[1]


def test_machine_report_lists_versions_and_environment():
    text, problems = doctor.machine_report({"CUDA_DEVICE_MAX_CONNECTIONS": "1",
                                            "NCCL_DEBUG": "WARN", "MASTER_PORT": str(free_port())})
    for name in ("python", "torch", "CUDA", "cuDNN", "NCCL", "apex", "transformer_engine",
                 "GPUs", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_DEBUG", "MASTER_ADDR", "rendezvous"):
        assert name in text
    assert problems == []


def test_environment_warnings():
    warn = doctor.env_warnings({"NCCL_P2P_DISABLE": "1", "LOCAL_WORLD_SIZE": "8",
                                "WORLD_SIZE": "8"}, num_gpus=4)
    text = "\n".join(warn)
    assert "CUDA_DEVICE_MAX_CONNECTIONS is not 1" in text and "NCCL_P2P_DISABLE=1" in text
    assert "only 4 GPUs" in text and "OMP_NUM_THREADS" in text
    assert doctor.env_warnings({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "WARN"}, 8) == []
    ok = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "WARN"}
    lt = dict(ok, TORCH_BLAS_PREFER_CUBLASLT="1", CUBLAS_WORKSPACE_CONFIG=":0:0")
    assert "cuBLASLt fails without one" in "\n".join(doctor.env_warnings(lt, 8))
    assert doctor.env_warnings(dict(lt, CUBLAS_WORKSPACE_CONFIG=":4096:8"), 8) == []
    assert ("CUBLAS_WORKSPACE_CONFIG", ":0:0") in doctor.environment(lt)


def test_port_check_free_and_in_use():
    port = free_port()
    assert doctor.check_port("127.0.0.1", port)[0] == "free"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        busy = server.getsockname()[1]
        assert doctor.check_port("127.0.0.1", busy)[0] == "listening"
        _, problems = doctor.rendezvous_lines({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy)})
        assert "in use" in problems[0]
        under_torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy), "WORLD_SIZE": "2",
                          "TORCHELASTIC_USE_AGENT_STORE": "True"}
        assert doctor.rendezvous_lines(under_torchrun)[1] == []  # the store must listen
    _, problems = doctor.rendezvous_lines({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                           "WORLD_SIZE": "2", "RANK": "1"}, wait_s=0.3)
    assert "is not reachable from this node" in problems[0]
    assert doctor.check_port("no-such-host.invalid", 1)[0] == "unresolvable"


def test_bad_rendezvous_settings_fail_with_their_value():
    """A MASTER_PORT that is no port number raised a ValueError traceback, and a MASTER_ADDR
    that does not resolve passed ("all checks passed") though no launch can use it."""
    for port in ("abc", "70000", "0", "²"):  # "²".isdigit(), but not an int
        _, problems = doctor.rendezvous_lines({"MASTER_PORT": port})
        assert problems == [f"MASTER_PORT='{port}' is not a TCP port number (1-65535); set "
                            "e.g. MASTER_PORT=29500"]
    for env in ({}, {"WORLD_SIZE": "2", "RANK": "1"}):
        start = time.monotonic()
        _, problems = doctor.rendezvous_lines(dict(env, MASTER_ADDR="no-such-host.invalid",
                                                   MASTER_PORT=str(free_port())), wait_s=30)
        assert time.monotonic() - start < 20  # a name that does not resolve is not waited for
        assert len(problems) == 1 and problems[0].startswith(
            "MASTER_ADDR=no-such-host.invalid: cannot resolve no-such-host.invalid")


def test_check_in_names_the_missing_rank_either_way():
    store = dist.HashStore()
    err, _ = doctor.CheckIn(store, 0, 3, 0.3)("barrier")  # nobody else checks in
    assert err == "rank(s) [1, 2] did not answer within 0.3 s at step 'barrier'; those " \
                  "processes are stuck or dead"
    err, _ = doctor.CheckIn(dist.HashStore(), 1, 2, 0.1, grace_s=0)("barrier")  # no rank 0
    assert err.startswith("rank 0 did not answer")
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=lambda r: out.__setitem__(
        r, doctor.CheckIn(store, r, 2, 5)("barrier", f"info {r}")), args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == (None, {0: "info 0", 1: "info 1"}) and out[1] == (None, {})


def _doctor_child(rank: int, port: int, log: str, argv) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", closefd=False)  # pytest's capture objects are not fds 1 and 2
    sys.stderr = open(2, "w", closefd=False)
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    os._exit(doctor.main(argv))


def _fork_doctor(tmp_path, argv, wait_for=(0, 1)):
    """Run doctor.main on 2 forked processes (the store lives in rank 0, so it counts as
    reachable once rank 0 is up). Returns exit codes (None: killed) and logs."""
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    procs = [ctx.Process(target=_doctor_child, args=(r, port, logs[r], argv)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for r in wait_for:
            procs[r].join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    codes = [p.exitcode if r in wait_for else None for r, p in enumerate(procs)]
    return codes, [Path(log).read_text() for log in logs]


def test_collectives_on_two_gloo_processes(tmp_path):
    codes, logs = _fork_doctor(tmp_path, ["--timeout", "20", "--size-mb", "1", "--iters", "2"])
    assert codes == [0, 0], logs
    out = logs[0]
    for line in ("communication (backend gloo, world size 2)", "rank 1: host",
                 "barrier     ok", "all-reduce  ok: sum 3, expected 3", "all-gather  ok",
                 "send/recv   ok: received 1 from rank 1", "result: all checks passed"):
        assert line in out
    assert "GB/s" in out.split("bandwidth")[1]


def test_hanging_rank_is_named(tmp_path):
    codes, logs = _fork_doctor(tmp_path, ["--timeout", "2", "--simulate-hang-rank", "1"],
                               wait_for=(0,))
    assert codes[0] == 1
    assert "FAIL rank 0: rank(s) [1] did not answer within 2 s at step 'check-in'" in logs[0]


@pytest.mark.slow
@pytest.mark.parametrize("hang", [False, True])
def test_under_torchrun(hang):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tools" / "doctor.py"), "--timeout", "3", "--size-mb", "1"]
    if hang:
        cmd += ["--simulate-hang-rank", "1"]
    proc = forked_script.run(cmd, cwd=ROOT, env=cpu_env(), timeout=120)
    if hang:
        assert proc.returncode != 0
        assert "rank(s) [1] did not answer within 3 s" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "all-reduce  ok" in proc.stdout and "result: all checks passed" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--iters", "0"], "--iters 0 must be >= 1"),
    (["--timeout", "-1"], "--timeout -1.0 must be a number of seconds > 0"),
    (["--size-mb", "-5"], "--size-mb -5.0 must be > 0")])
def test_values_the_checks_cannot_run_with_are_refused(argv, message, capsys):
    # before: --iters 0 divided by zero on every rank, --timeout -1 reported healthy
    # ranks as stuck, --size-mb -5 timed an all-reduce of one number
    with pytest.raises(SystemExit) as exc:
        doctor.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_srun_tasks_without_torchrun_fail_once(monkeypatch, capsys):
    """`srun -n 2 python tools/doctor.py`: each task had RANK 0 and world size 1, printed
    the whole report and 'all checks passed' without testing any communication."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL: this process is task 0 of the 2 that srun started" in out
    assert "tools/doctor.py ..." in out and out.endswith("result: some checks FAILED\n")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert doctor.main([]) == 1
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("var,value", [("WORLD_SIZE", "two"), ("RANK", "-1"),
                                       ("LOCAL_WORLD_SIZE", "0"), ("LOCAL_RANK", "1.5")])
def test_a_launcher_variable_that_is_no_number_fails_with_its_value(var, value, monkeypatch,
                                                                      capsys):
    """(A ValueError traceback from int().)"""
    monkeypatch.setenv(var, value)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert f"FAIL: {var}='{value}' is not a whole number" in out
    assert out.endswith("result: some checks FAILED\n")


def test_debugging_switches_that_slow_training_are_warned():
    """CUDA_LAUNCH_BLOCKING was not even listed; blocking waits and DETAIL debug were listed
    without a word: each copied from a debugging recipe slows every step."""
    env = {"CUDA_LAUNCH_BLOCKING": "1", "TORCH_NCCL_BLOCKING_WAIT": "1",
           "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    text = "\n".join(doctor.debug_var_warnings(env))
    for var in env:
        assert f"{var}={env[var]}" in text
    assert text.count("unset it") == 3
    assert ("CUDA_LAUNCH_BLOCKING", "1") in doctor.environment(env)
    off = {"CUDA_LAUNCH_BLOCKING": "0", "TORCH_NCCL_BLOCKING_WAIT": "0",
           "TORCH_DISTRIBUTED_DEBUG": "INFO"}
    assert doctor.debug_var_warnings(off) == []
    text, _ = doctor.machine_report(dict(env, MASTER_PORT=str(free_port())))
    assert "WARNING: CUDA_LAUNCH_BLOCKING=1" in text


def test_cpu_oversubscription_and_hidden_gpus_are_warned():
    env = {"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "8"}
    (line,) = doctor.cpu_warnings(env, num_cpus=16)
    assert "32 threads for 16 CPU cores" in line and "OMP_NUM_THREADS=4" in line
    assert doctor.cpu_warnings(dict(env, OMP_NUM_THREADS="4"), num_cpus=16) == []
    assert doctor.cpu_warnings({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"}, 2)[0].endswith(
        "OMP_NUM_THREADS=1")
    (line,) = doctor.cuda_warnings({"CUDA_VISIBLE_DEVICES": ""}, cuda_build=True, num_gpus=0)
    assert "CUDA_VISIBLE_DEVICES=''" in line and "unset it" in line
    assert doctor.cuda_warnings({"CUDA_VISIBLE_DEVICES": ""}, cuda_build=False, num_gpus=0) == []
    assert doctor.cuda_warnings({"CUDA_VISIBLE_DEVICES": "0"}, cuda_build=True, num_gpus=1) == []


def test_small_shared_memory_and_open_files_limit_are_warned():
    text = "\n".join(doctor.host_limit_warnings(shm_free=64 * 2**20, open_files=64))
    assert "/dev/shm has 64 MiB free" in text and "--shm-size" in text
    assert "open-files limit is 64" in text and "ulimit -n 65536" in text
    assert doctor.host_limit_warnings(shm_free=None, open_files=1 << 20) == []
    assert doctor.host_limit_warnings(shm_free=16 * 2**30, open_files=4096) == []
    shm_free, open_files = doctor._host_limits()  # this machine's, read for real
    assert open_files > 0 and (shm_free is None or shm_free >= 0)


def test_missing_or_old_requirements_are_named_with_their_install():
    lines = ["# comment", "-r other.txt", "torch>=2.6", "numpy>=1.24", "sentencepiece>=0.1.99",
             "tensorboard>=2.12", "pyyaml>=6.0"]
    versions = {"torch": "2.5.1+cu121", "numpy": "2.1.0", "tensorboard": "2.11.0",
                "pyyaml": "?"}
    problems, warnings = doctor.requirement_problems(lines, versions.get)
    assert problems == ["torch 2.5.1+cu121 is older than requirements.txt's torch>=2.6: "
                        "pip install -U 'torch>=2.6'"]
    text = "\n".join(warnings)
    assert ("sentencepiece is not installed (needed for SentencePiece tokenizers): "
            "pip install 'sentencepiece>=0.1.99'") in text
    assert "tensorboard 2.11.0 is older than requirements.txt's tensorboard>=2.12" in text
    assert len(warnings) == 2  # pyyaml's version unknown: not judged
    ok = {"torch": "2.13.0+cpu", "numpy": "1.26.4", "sentencepiece": "0.2.0",
          "tensorboard": "2.18.0", "pyyaml": "6.0.2"}
    assert doctor.requirement_problems(lines, ok.get) == ([], [])


def test_a_package_this_python_cannot_import_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` fails
    assert doctor._installed("sentencepiece") is None
    assert doctor._installed("numpy") not in (None, "?")
    _, warnings = doctor.package_checks()
    assert any(w.startswith("sentencepiece is not installed") for w in warnings)
