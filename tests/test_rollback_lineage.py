"""--nan-loss-policy rollback reloads only a checkpoint of this run's line: one it saved, or
the one it resumed from in --save. A checkpoint an earlier run left in --save, below the NaN
iteration as well as beyond it, is refused with an error naming it."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron import checkpointing
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.trainer_checkpoint import load_trainer_checkpoint
from megatron.training import build_trainer, data_iterator, train
from tests.gpt_helpers import tiny_config


def _trainer(save, save_interval=4, load=None, policy="rollback", exit_interval=None):
    cfg = tiny_config(iters=8)  # one schedule for every run: a resume keeps it
    cfg.training = dataclasses.replace(cfg.training, nan_loss_policy=policy,
                                       exit_interval=exit_interval)
    cfg.logging = dataclasses.replace(cfg.logging, log_interval=2)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, save=str(save), load=load,
                                         save_interval=save_interval)
    ps = ParallelState.build(1, 0)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    if load:
        load_trainer_checkpoint(tr)
    return tr


def _poison_at(tr, bad_iterations):
    """NaN per-token losses during the given (1-based, counted from the trainer's start
    iteration) iterations."""
    module, start = tr.model.module, tr.state.iteration
    original, calls = module.forward, {"n": 0}
    per_step = tr.config.data.num_micro_batches

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        calls["n"] += 1
        iteration = start + (calls["n"] - 1) // per_step + 1
        return out * float("nan") if iteration in bad_iterations else out

    module.forward = forward


def _run(tr):
    train(tr, data_iterator(tr.config, tr.rt, "train", tr.state.consumed_train_samples), None)


def _earlier_run(save, iters=2):
    """An earlier run that left a checkpoint at `iters` in `save` (and stopped there)."""
    tr = _trainer(save, save_interval=iters, policy="skip", exit_interval=iters)
    _run(tr)
    assert checkpointing.read_tracker(str(save))[0] == iters


def test_refuses_an_earlier_runs_checkpoint_below_the_nan(tmp_path, capsys):
    save = tmp_path / "ckpt"
    _earlier_run(save, iters=2)
    tr = _trainer(save, save_interval=6)  # starts from scratch: no --load
    _poison_at(tr, {4})
    with pytest.raises(SystemExit) as exc:
        _run(tr)
    text = str(exc.value.code)
    assert text.startswith(f"error: NaN/Inf loss at iteration 4, and the last checkpoint in "
                           f"--save {save} is iteration 2, which this run neither saved nor "
                           "resumed from"), text
    assert "started from scratch" in text and f"--load {save}" in text
    assert tr.state.iteration == 4
    assert "rolled back" not in capsys.readouterr().out


def test_rolls_back_to_the_checkpoint_it_resumed_from(tmp_path, capsys):
    save = tmp_path / "ckpt"
    _earlier_run(save, iters=2)
    tr = _trainer(save, save_interval=100, load=str(save))
    assert tr.state.iteration == 2
    _poison_at(tr, {4})
    _run(tr)
    assert tr.state.iteration == 8
    out = capsys.readouterr().out
    assert (f"rolled back from iteration 4 to 2 (the checkpoint this run resumed from, in "
            f"--save {save})") in out, out


def test_rolls_back_to_its_own_save(tmp_path, capsys):
    save = tmp_path / "ckpt"
    _earlier_run(save, iters=2)
    tr = _trainer(save, save_interval=3)  # from scratch; its own save at 3
    _poison_at(tr, {5})
    _run(tr)
    assert tr.state.iteration == 8
    assert "rolled back from iteration 5 to 3 (the checkpoint this run saved" in \
        capsys.readouterr().out


def test_checkpoint_resumed_from_another_directory_is_not_this_runs_in_save(tmp_path):
    """--load A --save B: B's tracker names an earlier run's iteration, not this run's."""
    a, b = tmp_path / "a", tmp_path / "b"
    _earlier_run(a, iters=2)
    _earlier_run(b, iters=3)
    tr = _trainer(b, save_interval=100, load=str(a))
    _poison_at(tr, {5})
    with pytest.raises(SystemExit, match=r"iteration 3, which this run neither saved nor "
                                         r"resumed from.*started at iteration 2 from --load"):
        _run(tr)
    assert os.path.isdir(b / "iter_0000003")
