"""`--cublas-workspace`: the entry point gives cuBLAS no workspace unless told otherwise.

The variables have to be in the environment before torch creates its first cuBLAS handle,
so pretrain_gpt.py sets them between parsing the flags and initialising the process;
a value the user exported is never overwritten.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.initialize import (
    CUBLAS_NO_WORKSPACE,
    CUBLAS_USER_CHOICES,
    check_gemm_without_workspace,
    cublas_workspace_env,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def test_none_gives_cublas_a_zero_workspace():
    assert cublas_workspace_env("none", {}) == {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}
    # a variable set to "0" or "" chooses nothing
    assert cublas_workspace_env("none", {"TORCH_BLAS_PREFER_CUBLASLT": "0"}) == \
        {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}


@pytest.mark.parametrize("name", CUBLAS_USER_CHOICES)
def test_a_users_choice_leaves_the_workspace_alone(name):
    # cuBLASLt preferred fails without a workspace ("OOM trying to allocate workspace for
    # cublaslt", seen on an H200), so TORCH_BLAS_PREFER_CUBLASLT=1 keeps torch's too
    assert cublas_workspace_env("none", {name: "1"}) == {}


def test_a_gemm_that_needs_a_workspace_stops_the_start_with_the_fix():
    def lt_mm(a, b):
        raise RuntimeError("OOM trying to allocate workspace for cublaslt")

    with pytest.raises(SystemExit, match="--cublas-workspace torch"):
        check_gemm_without_workspace(torch.device("cpu"), mm=lt_mm)

    def other_failure(a, b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        check_gemm_without_workspace(torch.device("cpu"), mm=other_failure)
    check_gemm_without_workspace(torch.device("cpu"))  # a product that works passes


def test_torch_choice_sets_nothing_and_bad_choice_is_refused():
    assert cublas_workspace_env("torch", {}) == {}
    with pytest.raises(ValueError, match="use none or torch"):
        cublas_workspace_env("small", {})


def test_flag_defaults_to_none_and_rejects_other_values():
    assert parse_and_validate(TINY, world_size=1).args["cublas_workspace"] == "none"
    cfg = parse_and_validate(TINY + ["--cublas-workspace", "torch"], world_size=1)
    assert cfg.args["cublas_workspace"] == "torch"
    with pytest.raises(ArgumentsError, match="cublas-workspace"):
        parse_and_validate(TINY + ["--cublas-workspace", "big"], world_size=1)


def _run_main(monkeypatch, argv):
    """pretrain_gpt.main up to the training loop; returns the environment pretrain saw."""
    import megatron.initialize as init
    import megatron.training as training

    seen = {}
    monkeypatch.setattr(init, "initialize_distributed",
                        lambda *a, **k: SimpleNamespace(device=torch.device("cpu"),
                                                          control_group=None))
    monkeypatch.setattr(init, "set_random_seed", lambda *a, **k: None)
    monkeypatch.setattr(training, "pretrain",
                        lambda config, rt, **kw: seen.update({n: os.environ.get(n)
                                                        for n in CUBLAS_USER_CHOICES}))
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("pretrain_gpt", None)
    import pretrain_gpt

    assert pretrain_gpt.main(argv) == 0
    return seen


def _clear(monkeypatch):
    for name in CUBLAS_USER_CHOICES:  # setenv first: teardown then restores the original
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_pretrain_gpt_sets_the_variable_before_initialising(monkeypatch):
    _clear(monkeypatch)
    unset = dict.fromkeys(CUBLAS_USER_CHOICES)
    assert _run_main(monkeypatch, TINY) == {**unset, **CUBLAS_NO_WORKSPACE}


def test_pretrain_gpt_keeps_a_users_value_and_honours_torch(monkeypatch):
    _clear(monkeypatch)
    unset = dict.fromkeys(CUBLAS_USER_CHOICES)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert _run_main(monkeypatch, TINY) == {**unset, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert _run_main(monkeypatch, TINY + ["--cublas-workspace", "torch"]) == unset


def test_without_a_workspace_torchs_request_for_one_is_not_shown(monkeypatch):
    """torch warns once that cuBLASLt (addmm with a bias) asked for a workspace larger than
    cuBLAS's, which `--cublas-workspace none` set to 0 on purpose: that warning is hidden
    then, and only then."""
    import warnings

    from megatron import initialize as init

    monkeypatch.setattr(init, "initialize_distributed",
                        lambda *a, **k: SimpleNamespace(device=torch.device("cpu")))
    message = ("Requested unified CUBLASLT workspace size of 1048576 bytes exceeds CUBLAS "
               "workspace size of 0 bytes.")
    for choice, shown in (("torch", 1), ("none", 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            init.initialize_entry_point(None, choice, 0, 1, 0, {})
            warnings.warn(message, UserWarning)
        assert len([w for w in caught if "CUBLASLT workspace" in str(w.message)]) == shown


def test_a_changed_variable_frees_cublas_workspaces_where_cuda_ran(monkeypatch):
    """torch sizes each cuBLAS workspace once but passes cuBLAS the variable's size at
    every product: when an in-process run ends and the variable comes back (":0:0" ->
    absent: a bigger size), the workspaces are freed after the GPU is done, so torch
    makes new ones at the restored size; nothing while CUDA never started, or when the
    variable did not change."""
    from megatron.entry_state import entry_point_changes_undone

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: calls.append("clear"), raising=False)
    env = {}
    with entry_point_changes_undone(env):
        env.update(CUBLAS_NO_WORKSPACE)  # the entry point's export
    assert env == {} and calls == ["sync", "clear"]
    calls.clear()
    env = dict(CUBLAS_NO_WORKSPACE)  # a user's own value, kept by the run
    with entry_point_changes_undone(env):
        pass
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with entry_point_changes_undone(env := {}):
        env.update(CUBLAS_NO_WORKSPACE)
    assert calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_products_after_an_in_process_run_without_a_workspace_survive(tmp_path):
    """A fresh process whose first cuBLAS products ran without a workspace (the entry
    point's ":0:0", inside entry_point_changes_undone), then products with the variable
    restored: they used to write past the 0-byte workspace (illegal memory access,
    CUBLAS_STATUS_INTERNAL_ERROR in the next test of the same process)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import os, torch\n"
        "from megatron.entry_state import entry_point_changes_undone\n"
        "os.environ.pop('CUBLAS_WORKSPACE_CONFIG', None)\n"
        "with entry_point_changes_undone(os.environ):\n"
        "    os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':0:0'\n"
        "    a = torch.randn(256, 256, device='cuda')\n"
        "    (a @ a).sum().item()\n"
        "for n in (256, 1000, 4096):\n"
        "    for dtype in (torch.float32, torch.bfloat16):\n"
        "        b = torch.randn(n, n, device='cuda', dtype=dtype)\n"
        "        (b @ b.t()).float().sum().item()\n"
        "torch.cuda.synchronize()\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
