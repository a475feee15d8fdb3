"""Argument errors under a launcher: a mistake in the flags is printed by rank 0 only (every
rank exits with status 2), while an error that depends on the machine (a missing file, no
CUDA) is printed by the first process of each node that meets it."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from megatron import arguments
from megatron.arguments import parse_and_validate
from megatron.arguments_common import ArgumentsError, prints_error
from tests import forked_script
from tests.dist_utils import cpu_env, free_port

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--lr", "1e-3", "--train-iters", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]


def launch(args, ranks, world_size=None, end_others=True):
    """Start pretrain_gpt.py once per {RANK, LOCAL_RANK} env and, as torchrun does, end the
    others (SIGTERM) once one exits (unless not `end_others`): an argument error never
    reaches the process group. Returns ({RANK: return code} in the order the processes ended, combined output)."""
    procs = {}
    for env_extra in ranks:
        env = cpu_env(WORLD_SIZE=str(world_size or len(ranks)), **env_extra)
        procs[env_extra["RANK"]] = forked_script.Forked(  # forked: the imports come free
            [sys.executable, str(ROOT / "pretrain_gpt.py"), *args], env, cwd=ROOT,
            merge_stderr=True)
    deadline, codes = time.monotonic() + 120, {}
    while not codes and end_others and time.monotonic() < deadline:
        codes = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
        time.sleep(0.05)
    for p in procs.values():
        if end_others and p.poll() is None:
            p.terminate()
    for p in procs.values():
        p.wait(60)
    outs = [p.stdout for p in procs.values()]
    codes.update({r: p.returncode for r, p in procs.items() if r not in codes})
    return codes, "".join(outs)


LAUNCHED = {"TORCHELASTIC_RUN_ID": "test"}  # as torchrun sets it: silent ranks wait
TWO_RANKS = [{"RANK": "0", "LOCAL_RANK": "0", **LAUNCHED},
             {"RANK": "1", "LOCAL_RANK": "1", **LAUNCHED}]


def test_unknown_flag_printed_once_rank_zero_fails_first():
    codes, out = launch(BASE + ["--seq-lenght", "64"], TWO_RANKS)
    assert list(codes.items())[0] == ("0", 2), (codes, out)  # rank 1 waits: ended
    assert codes["1"] != 0, out
    assert out.count("unrecognized arguments: --seq-lenght") == 1, out
    assert out.count("error:") == 1, out


def test_invalid_combination_printed_once():
    codes, out = launch(BASE + ["--fp16", "--bf16"], TWO_RANKS)
    assert list(codes.items())[0] == ("0", 2) and codes["1"] != 0, (codes, out)
    assert out.count("--fp16 and --bf16 are exclusive") == 1, out


def test_dry_run_under_a_launcher_reports_once_per_node():
    """`bash scripts/pretrain_gpt_distributed.sh --dry-run` (torchrun, 8 ranks) printed the
    whole report once per rank; now rank 0 and each node's first process print it (ranks 0
    and 2 of a node of two and a node of one), and every rank exits with the report's
    status (1: a data file missing)."""
    ranks = [{"RANK": str(r), "LOCAL_RANK": str(local), **LAUNCHED}
             for r, local in enumerate((0, 1, 0))]
    args = [a for a in BASE if a != "--mock-data"] + ["--data-path", "/nowhere/c", "--dry-run"]
    codes, out = launch(args, ranks, end_others=False)
    assert codes == {"0": 1, "1": 1, "2": 1}, out
    assert out.count("dry run: configuration resolved") == 2, out
    assert out.count("/nowhere/c.bin and /nowhere/c.idx (--data-path)") == 2, out


def test_missing_file_printed_by_each_node(tmp_path):
    """The first process of each of two nodes (ranks 0 and 2 of 4): the missing vocab file
    is reported by both, naming the rank and host, since another node's files may differ
    (the processes of LOCAL_RANK 1 leave it to them: test_prints_error_rule)."""
    missing = str(tmp_path / "nowhere" / "vocab.json")
    args = [a for a in BASE if a not in ("NullTokenizer", "--vocab-size", "200",
                                         "--tokenizer-type")]
    args += ["--vocab-file", missing, "--merge-file", missing]
    ranks = [{"RANK": "0", "LOCAL_RANK": "0"}, {"RANK": "2", "LOCAL_RANK": "0"}]
    codes, out = launch(args, ranks, world_size=4, end_others=False)
    assert list(codes.values()) == [2, 2], (codes, out)
    assert out.count(f"--vocab-file {missing}: file not found") == 2, out
    assert "(rank 0 on " in out and "(rank 2 on " in out, out


def test_single_process_prints_without_rank_tag(capsys):
    with pytest.raises(ArgumentsError) as exc:
        parse_and_validate(BASE + ["--fp16", "--bf16"], 1, env={}, cuda_available=False)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--fp16 and --bf16 are exclusive" in err and " on " not in err.split("exclusive")[1]


def test_rank_one_is_silent_for_a_flag_error_and_waits_for_rank_zero(capsys, monkeypatch):
    """A silent rank that exits first would have torchrun end rank 0 before it prints."""
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    with pytest.raises(ArgumentsError) as exc:
        parse_and_validate(BASE + ["--fp16", "--bf16"], 2, env={"RANK": "1", **LAUNCHED},
                           cuda_available=False)
    assert exc.value.code == 2 and capsys.readouterr().err == ""
    assert waits == [arguments.SILENT_EXIT_DELAY_S]
    with pytest.raises(ArgumentsError):  # the rank that prints does not wait
        parse_and_validate(BASE + ["--fp16", "--bf16"], 2, env={"RANK": "0", **LAUNCHED},
                           cuda_available=False)
    assert waits == [arguments.SILENT_EXIT_DELAY_S] and "exclusive" in capsys.readouterr().err
    with pytest.raises(ArgumentsError):  # called as a library (no launcher): no wait
        parse_and_validate(BASE + ["--fp16", "--bf16"], 2, env={"RANK": "1"},
                           cuda_available=False)
    assert waits == [arguments.SILENT_EXIT_DELAY_S] and capsys.readouterr().err == ""


@pytest.mark.parametrize("rank, local_rank, machine, expected", [
    (0, 0, False, True), (1, 1, False, False), (5, 0, False, False),
    (0, 0, True, True), (1, 1, True, False), (2, 0, True, True), (3, None, True, True),
])
def test_prints_error_rule(rank, local_rank, machine, expected):
    err = ArgumentsError("x")
    err.machine = machine
    assert prints_error(err, rank, local_rank) is expected


def test_under_torchrun_the_error_is_printed_once():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_gpt.py"), *BASE, "--seq-lenght", "64"]
    proc = forked_script.run(cmd, cwd=ROOT, env=cpu_env(), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert out.count("unrecognized arguments: --seq-lenght") == 1, out
    # torchrun's summary: rank 0 failed first (status 2), the waiting rank 1 was ended
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2" in out, out


def test_help_is_printed_by_rank_zero_only(capsys):
    for rank, printed in (("0", True), ("1", False)):
        with pytest.raises(SystemExit) as exc:
            parse_and_validate(["--help"], 2, env={"RANK": rank}, cuda_available=False)
        assert exc.value.code == 0
        assert ("--tensor-model-parallel-size" in capsys.readouterr().out) is printed, rank


@pytest.mark.parametrize("rank, local_rank, machine, world, prints, tagged", [
    (0, 0, True, 1, True, False), (0, 0, True, 4, True, True), (2, 0, True, 4, True, True),
    (1, 1, True, 4, False, False), (2, 0, False, 4, False, False),
])
def test_exit_before_group(rank, local_rank, machine, world, prints, tagged, capsys,
                           monkeypatch):
    """A file error met before any process group (an entry point's checkpoint or data
    file): printed by rank 0 and each node's first process with rank and host; the others
    wait under a launcher; the SystemExit to raise has status 1."""
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    env = {"LOCAL_RANK": str(local_rank), **LAUNCHED}
    exc = arguments.exit_before_group(SystemExit("error: --load /x does not exist"), rank,
                                      world, env, machine=machine)
    assert isinstance(exc, SystemExit) and exc.code == 1
    err = capsys.readouterr().err
    assert ("error: --load /x does not exist" in err) is prints
    assert (f"(rank {rank} on " in err) is tagged
    assert waits == ([] if prints or world == 1 else [arguments.SILENT_EXIT_DELAY_S])
    status = SystemExit(3)
    assert arguments.exit_before_group(status, rank, world, env) is status


def test_zero_shot_file_errors_print_once_per_node(tmp_path, capsys):
    """tasks/main.py reads --load and --valid-data before any process group: rank 1 of a
    node leaves the message to the node's first process."""
    from tasks.zeroshot_gpt import evaluate

    (tmp_path / "l.jsonl").write_text('{"text": "1 2 3"}\n')
    argv = ["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl"), "--load",
            str(tmp_path / "none")] + BASE[:-4] + ["--tokenizer-type", "NullTokenizer",
                                                  "--vocab-size", "200"]
    for rank, printed in ((0, True), (1, False)):
        with pytest.raises(SystemExit) as exc:
            evaluate.main(argv, rank=rank, world_size=2, local_rank=rank)
        assert exc.value.code == 1
        err = capsys.readouterr().err
        assert (f"--load {tmp_path / 'none'} does not exist" in err) is printed, (rank, err)
