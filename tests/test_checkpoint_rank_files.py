"""A checkpoint whose files do not all belong together, loaded by a Trainer on 2 gloo ranks
(tp 2: each rank reads its own mp_rank_XX file; rank 0 checks the first one for all).

A file copied from another checkpoint into mp_rank_01 -- another iteration of the run, a
file without the optimizer state, one whose states the loaders reject -- loaded on rank 1
alone: the ranks resumed at different iterations (a hang in the first training step), or
rank 1 stopped with a KeyError traceback while rank 0 waited in the load's agreement (a
connection error on gloo, the timeout on NCCL). Every rank must exit together with one
report naming rank 1, its file, what is wrong and the fix (megatron/checkpoint_identity.py).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from megatron.arguments import parse_and_validate
from megatron.checkpoint_identity import DISTRIB_IDENTITY_KEY, file_identity, rank_file_problem
from megatron.checkpointing import write_tracker
from megatron.initialize import initialize_distributed, set_random_seed
from megatron.trainer_checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 "
        "--train-iters 8 --mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
        "--make-vocab-size-divisible-by 64 --use-cpu-initialization --num-workers 0")
TP2 = "--tensor-model-parallel-size 2"


def _trainer(rank, world, extra, save=None, load=None):
    cfg = parse_and_validate(f"{BASE} {extra}".split(), world_size=world, env={"RANK": str(rank)},
                             cuda_available=False)
    cfg.checkpoint.save, cfg.checkpoint.load = save, load
    rt = initialize_distributed(cfg.parallel, rank, world, 0)
    set_random_seed(cfg.training.seed, rt)
    return cfg, rt, build_trainer(cfg, rt)


def _save_at_2_and_4(rank, world, root, extra=TP2):
    cfg, rt, tr = _trainer(rank, world, extra, save=root)
    data = data_iterator(cfg, rt, "train", 0)
    for _ in range(2):
        for _ in range(2):
            assert train_step(tr, data)[1]
            tr.state.iteration += 1
            tr.state.consumed_train_samples += cfg.data.global_batch_size
        save_trainer_checkpoint(tr)


def _load(rank, world, root, extra=TP2):
    """(the SystemExit message or None, the iteration loaded)."""
    _, _, tr = _trainer(rank, world, extra, load=root)
    try:
        load_trainer_checkpoint(tr)
    except SystemExit as exc:
        return str(exc), tr.state.iteration
    return None, tr.state.iteration


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2") / "ck")
    run_distributed(_save_at_2_and_4, 2, root)
    return root


def _rank1_file(root, iteration, rank_dir="mp_rank_01"):
    return os.path.join(root, f"iter_{iteration:07d}", rank_dir, "model_optim_rng.pt")


def _mixed(saved, tmp_path, edit):
    """A copy of `saved`'s iteration-2 checkpoint whose mp_rank_01 file `edit` changed
    (`edit(path)`), with the tracker naming iteration 2."""
    root = str(tmp_path / "mixed")
    shutil.copytree(saved, root)
    write_tracker(root, 2, False)
    edit(root)
    return root, _rank1_file(root, 2)


def _rewrite_rank1(change, rank_dir="mp_rank_01"):
    def edit(root):
        path = _rank1_file(root, 2, rank_dir)
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)
    return edit


def _assert_one_report_naming_rank_1(results, path, *parts):
    (m0, _), (m1, _) = results
    assert m0 is not None and m0 == m1, results
    assert m0.startswith("rank 1 (of 2): error: "), m0
    for part in (path, "point --load at another checkpoint") + parts:
        assert part in m0, (part, m0)


def test_a_file_of_another_iteration_exits_every_rank_instead_of_hanging(saved, tmp_path):
    """iter_0000004's mp_rank_01 copied into iter_0000002: rank 1 resumed at iteration 4,
    rank 0 at 2 -- both 'successfully loaded', then the run hung in its first step."""
    root, path = _mixed(saved, tmp_path, lambda r: shutil.copy(_rank1_file(r, 4),
                                                               _rank1_file(r, 2)))
    results = run_distributed(_load, 2, root)
    _assert_one_report_naming_rank_1(results, path, "iteration 4 (the first file: 2)",
                                     "consumed training samples 16 (the first file: 8)",
                                     f"Copy {path} again")


def test_a_file_without_the_optimizer_state_exits_every_rank(saved, tmp_path):
    """Rank 0's file has the optimizer state, rank 1's not (saved with --no-save-optim):
    rank 1 raised KeyError: 'optimizer' alone, rank 0 waited in the agreement."""
    def drop(state):
        del state["optimizer"], state["opt_param_scheduler"]
    root, path = _mixed(saved, tmp_path, _rewrite_rank1(drop))
    results = run_distributed(_load, 2, root)
    _assert_one_report_naming_rank_1(results, path,
                                     "optimizer state absent (the first file: present)")


def test_a_file_whose_states_the_loaders_reject_exits_every_rank(saved, tmp_path):
    """Same iteration, counters and states, but an optimizer state of another shape: the
    optimizer's load raised on rank 1 alone (not a SystemExit)."""
    def damage(state):
        del state["optimizer"]["param_groups"]
    root, path = _mixed(saved, tmp_path, _rewrite_rank1(damage))
    results = run_distributed(_load, 2, root)
    _assert_one_report_naming_rank_1(results, path, "cannot restore the states held in",
                                     f"Copy {path} again")


def test_a_damaged_shard_read_by_one_rank_while_resharding_exits_every_rank(tmp_path):
    """A pp-2 checkpoint of the plain optimizer resumed with the distributed one is
    resharded on load: each stage reads its own shard only. Stage 1's file with a damaged
    optimizer state raised on rank 1 alone (not a SystemExit): rank 0 waited."""
    saved = str(tmp_path / "pp2")
    pp2 = "--pipeline-model-parallel-size 2"
    run_distributed(_save_at_2_and_4, 2, saved, pp2)

    def damage(state):
        del state["optimizer"]["param_groups"]
    root, _ = _mixed(saved, tmp_path, _rewrite_rank1(damage, "mp_rank_00_001"))
    results = run_distributed(_load, 2, root, f"{pp2} --use-distributed-optimizer")
    _assert_one_report_naming_rank_1(results, os.path.join(root, "iter_0000002"),
                                     "cannot reshard")


def test_the_files_of_one_checkpoint_load(saved):
    results = run_distributed(_load, 2, saved)
    assert results == [(None, 4), (None, 4)]


def test_rank_file_problem_units():
    first = file_identity({"iteration": 2, "args": {"tensor_model_parallel_size": 2},
                           "optimizer": {}, "opt_param_scheduler": {}}, "a/mp_rank_00/f.pt")
    other_tp = {"iteration": 2, "args": {"tensor_model_parallel_size": 1},
                "optimizer": {}, "opt_param_scheduler": {}}
    message = rank_file_problem(other_tp, "a/mp_rank_01/f.pt", first)
    assert "tensor-parallel size 1 (the first file: 2)" in message
    assert rank_file_problem(torch.zeros(2), "a/mp_rank_01/f.pt", first).startswith(
        "error: a/mp_rank_01/f.pt holds a Tensor, not a checkpoint's dictionary")
    same = dict(other_tp, args={"tensor_model_parallel_size": 2})
    assert rank_file_problem(same, "a/mp_rank_01/f.pt", first) is None
    assert rank_file_problem(other_tp, "a/mp_rank_01/f.pt", None) is None  # unknown first


# ------------------------------------------------- distrib_optim.pt, one rank's file rejected
DO = f"{TP2} --use-distributed-optimizer"


@pytest.fixture(scope="module")
def saved_do(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2do") / "ck")
    run_distributed(_save_at_2_and_4, 2, root, DO)
    return root


def _distrib(root, iteration, rank_dir="mp_rank_01"):
    return os.path.join(root, f"iter_{iteration:07d}", rank_dir, "distrib_optim.pt")


def _rewrite_distrib1(change):
    def edit(root):
        path = _distrib(root, 2)
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)
    return edit


def test_a_distrib_optim_file_of_another_iteration_exits_every_rank(saved_do, tmp_path):
    """iter_0000004's mp_rank_01/distrib_optim.pt copied into iter_0000002 (same shapes):
    rank 1 resumed with the Adam moments of iteration 4 (the weights too: fp32), silently."""
    root, _ = _mixed(saved_do, tmp_path, lambda r: shutil.copy(_distrib(r, 4), _distrib(r, 2)))
    path = _distrib(root, 2)
    results = run_distributed(_load, 2, root, DO)
    _assert_one_report_naming_rank_1(results, path, "iteration 4 (its model file: 2)",
                                     "consumed training samples 16 (its model file: 8)",
                                     "distrib_optim.pt does not belong with",
                                     f"Copy {path} again")


def test_a_distrib_optim_file_without_the_identity_record_loads(saved_do, tmp_path):
    """A distrib_optim.pt of an older save (no record): nothing to check, it loads."""
    def drop(state):
        assert state.pop(DISTRIB_IDENTITY_KEY) == {"iteration": 2, "consumed_train_samples": 8}
    root, _ = _mixed(saved_do, tmp_path, _rewrite_distrib1(drop))
    assert run_distributed(_load, 2, root, DO) == [(None, 2), (None, 2)]


def test_one_rank_distrib_file_rejected_names_the_file_not_flags(saved_do, tmp_path):
    """Rank 1's distrib_optim.pt holds a shorter buffer (a file of another model copied in):
    the report named only the iteration directory and said the model differs -- advice to
    change flags, while rank 0 loaded its file of the same checkpoint fine."""
    def shorten(state):
        state[0] = {dtype: {k: v[:10] for k, v in flats.items()}
                    for dtype, flats in state[0].items()}
    root, _ = _mixed(saved_do, tmp_path, _rewrite_distrib1(shorten))
    path = _distrib(root, 2)
    (m0, _), (m1, _) = run_distributed(_load, 2, root, DO)
    assert m0 == m1 and m0.startswith(f"rank 1 (of 2): error: {path} does not fit this run, "
                                      "while the other ranks loaded their files"), m0
    assert "This file alone is bad" in m0 and "no flag fixes it" in m0, m0


def _reshard_tp1(root, out):
    from tools import checkpoint_convert
    checkpoint_convert.reshard(root, out, 1, 1)


def test_offline_tools_refuse_a_rank_file_of_another_iteration(saved, tmp_path):
    """generate.py, checkpoint_convert.py reshard (and checkpoint_util.py, which runs it)
    merged rank 1's iteration-4 shards with rank 0's iteration-2 ones: a model of two steps,
    written or sampled with no word (to-megatron exported the mix as it was)."""
    from tools import generate
    root, path = _mixed(saved, tmp_path, lambda r: shutil.copy(_rank1_file(r, 4),
                                                               _rank1_file(r, 2)))
    from tools import checkpoint_convert
    for run in (lambda: generate.load_model(root),
                lambda: _reshard_tp1(root, str(tmp_path / "out")),
                lambda: checkpoint_convert.to_megatron(root, str(tmp_path / "out"))):
        with pytest.raises(SystemExit) as exc:
            run()
        assert str(exc.value).startswith(f"error: {path} does not belong with "), exc.value
        assert "iteration 4 (the first file: 2)" in str(exc.value)
    assert not os.path.exists(tmp_path / "out" / "iter_0000002")


def test_offline_reshard_refuses_a_distrib_file_of_another_iteration(saved_do, tmp_path):
    """The optimizer state is read (reshard) only: generate.py, which needs the weights
    alone, loads."""
    from tools import checkpoint_convert, generate
    root, _ = _mixed(saved_do, tmp_path, lambda r: shutil.copy(_distrib(r, 4), _distrib(r, 2)))
    with pytest.raises(SystemExit) as exc:
        _reshard_tp1(root, str(tmp_path / "out"))
    assert str(exc.value).startswith(f"error: {_distrib(root, 2)} does not belong with "), \
        exc.value
    assert generate.load_model(root)[2] == 2
    with pytest.raises(SystemExit, match="distrib_optim.pt does not belong with"):
        checkpoint_convert.to_megatron(root, str(tmp_path / "meg"))
    checkpoint_convert_ok = str(tmp_path / "ok")
    _reshard_tp1(saved_do, checkpoint_convert_ok)  # the record is written by the tool too
    written = torch.load(os.path.join(checkpoint_convert_ok, "iter_0000004", "mp_rank_00",
                                      "distrib_optim.pt"), weights_only=True)
    assert written[DISTRIB_IDENTITY_KEY] == {"iteration": 4, "consumed_train_samples": 16}
