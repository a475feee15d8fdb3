"""The NaN-loss policies and the preemption signal handler, in one process."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time

import pytest
import torch

from megatron import checkpointing
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.signals import SignalHandler
from megatron.training import build_trainer, data_iterator, train
from tests.gpt_helpers import tiny_config


def _trainer(tmp_path, policy="stop", iters=8, save_interval=None):
    cfg = tiny_config(iters=iters)
    cfg.training = dataclasses.replace(cfg.training, nan_loss_policy=policy)
    cfg.logging = dataclasses.replace(cfg.logging, log_interval=2)
    if save_interval:
        cfg.checkpoint = dataclasses.replace(cfg.checkpoint, save=str(tmp_path / "ckpt"),
                                             save_interval=save_interval)
    ps = ParallelState.build(1, 0)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    return build_trainer(cfg, rt)


def _poison_at(tr, bad_iterations):
    """Make the model's per-token losses NaN during the given (1-based) iterations."""
    module = tr.model.module
    original = module.forward
    calls = {"n": 0}
    per_step = tr.config.data.num_micro_batches

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        calls["n"] += 1
        iteration = (calls["n"] - 1) // per_step + 1
        return out * float("nan") if iteration in bad_iterations else out

    module.forward = forward
    return calls


def _params(tr):
    return {n: p.detach().clone() for n, p in tr.model.module.named_parameters()}


def test_stop_policy_names_the_iteration(tmp_path, capsys):
    tr = _trainer(tmp_path, "stop")
    _poison_at(tr, {3})
    with pytest.raises(SystemExit, match="NaN/Inf loss at iteration 3"):
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    out = capsys.readouterr().out
    assert "non-finite loss (nan) at iteration 3\n" in out
    # detected at the log interval (iteration 4): iterations 3 and 4 both had NaN losses
    assert "number of nan iterations:   2" in out


@pytest.mark.parametrize("save_interval, resume", [
    (None, r"There is no checkpoint to resume from \(no --save\); start again"),
    (6, r"--save \S+ckpt holds no checkpoint yet to resume from; start again"),
    (2, r"Resume from the last checkpoint, \S+ckpt/iter_0000002 \(--load \S+ckpt\)")])
def test_the_stop_policy_names_the_checkpoint_to_resume_from(tmp_path, save_interval, resume):
    """The stop message said "Resume from the last checkpoint" whether or not the run had
    written one; it names the checkpoint --save holds, or says there is none."""
    tr = _trainer(tmp_path, "stop", save_interval=save_interval)
    _poison_at(tr, {3})
    with pytest.raises(SystemExit) as stop:
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert re.fullmatch(r"error: NaN/Inf loss at iteration 3; stopping \(--nan-loss-policy "
                        rf"stop\)\. {resume}, or use --nan-loss-policy skip\|rollback",
                        str(stop.value.code)), stop.value.code


def test_nan_origin_comes_from_one_rank_per_data_parallel_replica():
    """Every tensor- and pipeline-parallel rank of a replica holds its loss (the pipeline
    broadcasts it): only the last stage's tensor-parallel rank 0 speaks for the replica
    (not tp x pp ranks: 64 per replica at tp 8, pp 8)."""
    from types import SimpleNamespace

    from megatron.interval_log import nonfinite_origins

    for tp_rank, pp_rank, counted in ((0, 1, True), (1, 1, False), (0, 0, False)):
        ps = SimpleNamespace(rank=7, tp_rank=tp_rank, pp_rank=pp_rank, pp_size=2, dp_rank=1,
                             dp_size=2)
        kinds = nonfinite_origins(SimpleNamespace(rt=SimpleNamespace(ps=ps)),
                                  torch.tensor(float("nan")))
        assert kinds.tolist() == ([0.0, 1.0] if counted else [0.0, 0.0]), (tp_rank, pp_rank)


def test_nan_origins_are_one_line_for_all_replicas():
    """Rank 0 names every replica whose own loss was non-finite in one line, by kind (a
    model that diverges everywhere printed one line per replica, thousands at scale)."""
    from megatron.interval_log import nonfinite_origin_line

    assert nonfinite_origin_line(torch.tensor([1.0]), 3) == "non-finite loss (nan) at iteration 3"
    assert nonfinite_origin_line(torch.tensor([1.0] * 8), 3) == (
        "non-finite loss (nan) at iteration 3 on data-parallel ranks 0-7 (of 8)")
    assert nonfinite_origin_line(torch.tensor([0.0, 2.0]), 5) == (
        "non-finite loss (inf) at iteration 5 on data-parallel rank 1 (of 2)")
    assert nonfinite_origin_line(torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 0.0, 0.0, 3.0]), 3) == (
        "non-finite loss at iteration 3: nan on data-parallel ranks 0, 2-3, inf on "
        "data-parallel rank 4, -inf on data-parallel rank 7 (of 8)")
    assert nonfinite_origin_line(torch.tensor([0.0, 0.0]), 3) is None  # the average overflowed


def test_skip_policy_skips_the_step_and_keeps_weights_finite(tmp_path, capsys):
    tr = _trainer(tmp_path, "skip", iters=6)
    _poison_at(tr, {3})
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert tr.state.iteration == 6 and tr.state.skipped_iters == 1 and tr.state.nan_iters == 1
    assert all(torch.isfinite(p).all() for p in _params(tr).values())
    assert "optimizer step skipped (--nan-loss-policy skip)" in capsys.readouterr().out


def test_rollback_policy_restores_the_checkpoint_and_skips_batches(tmp_path):
    tr = _trainer(tmp_path, "rollback", iters=8, save_interval=4)
    _poison_at(tr, {6})
    seen = []
    original_add = type(tr.state).load_state_dict

    def spy(self, sd):
        seen.append(int(sd["iteration"]))
        return original_add(self, sd)

    type(tr.state).load_state_dict = spy
    try:
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    finally:
        type(tr.state).load_state_dict = original_add
    assert seen == [4], "rolled back to the checkpoint of iteration 4"
    gbs = tr.config.data.global_batch_size
    # iterations 5 and 6 ran once (6 was the NaN), then 5..8 again on new data:
    assert tr.state.iteration == 8
    assert tr.state.consumed_train_samples == (6 + 4) * gbs
    assert tr.state.nan_iters == 1
    assert all(torch.isfinite(p).all() for p in _params(tr).values())



def test_a_rollback_to_a_checkpoint_without_optimizer_state_says_what_it_keeps(tmp_path,
                                                                               capsys):
    """--no-save-optim: the rollback loads the weights alone. It printed the note of a
    --no-load-optim resume (a flag the run was not given: "the learning-rate schedule
    starts fresh ... counts samples from 0 again"), while the live schedule goes on."""
    tr = _trainer(tmp_path, "rollback", iters=8, save_interval=4)
    tr.config.checkpoint = dataclasses.replace(tr.config.checkpoint, no_save_optim=True)
    _poison_at(tr, {6})
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    out = capsys.readouterr().out
    gbs = tr.config.data.global_batch_size
    # steps 1-5 and, after the rollback to iteration 4, 5-8 again: not reset at the rollback
    assert tr.scheduler.num_steps == (5 + 4) * gbs
    assert "--no-load-optim" not in out and "start fresh" not in out
    assert (" > the checkpoint holds no optimizer state (--no-save-optim): the rollback "
            "restores the weights of iteration 4; the optimizer state and the learning-rate "
            "schedule go on as they were before the NaN") in out

def test_rollback_leaves_one_point_per_step_and_counts_the_nan(tmp_path, capsys):
    """After a rollback from iteration 7 to the checkpoint of 4 inside one log interval,
    TensorBoard has each step once (the undone iterations 5 and 6 were written twice, the
    second time at later samples), and the next line counts the NaN iteration (it said 0
    skipped, 0 NaN) and averages the loss of the iterations trained again only."""
    from megatron.logging_utils import TensorboardLogger, read_scalars

    tr = _trainer(tmp_path, "rollback", iters=8, save_interval=4)
    tb = str(tmp_path / "tb")
    tr.config.logging = dataclasses.replace(tr.config.logging, log_interval=4,
                                            tensorboard_dir=tb)
    tr.tb = TensorboardLogger(tr.config.logging, is_writer_rank=True)
    _poison_at(tr, {7})
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    tr.tb.close()
    gbs = tr.config.data.global_batch_size
    scalars = read_scalars(tb)
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 9))
    # 5..8 again after the rollback, on the batches after the NaN's (samples 56 on)
    assert [x for x, _ in scalars["lm loss vs samples"]] == [gbs * i for i in (1, 2, 3, 4,
                                                                              8, 9, 10, 11)]
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(" iteration        8")]
    assert "number of skipped iterations:   1 | number of nan iterations:   1 |" in line[0]


def test_a_rollbacks_interval_times_the_steps_it_ran_without_the_reload(tmp_path, capsys,
                                                                        monkeypatch):
    """The line after a rollback (iteration 7 back to the checkpoint of 4, --log-interval
    4) divided the interval's whole time -- the undone steps 5-7 and the checkpoint's
    reload included -- by the 4 steps left: 7 one-second steps and a 100 s reload read
    26750 ms per iteration. The reload is left out, as a save is, and the undone steps
    count as run: 1000 ms, and tokens/s = batch x sequence / 1 s."""
    from megatron import interval_log, trainer_checkpoint
    from megatron import training as training_mod

    now = [0.0]
    monkeypatch.setattr(interval_log.IntervalStats, "clock", staticmethod(lambda: now[0]))
    step, load = training_mod.train_step, trainer_checkpoint.load_trainer_checkpoint

    def timed_step(*args, **kwargs):
        now[0] += 1.0
        return step(*args, **kwargs)

    def slow_load(*args, **kwargs):
        now[0] += 100.0
        return load(*args, **kwargs)

    monkeypatch.setattr(training_mod, "train_step", timed_step)
    monkeypatch.setattr(trainer_checkpoint, "load_trainer_checkpoint", slow_load)
    tr = _trainer(tmp_path, "rollback", iters=8, save_interval=4)
    tr.config.logging = dataclasses.replace(tr.config.logging, log_interval=4)
    _poison_at(tr, {7})
    train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(" iteration ")]
    assert len(lines) == 2 and lines[1].startswith(" iteration        8/")
    d = tr.config.data
    for line in lines:
        assert "elapsed time per iteration (ms): 1000.0 |" in line, line
        assert f"tokens/s/GPU: {d.global_batch_size * d.seq_length} |" in line, line


def test_rollback_gives_up_when_rollbacks_do_not_get_further(tmp_path, capsys):
    """A divergence (every step after iteration 2 NaN) used to roll back forever, with the
    iteration stuck and the data consumed. Three rollbacks that do not get past the
    iteration of the previous NaN are allowed; the fourth NaN stops the run, saying why."""
    tr = _trainer(tmp_path, "rollback", iters=8, save_interval=2)
    _poison_at(tr, set(range(3, 100)))
    with pytest.raises(SystemExit, match=r"NaN/Inf loss at iteration 3 again: 3 rollbacks to "
                                         r"the checkpoint at iteration 2 .* lower --lr"):
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert capsys.readouterr().out.count("rolled back from iteration 3 to 2") == 3


def test_rollback_without_checkpoint_stops_clearly(tmp_path):
    tr = _trainer(tmp_path, "rollback", iters=4)
    _poison_at(tr, {2})
    with pytest.raises(SystemExit, match="no checkpoint in --save to roll back to"):
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)


def test_rollback_never_loads_a_later_checkpoint_of_an_earlier_run(tmp_path):
    """--save still tracks iteration 20 of an earlier run (this one started without
    --load): a NaN before this run's first save must not jump to that run's weights."""
    tr = _trainer(tmp_path, "rollback", iters=8, save_interval=4)
    os.makedirs(tr.config.checkpoint.save)
    with open(checkpointing.tracker_path(tr.config.checkpoint.save), "w") as f:
        f.write("20")
    _poison_at(tr, {2})
    with pytest.raises(SystemExit, match=r"NaN/Inf loss at iteration 2, and the last checkpoint "
                                         r"in --save .* is iteration 20, which this run has not "
                                         r"reached"):
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert tr.state.iteration == 2


@pytest.mark.parametrize("save_interval", [100, 4])
def test_sigusr1_saves_and_exits(tmp_path, capsys, save_interval):
    """The signal arrives during iteration 4: the run saves it and exits. With
    --save-interval 4 the exit takes that iteration's own checkpoint; it used to add
    'exiting without a checkpoint: --save is not set' although --save was set."""
    tr = _trainer(tmp_path, iters=20, save_interval=save_interval)
    tr.signals = SignalHandler()
    try:
        calls = _poison_at(tr, set())
        original = tr.model.module.forward

        def forward(*args, **kwargs):
            if calls["n"] == 3 * tr.config.data.num_micro_batches:
                os.kill(os.getpid(), signal.SIGUSR1)
            return original(*args, **kwargs)

        tr.model.module.forward = forward
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    finally:
        tr.signals.restore()
    out = capsys.readouterr().out
    assert tr.state.iteration == 4, "the signal arrived during iteration 4"
    assert checkpointing.read_tracker(str(tmp_path / "ckpt")) == (4, False)
    assert out.count("successfully saved checkpoint at iteration") == 1, out
    assert "[exiting program after receiving SIGUSR1.]" in out
    assert "--save is not set" not in out, out


def _rollback_run(tmp_path, train_sizes, reads, evaluations):
    """pretrain() on small .bin/.idx sets (a validation set of exactly the 80 samples
    Megatron sizes it for: (8 // 2 + 1) x 2 x 8), NaN at the first run of iteration 7,
    --save-interval 4; the first token of each micro-batch read goes to `reads`, and
    (iteration, len(reads)) at each evaluation's start to `evaluations`."""
    import megatron.train_step as train_step_module
    import megatron.training as training
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed
    from tests.test_gpt_dataset import make_corpus

    paths = [make_corpus(tmp_path / name, sizes, vocab=100)[0] for name, sizes in
             (("train", train_sizes), ("valid", [80 * 16 + 1]), ("test", [16 * 16 + 1]))]
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
            "--lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 100 "
            "--use-cpu-initialization --num-workers 0 --log-interval 2 --eval-iters 2 "
            "--eval-interval 2 --train-iters 8 --save-interval 4 --nan-loss-policy "
            "rollback").split() + ["--save", str(tmp_path / "ckpt"), "--train-data-path",
                                   paths[0], "--valid-data-path", paths[1],
                                   "--test-data-path", paths[2]]
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    original_batch, original_build = train_step_module.get_batch, training.build_trainer

    def recording(micro, *args, **kwargs):
        reads.append(micro["text"][:, 0].tolist())
        return original_batch(micro, *args, **kwargs)

    def build(*args):
        tr = original_build(*args)
        module, forward = tr.model.module, tr.model.module.forward

        def poisoned(*a, **k):  # the first time training step 7 runs
            out = forward(*a, **k)
            return out * float("nan") if module.training and tr.state.iteration == 6 \
                and not tr.state.nan_iters else out

        module.forward, original_eval = poisoned, tr.model.eval

        def evaluating():
            evaluations.append((tr.state.iteration, len(reads)))
            return original_eval()

        tr.model.eval = evaluating
        return tr

    train_step_module.get_batch, training.build_trainer = recording, build
    try:
        return training.pretrain(cfg, rt)
    finally:
        train_step_module.get_batch, training.build_trainer = original_batch, original_build


def test_rollback_rewinds_the_validation_data_to_the_checkpoint(tmp_path):
    """After a rollback from iteration 7 to the checkpoint of 4, the evaluation at 6 is
    re-run on the samples it read before (those a plain resume from 4 reads), and the final
    evaluation still has its samples. The validation position was kept: the re-runs read
    on, and the final evaluation ended in a bare StopIteration."""
    reads, evaluations = [], []
    tr = _rollback_run(tmp_path, [50] * 40, reads, evaluations)
    draws = {}
    for it, start in evaluations:  # 4 micro-batches an evaluation
        draws.setdefault(it, []).append(reads[start:start + 4])
    assert sorted(draws) == [2, 4, 6, 8] and len(draws[6]) == 2 and len(draws[8]) == 3
    assert draws[6][0] == draws[6][1], "the re-run evaluation reads the same samples"
    assert tr.state.iteration == 8 and tr.state.consumed_valid_samples == 80


def test_rollback_stops_with_a_checkpoint_where_the_train_set_runs_out(tmp_path, capsys):
    """A train set of exactly --train-iters x --global-batch-size samples (as a blend is):
    the rollback from 7 to 4 skips 3 batches, so the set serves iterations up to 5 only.
    Said at the rollback; at 5 the run saves and stops naming the numbers. It ended in a
    bare StopIteration at iteration 6, after the last periodic checkpoint."""
    with pytest.raises(SystemExit) as stop:
        _rollback_run(tmp_path, [64 * 16 + 1], [], [])
    message = str(stop.value.code)
    assert message.startswith("error: the train set has 64 samples, sized for --train-iters 8, "
                              "and the rollbacks skipped"), message
    assert "serves iterations up to 5, not --train-iters 8" in message and "--load" in message
    assert checkpointing.read_tracker(str(tmp_path / "ckpt")) == (5, False)
    out = capsys.readouterr().out
    assert "(consumed_train_samples 56 at iteration 4): it serves iterations up to 5; the run " \
           "will save a checkpoint and stop there" in out
    assert "[exiting program at iteration 5: the train set is used up]" in out


def test_the_stop_policy_names_the_checkpoint_an_async_save_in_flight_publishes(
        tmp_path, monkeypatch):
    """With --async-save the checkpoint of iteration 2 was still being written when the NaN
    of iteration 3 stopped the run (at the log line of iteration 4): the message read the
    tracker then ("holds no checkpoint yet ... start again"), and the process's exit then
    waited for the writer, which published iteration 2. The message names that checkpoint."""
    release = threading.Event()
    original = checkpointing._torch_save_synced

    def slow_write(obj, path):
        release.wait(30)  # a slow file system: the write outlasts the next two steps
        original(obj, path)

    monkeypatch.setattr(checkpointing, "_torch_save_synced", slow_write)
    tr = _trainer(tmp_path, "stop", save_interval=2)
    tr.config.checkpoint = dataclasses.replace(tr.config.checkpoint, async_save=True)
    _poison_at(tr, {3})
    timer = threading.Timer(1.0, release.set)  # the stop must wait for the write
    timer.start()
    try:
        with pytest.raises(SystemExit) as stop:
            train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    finally:
        release.set()
        timer.cancel()
        if tr.async_saver is not None:
            tr.async_saver.wait()
    assert checkpointing.read_tracker(str(tmp_path / "ckpt")) == (2, False)
    assert re.search(r"Resume from the last checkpoint, \S+ckpt/iter_0000002 \(--load ",
                     str(stop.value.code)), stop.value.code


def test_the_stop_policy_says_the_async_save_in_flight_failed(tmp_path, monkeypatch):
    """The background save the NaN stop waited for failed: the message keeps the tracker's
    answer (no checkpoint yet) and says why the save it waited for is not there."""
    def failing_write(obj, path):
        time.sleep(0.5)  # still in flight at the NaN stop
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing, "_torch_save_synced", failing_write)
    tr = _trainer(tmp_path, "stop", save_interval=2)
    tr.config.checkpoint = dataclasses.replace(tr.config.checkpoint, async_save=True)
    _poison_at(tr, {3})
    with pytest.raises(SystemExit) as stop:
        train(tr, data_iterator(tr.config, tr.rt, "train", 0), None)
    assert not tr.async_saver.pending
    assert re.search(r"holds no checkpoint yet to resume from \(the background save of the "
                     r"checkpoint at iteration 2 to \S+ failed: .*No space left on device.*\); "
                     "start again", str(stop.value.code)), stop.value.code
