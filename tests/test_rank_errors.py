"""Argument errors under a launcher: a mistake in the flags is printed by rank 0 only (every
rank exits with status 2), while an error that depends on the machine (a missing file, no
CUDA) is printed by the first process of each node that meets it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.arguments import parse_and_validate
from megatron.arguments_common import ArgumentsError, prints_error

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--lr", "1e-3", "--train-iters", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]


def launch(args, ranks):
    """Start pretrain_gpt.py once per {RANK, LOCAL_RANK} env (as torchrun would, without the
    process group, which an argument error never reaches); (return codes, combined output)."""
    procs = []
    for env_extra in ranks:
        env = dict(os.environ, WORLD_SIZE=str(len(ranks)), PYTHONPATH=str(ROOT),
                   OMP_NUM_THREADS="1", **env_extra)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *args],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return [p.returncode for p in procs], "".join(outs)


TWO_RANKS = [{"RANK": "0", "LOCAL_RANK": "0"}, {"RANK": "1", "LOCAL_RANK": "1"}]


def test_unknown_flag_printed_once_all_ranks_fail():
    codes, out = launch(BASE + ["--seq-lenght", "64"], TWO_RANKS)
    assert codes == [2, 2], out
    assert out.count("unrecognized arguments: --seq-lenght") == 1, out
    assert out.count("error:") == 1, out


def test_invalid_combination_printed_once():
    codes, out = launch(BASE + ["--fp16", "--bf16"], TWO_RANKS)
    assert codes == [2, 2], out
    assert out.count("--fp16 and --bf16 are exclusive") == 1, out


def test_missing_file_printed_by_each_node(tmp_path):
    """Two nodes of two processes each: the missing vocab file is reported once per node,
    naming the rank and host, since another node's files may differ."""
    missing = str(tmp_path / "nowhere" / "vocab.json")
    args = [a for a in BASE if a not in ("NullTokenizer", "--vocab-size", "200",
                                         "--tokenizer-type")]
    args += ["--vocab-file", missing, "--merge-file", missing]
    ranks = [{"RANK": str(r), "LOCAL_RANK": str(r % 2)} for r in range(4)]
    codes, out = launch(args, ranks)
    assert codes == [2, 2, 2, 2], out
    assert out.count(f"--vocab-file {missing}: file not found") == 2, out
    assert "rank 2 on " in out and "rank 1 on " not in out and "rank 3 on " not in out, out


def test_single_process_prints_without_rank_tag(capsys):
    with pytest.raises(ArgumentsError) as exc:
        parse_and_validate(BASE + ["--fp16", "--bf16"], 1, env={}, cuda_available=False)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--fp16 and --bf16 are exclusive" in err and " on " not in err.split("exclusive")[1]


def test_rank_one_is_silent_for_a_flag_error(capsys):
    with pytest.raises(ArgumentsError):
        parse_and_validate(BASE + ["--fp16", "--bf16"], 2, env={"RANK": "1"}, cuda_available=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rank, local_rank, machine, expected", [
    (0, 0, False, True), (1, 1, False, False), (5, 0, False, False),
    (0, 0, True, True), (1, 1, True, False), (2, 0, True, True), (3, None, True, True),
])
def test_prints_error_rule(rank, local_rank, machine, expected):
    err = ArgumentsError("x")
    err.machine = machine
    assert prints_error(err, rank, local_rank) is expected
