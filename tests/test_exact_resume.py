"""Bit-exact resume on CPU with dropout on: train N iterations uninterrupted, or stop with a
checkpoint at k and resume in a fresh trainer -- the losses after k are the same floats
(exact equality). Also what the load/save flags do: --no-load-optim, --no-load-rng,
--finetune, --no-save-optim, --no-save-rng.

Each run goes through the real driver (`parse_and_validate` -> `pretrain`), so the resume
path is the one a user gets; the per-iteration losses are read off `train_step`.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import megatron.training as training
from megatron.arguments import parse_and_validate
from megatron.checkpointing import checkpoint_name, read_tracker
from megatron.initialize import initialize_distributed, set_random_seed
from tests.dist_utils import run_distributed

N, K = 6, 3  # iterations, checkpoint at K

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 "
    "--min-lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 100 --hidden-dropout 0.1 "
    "--attention-dropout 0.1 --use-cpu-initialization --num-workers 0 --log-interval 1000 "
    f"--eval-iters 0 --eval-interval 1000 --train-iters {N}"
).split()


def run_pretrain(extra: list, world_size: int = 1, rank: int = 0,
                 process_start_time=None):
    """One run as a fresh process would do it (seeded, then pretrain()); returns
    ({iteration: loss}, trainer). Losses are this rank's `train_step` results.
    `process_start_time`: what --exit-duration-in-mins counts from (default: the loop's
    start)."""
    cfg = parse_and_validate(BASE + list(extra), world_size=world_size,
                             env={"RANK": str(rank)}, cuda_available=False)
    rt = initialize_distributed(cfg.parallel, rank, world_size, 0)
    set_random_seed(cfg.training.seed, rt, cfg.training.data_parallel_random_init)
    losses = {}
    original = training.train_step

    def recording(tr, data, **kwargs):
        out = original(tr, data, **kwargs)
        losses[tr.state.iteration + 1] = float(out[0])
        return out

    training.train_step = recording
    try:
        tr = training.pretrain(cfg, rt, process_start_time)
    finally:
        training.train_step = original
    return losses, tr


def resume_scenario(root: str, extra: list, world_size: int = 1, rank: int = 0):
    """(uninterrupted, first part stopped at K with a checkpoint, resumed) losses."""
    ref, _ = run_pretrain(extra, world_size, rank)
    first, _ = run_pretrain(extra + ["--save", root, "--save-interval", str(K),
                                     "--exit-interval", str(K)], world_size, rank)
    resumed, tr = run_pretrain(extra + ["--load", root], world_size, rank)
    assert tr.state.iteration == N
    return ref, first, resumed


def _dist_scenario(rank, world_size, root, extra):
    return resume_scenario(root, extra, world_size, rank)


def _assert_exact(ref, first, resumed, what):
    assert sorted(ref) == list(range(1, N + 1)), what
    assert first == {i: ref[i] for i in range(1, K + 1)}, what
    assert resumed == {i: ref[i] for i in range(K + 1, N + 1)}, f"{what}: {resumed} vs {ref}"


# --------------------------------------------------------------------------- bit-exact
@pytest.mark.parametrize("name,extra", [("fp32", []), ("bf16", ["--bf16"])])
def test_single_process_resume_is_bit_exact(tmp_path, name, extra):
    """bf16 parameters resume exactly too: the fp32 main copies are in the checkpoint."""
    ref, first, resumed = resume_scenario(str(tmp_path / "ck"), extra)
    _assert_exact(ref, first, resumed, name)
    assert len(set(ref.values())) == N  # the losses move: the comparison means something


@pytest.mark.parametrize("name,extra", [
    ("tp2", ["--tensor-model-parallel-size", "2"]),
    ("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ("pp2_vpp2", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                  "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("distopt_dp2", ["--use-distributed-optimizer"]),
    ("dp2_random_init", ["--data-parallel-random-init"]),
])
def test_two_rank_resume_is_bit_exact(tmp_path, name, extra):
    """Each tensor- and pipeline-parallel rank resumes its own RNG streams (the tracker's
    differ per TP rank, the default generator's per pipeline stage) and each virtual
    pipeline chunk its own weights. With --data-parallel-random-init each data-parallel
    replica draws its own dropout masks: the checkpoint holds every DP rank's RNG states
    (Megatron's `rng_state` list) and each rank resumes from its own (all took DP rank 0's,
    so rank 1's masks changed)."""
    results = run_distributed(_dist_scenario, 2, str(tmp_path / "ck"), extra)
    for rank, (ref, first, resumed) in enumerate(results):
        _assert_exact(ref, first, resumed, f"{name} rank {rank}")
    rank_dir = os.path.dirname(checkpoint_name(str(tmp_path / "ck"), K, 0, 0, 1))
    if name == "distopt_dp2":
        assert sorted(os.listdir(rank_dir)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    if name == "dp2_random_init":
        rng = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"),
                         weights_only=True)["rng_state"]
        assert len(rng) == 2 and not torch.equal(rng[0]["torch_rng_state"],
                                                 rng[1]["torch_rng_state"])


def _skip_train_weights(rank, world_size):
    _, tr = run_pretrain(["--data-parallel-random-init", "--skip-train", "--eval-iters", "1"],
                         world_size, rank)
    return [p.detach().clone() for p in tr.model.module.parameters()]


def test_data_parallel_random_init_evaluates_one_model_with_skip_train():
    """--skip-train runs no step, and the replicas took DP rank 0's weights only at the
    first step: each evaluated the model of its own seed (seed + 10 * dp_rank), and the
    loss printed was a mean over two models. Megatron broadcasts when it builds the model:
    every replica scores DP rank 0's."""
    ranks = run_distributed(_skip_train_weights, 2)
    assert len(ranks[0]) == len(ranks[1]) > 0
    for a, b in zip(*ranks):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- load flags
@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The uninterrupted fp32 losses and a checkpoint at K of the same run."""
    root = str(tmp_path_factory.mktemp("plain") / "ck")
    ref, first, resumed = resume_scenario(root, [])
    _assert_exact(ref, first, resumed, "fp32")
    return ref, root


def test_no_load_optim_keeps_weights_and_position_but_fresh_optimizer(plain_run, capsys):
    ref, root = plain_run
    capsys.readouterr()
    losses, tr = run_pretrain(["--load", root, "--no-load-optim"])
    assert (" > --no-load-optim: the optimizer state and the learning-rate schedule start "
            "fresh; the schedule counts samples from 0 again (warmup first) while the run goes "
            f"on from iteration {K}") in capsys.readouterr().out
    assert tr.scheduler.num_steps == (N - K) * 8, "Megatron's schedule restarts at sample 0"
    assert sorted(losses) == list(range(K + 1, N + 1)), "iteration and data position restored"
    assert losses[K + 1] == ref[K + 1], "same weights, batch and dropout masks"
    assert losses[K + 2] != ref[K + 2], "a fresh Adam state and lr schedule step differently"


def test_no_load_rng_gives_other_dropout_masks(plain_run):
    ref, root = plain_run
    losses, _ = run_pretrain(["--load", root, "--no-load-rng"])
    assert sorted(losses) == list(range(K + 1, N + 1))
    assert losses[K + 1] != ref[K + 1], "same weights and batch, other dropout masks"
    # without dropout the masks cannot matter: the first resumed loss is the reference's
    no_drop = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    ref0, first0, _ = resume_scenario(root + "_nodrop", no_drop)
    again, _ = run_pretrain(no_drop + ["--load", root + "_nodrop", "--no-load-rng"])
    assert again == {i: ref0[i] for i in range(K + 1, N + 1)}


def test_finetune_loads_weights_and_restarts_counters(plain_run, capsys):
    ref, root = plain_run
    capsys.readouterr()
    losses, tr = run_pretrain(["--load", root, "--finetune"])
    assert sorted(losses) == list(range(1, N + 1)), "--finetune starts at iteration 0"
    out = capsys.readouterr().out  # Megatron-LM's line names the iteration the run starts at
    assert f"  successfully loaded checkpoint from {root} at iteration 0\n" in out
    assert tr.state.consumed_train_samples == N * 8
    assert losses[1] != ref[1], "the weights are the checkpoint's, not a fresh init"
    assert losses[1] < ref[1]


# --------------------------------------------------------------------------- save flags
def test_no_save_optim_and_no_save_rng_omit_their_keys(tmp_path, plain_run):
    ref, _ = plain_run
    root = str(tmp_path / "ck")
    run_pretrain(["--save", root, "--save-interval", str(K), "--exit-interval", str(K),
                  "--no-save-optim", "--no-save-rng", "--use-distributed-optimizer"])
    assert read_tracker(root) == (K, False)
    path = checkpoint_name(root, K, 0, 0, 1)
    state = torch.load(path, weights_only=True)
    assert {"model", "iteration", "args", "train_state"} <= set(state)
    assert not {"optimizer", "opt_param_scheduler", "rng_state"} & set(state)
    assert os.listdir(os.path.dirname(path)) == ["model_optim_rng.pt"], "no distrib_optim.pt"
    # loading the missing states is refused (Megatron's d.3.8), naming the flag that skips
    # them: both in one message, not one per attempt
    with pytest.raises(SystemExit) as refused:
        run_pretrain(["--load", root, "--use-distributed-optimizer"])
    message = str(refused.value.code)
    assert f"unable to load optimizer from checkpoint {path}" in message
    assert "Specify --no-load-optim or --finetune" in message
    assert f"unable to load rng state from checkpoint {path}" in message
    assert "Specify --no-load-rng or --finetune" in message
    with pytest.raises(SystemExit, match=rf"unable to load rng state from checkpoint {path}.*"
                                         "Specify --no-load-rng or --finetune"):
        run_pretrain(["--load", root, "--use-distributed-optimizer", "--no-load-optim"])
    # with them it resumes: position restored, optimizer and dropout RNG fresh
    losses, _ = run_pretrain(["--load", root, "--use-distributed-optimizer", "--no-load-optim",
                              "--no-load-rng"])
    assert sorted(losses) == list(range(K + 1, N + 1))

    root_rng = str(tmp_path / "ck_rng")
    run_pretrain(["--save", root_rng, "--save-interval", str(K), "--exit-interval", str(K),
                  "--no-save-optim"])
    state = torch.load(checkpoint_name(root_rng, K, 0, 0, 1), weights_only=True)
    assert "rng_state" in state and "optimizer" not in state
    losses, _ = run_pretrain(["--load", root_rng, "--no-load-optim"])  # RNG restored
    assert sorted(losses) == list(range(K + 1, N + 1))


# --------------------------------------------------------------------------- release
def _as_release(root: str, dst: str) -> str:
    """A copy of `root`'s checkpoint at K as a release checkpoint (`release/`, tracker)."""
    shutil.copytree(os.path.join(root, f"iter_{K:07d}"), os.path.join(dst, "release"))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    return dst


def test_release_checkpoint_starts_at_zero_keeping_consumed_samples(tmp_path, plain_run):
    """d.3.3: iteration 0, no optimizer / scheduler / RNG load -- so a changed schedule is no
    error -- and, without --finetune, the checkpoint's consumed samples."""
    ref, root = plain_run
    release = _as_release(root, str(tmp_path / "rel"))
    losses, tr = run_pretrain(["--load", release, "--lr", "5e-3"])
    assert sorted(losses) == list(range(1, N + 1)), "a release starts at iteration 0"
    assert tr.state.consumed_train_samples == (K + N) * 8, "consumed samples kept"
    assert losses[1] < ref[1], "the checkpoint's weights"
    assert tr.scheduler.num_steps == N * 8, "a fresh schedule"
    losses, tr = run_pretrain(["--load", release, "--finetune"])
    assert sorted(losses) == list(range(1, N + 1))
    assert tr.state.consumed_train_samples == N * 8, "--finetune: consumed samples from 0"


# --------------------------------------------------------------------------- mismatches
def test_changed_schedule_on_resume_exits_with_the_fix(plain_run):
    _, root = plain_run
    with pytest.raises(SystemExit) as err:
        run_pretrain(["--load", root, "--lr", "5e-3"])
    msg = str(err.value)
    assert msg.startswith(f"error: loading {root}/iter_{K:07d}: ") and "0.005" in msg
    assert "--override-opt_param-scheduler" in msg


@pytest.mark.parametrize("flags,expected", [
    (["--num-attention-heads", "8"], ["--num-attention-heads: checkpoint 4, this run 8",
                                      "--kv-channels: checkpoint 8, this run 4"]),
    (["--num-layers", "3"], ["--num-layers: checkpoint 2, this run 3"]),
    (["--hidden-size", "64"], ["--hidden-size: checkpoint 32, this run 64",
                               "--ffn-hidden-size: checkpoint 128, this run 256"]),
])
@pytest.mark.parametrize("finetune", [False, True])
def test_model_arguments_other_than_the_checkpoint_exit_naming_them(plain_run, flags, expected,
                                                                    finetune):
    """Megatron's check_checkpoint_args; shapes and head layout even with --finetune (8 heads
    of 4 would load silently, the other shapes as load_state_dict tracebacks)."""
    _, root = plain_run
    with pytest.raises(SystemExit) as err:
        run_pretrain(["--load", root, *flags] + (["--finetune"] if finetune else []))
    msg = str(err.value)
    assert msg.startswith(f"error: the checkpoint in {root}/iter_{K:07d} was saved with other "
                          "model arguments")
    for line in expected:
        assert f"\n  {line}\n" in msg, msg
    assert "--use-checkpoint-args" in msg and f"({flags[0]} " in msg
    assert ("--finetune does not skip these" in msg) == finetune


def test_finetune_skips_the_non_shape_arguments(plain_run):
    _, root = plain_run
    with pytest.raises(SystemExit, match="--vocab-size: checkpoint 100, this run 101"):
        run_pretrain(["--load", root, "--vocab-size", "101"])  # same padded rows (128)
    losses, _ = run_pretrain(["--load", root, "--vocab-size", "101", "--finetune"])
    assert sorted(losses) == list(range(1, N + 1))


def test_unusable_save_directory_exits_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "ck")

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before --save was checked")

    monkeypatch.setattr(training, "build_trainer", no_build)
    with pytest.raises(SystemExit, match=f"--save {bad} cannot be used: .*NotADirectoryError"):
        run_pretrain(["--save", bad, "--save-interval", str(K)])


def test_model_mismatch_without_saved_args_exits_cleanly(tmp_path, plain_run):
    """A checkpoint without `args` (an older writer) cannot be checked up front: the
    strict load still ends in a clean exit, not a traceback."""
    _, root = plain_run
    bare = str(tmp_path / "bare")
    shutil.copytree(root, bare)
    path = checkpoint_name(bare, K, 0, 0, 1)
    state = torch.load(path, weights_only=True)
    del state["args"]
    torch.save(state, path)
    with pytest.raises(SystemExit, match=r"(?s)does not fit this run's: .*size mismatch"):
        run_pretrain(["--load", bare, "--hidden-size", "64"])


def test_rng_state_list_shorter_than_the_data_parallel_size():
    """--data-parallel-random-init resumed from a checkpoint holding fewer DP ranks' RNG
    states (saved at a smaller dp, or without the flag): ranks without an entry keep their
    seeded states, a note says so (Megatron-LM stops with an IndexError)."""
    from types import SimpleNamespace

    from megatron.trainer_checkpoint import _saved_rng_state

    def trainer(flag, dp_rank, dp_size=2):
        return SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(
            data_parallel_random_init=flag)), rt=SimpleNamespace(ps=SimpleNamespace(
                dp_rank=dp_rank, dp_size=dp_size)))

    states = [{"which": 0}, {"which": 1}]
    assert _saved_rng_state(trainer(True, 1), states) == (states[1], None)
    assert _saved_rng_state(trainer(False, 1), states) == (states[0], None)
    note = ("--data-parallel-random-init: the checkpoint holds the RNG states of 1 "
            "data-parallel rank(s), this run has 2; ranks from 1 on keep their seeded states")
    assert _saved_rng_state(trainer(True, 0), states[:1]) == (states[0], note)
    assert _saved_rng_state(trainer(True, 1), states[:1]) == (None, note)
