import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import ROOT, cpu_env, run_distributed

SESSION_LAZY_INIT = os.environ.get("TORCH_GLOO_LAZY_INIT")  # as the tests started


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t


def test_run_distributed_collects_every_rank():
    out = run_distributed(_allreduce, 2)
    assert [float(t) for t in out] == [3.0, 3.0]


def test_cpu_env_hides_cuda_from_the_child():
    """On a machine with one GPU the two ranks of a torchrun a test starts picked NCCL
    (and local rank 1 had no GPU): the child environment hides CUDA."""
    base = {"CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin", "PYTHONPATH": "/elsewhere"}
    env = cpu_env(base, RANK="1")
    assert env == {"CUDA_VISIBLE_DEVICES": "", "PATH": "/bin", "PYTHONPATH": str(ROOT),
                   "OMP_NUM_THREADS": "1", "RANK": "1"}
    assert base["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's mapping is left as it was
    assert cpu_env()["PATH"] == os.environ.get("PATH")  # default: this process's environment
    assert cpu_env(OMP_NUM_THREADS="2")["OMP_NUM_THREADS"] == "2"  # extras win


def test_every_launching_test_module_uses_cpu_env():
    """A test module that starts torchrun (or pretrain_gpt.py / tasks/main.py as processes)
    gives them cpu_env(): a copy of os.environ would let them see the GPU."""
    launch = re.compile(r'"torch\.distributed\.run"|"(pretrain_gpt|main)\.py"\)?, \*')
    missing = [p.name for p in sorted(Path(__file__).parent.glob("test_*.py"))
               if launch.search(p.read_text()) and "cpu_env(" not in p.read_text()]
    assert not missing, missing


def test_an_entry_point_run_in_the_test_process_exports_its_settings():
    """The first half of the next test: what pretrain_gpt.main does to os.environ."""
    from megatron.initialize import gloo_lazy_init_env

    if SESSION_LAZY_INIT is not None:
        pytest.skip("TORCH_GLOO_LAZY_INIT is set where the tests run")
    os.environ.update(gloo_lazy_init_env(os.environ))
    assert os.environ["TORCH_GLOO_LAZY_INIT"] == "1"


def test_the_next_test_starts_without_them():
    """(Runs after the previous test.) The environment a test leaves is not the next
    one's: tests/conftest.py restores os.environ after each test."""
    assert os.environ.get("TORCH_GLOO_LAZY_INIT") == SESSION_LAZY_INIT


def test_a_port_handed_out_is_not_handed_out_again_while_claimed(tmp_path, monkeypatch):
    """free_port() claims what it returns for RESERVED_S (tests side by side, pytest -n,
    would otherwise both pick a port released before its listener binds it); a claim
    older than that is taken over."""
    from tests import dist_utils

    monkeypatch.setattr(dist_utils, "PORT_DIR", tmp_path)
    port = dist_utils.free_port()
    assert (tmp_path / str(port)).exists()
    assert not dist_utils._reserve(port)  # another process asking within RESERVED_S
    old = time.time() - dist_utils.RESERVED_S - 1
    os.utime(tmp_path / str(port), (old, old))
    assert dist_utils._reserve(port)  # a stale claim is taken over
    assert not dist_utils._reserve(port)
    monkeypatch.setattr(dist_utils, "_reserve", lambda p: p != port)
    monkeypatch.setattr(dist_utils.random.Random, "randrange", lambda self, a, b: port)
    other = dist_utils.free_port()  # every pick claimed: bind(0) after 64 tries
    assert other != port


def test_a_module_fixture_leaves_the_environment_to_no_later_module(tmp_path):
    """A module-scoped fixture is set up before the per-test restore saves os.environ:
    what it exported (an entry point run in-process) stayed for the modules after it.
    tests/conftest.py restores the environment after each module too."""
    import shutil
    import subprocess
    import sys

    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_a.py").write_text(
        "import os, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def exported():\n    os.environ['MEGATRON_TEST_LEAK'] = '1'\n\n"
        "def test_a(exported):\n    assert os.environ['MEGATRON_TEST_LEAK'] == '1'\n")
    (tmp_path / "test_b.py").write_text(
        "import os\n"
        "def test_b():\n    assert 'MEGATRON_TEST_LEAK' not in os.environ\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "test_a.py", "test_b.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:]


def _rank(rank, world_size, log):
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    if rank == 1 and os.environ.get("TEST_KILL_RANK_1"):
        os.kill(os.getpid(), 9)
    return rank


def test_a_rank_lost_in_the_gloo_set_up_starts_the_run_again(tmp_path, monkeypatch, capfd):
    """A forked rank that dies in gloo's set-up (CI: 'Connection closed by peer' in
    connectFullMesh on rank 0, its peer gone) fails the harness, not the code under test:
    the run is started again once, and what happened is printed."""
    real_init = dist.init_process_group
    marker = tmp_path / "died"

    def init_that_loses_rank_1_once(*a, **kw):
        if kw.get("rank") == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), 9)
        return real_init(*a, **kw)

    monkeypatch.setattr(dist, "init_process_group", init_that_loses_rank_1_once)
    assert run_distributed(_rank, 2, str(tmp_path / "log")) == [0, 1]
    assert sorted((tmp_path / "log").read_text().split()) == ["0", "1"]  # fn ran once
    err = capfd.readouterr().err
    assert "starting them again" in err and "rank 1 --- was ended by SIGKILL" in err


def test_a_rank_lost_in_the_function_is_reported_not_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_KILL_RANK_1", "1")
    with pytest.raises(RuntimeError, match="rank 1 --- was ended by SIGKILL"):
        run_distributed(_rank, 2, str(tmp_path / "log"))
    assert sorted((tmp_path / "log").read_text().split()) == ["0", "1"]


def _collect(rank, world_size):
    import gc

    gc.collect()
    return rank


def test_a_rank_never_collects_what_it_inherited(monkeypatch):
    """A TCPStore server left as garbage in the test process (a reference cycle), inherited
    by a forked rank and collected there, joined its daemon thread -- which exists in the
    parent only -- for ever (a CI run hung so). Forks happen with the objects frozen."""
    import gc

    from tests import dist_utils

    monkeypatch.setattr(dist_utils, "RUN_TIMEOUT_S", 90)
    gc.disable()  # the garbage stays until the fork, as an old generation's would
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        cycle = [store]
        cycle.append(cycle)
        del store, cycle
        assert run_distributed(_collect, 2) == [0, 1]
    finally:
        gc.enable()
        gc.collect()


def _inductor_state(rank, world_size):
    import sys

    dynamo = "torch._dynamo" in sys.modules
    import torch._inductor.config as inductor_config

    return dynamo, inductor_config.compile_threads


def test_a_rank_compiles_in_its_own_thread_without_importing_inductor_first():
    """A forked rank compiles with one thread (the parent's compile pool is not inherited
    with its threads), and imports neither inductor nor torch._dynamo (~2 s of CPU per
    rank) for it where the test process has not."""
    import sys

    parent_had_dynamo = "torch._dynamo" in sys.modules
    [(dynamo, threads)] = run_distributed(_inductor_state, 1)
    assert threads == 1
    assert dynamo == parent_had_dynamo
