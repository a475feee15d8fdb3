"""Test-session settings.

Without CUDA, the Triton kernels (AdamW, fused cross entropy) run in Triton's CPU
interpreter. Triton builds its own library functions (tl.sum, tl.max, ...) for the
interpreter only when TRITON_INTERPRET is set before Triton is first imported, so it is
set here, before any test module imports Triton. Where CUDA is visible it stays unset and
the kernels compile for the GPU.
"""
import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in each test process, and by default in the processes tests start
# (ranks get it from tests/dist_utils.cpu_env anyway): the suite runs 2 workers on 2
# cores, and with torch's default of a thread per core the workers' small products spin
# against each other (tests/test_train_loop.py: 134 s of CPU with 2 threads, 19 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture
def triton_interpreter(monkeypatch):
    """For tests that run Triton kernels on CPU tensors: skips without Triton, and where
    CUDA is visible (Triton was imported there without TRITON_INTERPRET; the CUDA tests
    cover that machine); sets TRITON_INTERPRET for the test."""
    pytest.importorskip("triton", reason="Triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("CPU-interpreter test; the CUDA test covers this machine")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def cublas_workspaces_follow_the_variable():
    """A test that changed CUBLAS_WORKSPACE_CONFIG while CUDA ran (an entry point run in
    this process, a monkeypatch undone at its end) would leave torch's cuBLAS workspaces
    sized by a value other than the next test's (megatron.entry_state
    .cublas_workspaces_resized: cuBLAS then writes past them): after each test where CUDA
    has started, they are freed and made anew at the size the variable names."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.entry_state import cublas_workspaces_resized

        cublas_workspaces_resized()


def _restore_environment(saved: dict) -> None:
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test leaves os.environ as it found it. The entry points export settings into
    the process environment (pretrain_gpt.main: TORCH_GLOO_LAZY_INIT, the cuBLAS
    workspace); run in the test process, they stayed for every later test and the
    processes it starts, so a test passed or failed by what ran before it."""
    saved = dict(os.environ)
    yield
    _restore_environment(saved)


@pytest.fixture(autouse=True, scope="module")
def module_environment_restored():
    """The same for each test module: a module-scoped fixture that runs an entry point
    (set up before `environment_restored` saves anything) left its settings to the
    modules after it (seen with pytest -n, where modules run in another order)."""
    saved = dict(os.environ)
    yield
    _restore_environment(saved)


@pytest.fixture(autouse=True)
def signals_noted_forgotten():
    """megatron.signals remembers the last SIGTERM/SIGUSR1 a SignalHandler noted until an
    entry point's run ends (a run's silent ranks then skip their wait for the launcher): a
    test that sent one to a handler of its own must not make a later test skip it."""
    yield
    module = sys.modules.get("megatron.signals")
    if module is not None:
        module._last_noted = 0
