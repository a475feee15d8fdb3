"""--dry-run --load with a distributed-optimizer checkpoint: every rank's distrib_optim.pt
is checked (present and readable) whether the run reads its own shard or reshards."""
from __future__ import annotations

import shutil

import pytest
import torch

from megatron.arguments import parse_and_validate, run_dry_run

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 "
        "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data --bf16 "
        "--use-distributed-optimizer").split()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A distributed-optimizer checkpoint at iteration 10 ("tp1"), and the same files
    laid out as tensor-parallel size 2 ("tp2": rank 0's shard copied as rank 1, its args
    saying tp 2; the layout and file structure are all the dry run reads)."""
    from megatron.checkpoint_files import load_checkpoint_file
    from megatron.trainer_checkpoint import save_trainer_checkpoint
    from tests.gpt_helpers import cli_trainer

    root = tmp_path_factory.mktemp("ckpt")
    _, _, tr = cli_trainer(BASE + ["--save", str(root / "tp1"), "--save-interval", "10"])
    tr.state.iteration, tr.state.consumed_train_samples = 10, 20
    tr.scheduler.step(20)
    save_trainer_checkpoint(tr)
    it = root / "tp2" / "iter_0000010"
    shutil.copytree(root / "tp1", root / "tp2")
    shutil.copytree(it / "mp_rank_00", it / "mp_rank_01")
    state = load_checkpoint_file(str(it / "mp_rank_00" / "model_optim_rng.pt"))
    state["args"]["tensor_model_parallel_size"] = 2
    torch.save(state, it / "mp_rank_00" / "model_optim_rng.pt")
    return root


def dry(capsys, extra):
    """(exit status, printed report) of pretrain_gpt.py's --dry-run path."""
    argv = BASE + extra.split()
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    status = run_dry_run(cfg, 1)
    return status, capsys.readouterr().out


def test_own_layout_checks_distrib_file(saved, capsys, tmp_path):
    status, out = dry(capsys, f"--load {saved}/tp1")
    assert status == 0 and "layout: saved with tp 1, pp 1, distributed optimizer; each " \
                           "rank reads its own shard" in out
    root = tmp_path / "ck"
    shutil.copytree(saved / "tp1", root)
    distrib = root / "iter_0000010" / "mp_rank_00" / "distrib_optim.pt"
    distrib.write_bytes(distrib.read_bytes()[:3000])
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: cannot read checkpoint file {distrib}" in out


def test_resharding_checks_every_distrib_file(saved, capsys, tmp_path):
    """Resharding reads every rank's distrib_optim.pt: a missing or truncated one is a
    problem the real run stops on, so the dry run names it."""
    status, out = dry(capsys, f"--load {saved}/tp2")
    assert status == 0 and "resharded on load: saved with tp 2, pp 1, distributed " \
                           "optimizer" in out
    root = tmp_path / "ck"
    shutil.copytree(saved / "tp2", root)
    distrib = root / "iter_0000010" / "mp_rank_01" / "distrib_optim.pt"
    distrib.write_bytes(distrib.read_bytes()[:3000])
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: cannot read checkpoint file {distrib}" in out
    distrib.unlink()
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"checkpoint file(s) missing: {distrib}" in out
    # without the optimizer state, distrib_optim.pt is not read
    status, out = dry(capsys, f"--load {root} --no-load-optim")
    assert status == 0, out
