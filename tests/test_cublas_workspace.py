"""`--cublas-workspace`: the entry point gives cuBLAS no workspace unless told otherwise.

The variables have to be in the environment before torch creates its first cuBLAS handle,
so pretrain_gpt.py sets them between parsing the flags and initialising the process;
a value the user exported is never overwritten.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.initialize import CUBLAS_NO_WORKSPACE, cublas_workspace_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def test_none_sets_both_variables_to_zero_workspace():
    assert cublas_workspace_env("none", {}) == {"CUBLAS_WORKSPACE_CONFIG": ":0:0",
                                                "CUBLASLT_WORKSPACE_SIZE": "0"}


@pytest.mark.parametrize("name", sorted(CUBLAS_NO_WORKSPACE))
def test_a_users_variable_keeps_both_untouched(name):
    assert cublas_workspace_env("none", {name: ":4096:8"}) == {}


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
    monkeypatch.setattr(init, "initialize_distributed", lambda *a, **k: object())
    monkeypatch.setattr(init, "set_random_seed", lambda *a, **k: None)
    monkeypatch.setattr(training, "pretrain",
                        lambda config, rt: seen.update({n: os.environ.get(n)
                                                        for n in CUBLAS_NO_WORKSPACE}))
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("pretrain_gpt", None)
    import pretrain_gpt

    assert pretrain_gpt.main(argv) == 0
    return seen


def test_pretrain_gpt_sets_the_variables_before_initialising(monkeypatch):
    for name in CUBLAS_NO_WORKSPACE:  # setenv first: teardown then restores the original
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert _run_main(monkeypatch, TINY) == CUBLAS_NO_WORKSPACE


def test_pretrain_gpt_keeps_a_users_value_and_honours_torch(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "")
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    assert _run_main(monkeypatch, TINY) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                            "CUBLASLT_WORKSPACE_SIZE": None}
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert _run_main(monkeypatch, TINY + ["--cublas-workspace", "torch"]) == {
        "CUBLAS_WORKSPACE_CONFIG": None, "CUBLASLT_WORKSPACE_SIZE": None}
