"""Samplers, datasets and sample counts: resume at the exact next sample for any DP size,
Megatron's sample order end to end, the data checks said before training.

The iterators that read them (reader thread, loader workers) are tested in
tests/test_data_iterators.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron.core.datasets.samplers import PretrainingSampler
from megatron.data_iterators import make_iterator
from megatron.data_loading import CyclicSampler, train_shortfall, validation_shortfall
from tests.dist_utils import run_distributed
from tests.gpt_helpers import tiny_config


def _global_order(sampler_cls, total, consumed, mbs, dp, steps):
    """Sample indices of each global micro-batch step, concatenated over DP ranks."""
    iters = [iter(sampler_cls(total, consumed, mbs, r, dp)) for r in range(dp)]
    return [sum((next(it) for it in iters), []) for _ in range(steps)]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_single_sampler_resumes_at_the_next_sample_for_any_dp(dp):
    full = [i for step in _global_order(PretrainingSampler, 1000, 0, 2, dp, 24 // dp) for i in step]
    assert full == list(range(48)), "global order is independent of the DP size"
    resumed = _global_order(PretrainingSampler, 1000, 16, 2, dp, 1)[0]
    assert resumed == list(range(16, 16 + 2 * dp))


def test_micro_batches_collate_gpt_blended_and_mock_samples(tmp_path):
    """megatron.core's own reader (`samplers.micro_batches`) collates what the datasets
    give: numpy 'text' (GPTDataset), a blend's int 'dataset_idx', mock tensors; each row
    the sampler's sample of this DP rank."""
    from megatron.core.datasets.gpt_dataset import build_train_valid_test_datasets
    from megatron.core.datasets.mock import MockGPTDataset
    from megatron.core.datasets.samplers import micro_batches
    from tests.test_gpt_dataset import make_corpus

    a, _ = make_corpus(tmp_path / "a", [30] * 20, seed=1)
    b, _ = make_corpus(tmp_path / "b", [17] * 30, seed=2)
    single = build_train_valid_test_datasets([a], "1,0,0", [40, 0, 0], 16, 7)[0]
    blend = build_train_valid_test_datasets(["0.3", a, "0.7", b], "1,0,0", [40, 0, 0], 16, 7)[0]
    mock = MockGPTDataset(100, 16, 7)
    for dataset in (single, blend, mock):
        batches = list(micro_batches(dataset, PretrainingSampler(40, 8, 2, 1, 2)))
        assert len(batches) == 8  # samples 8..39, four per global micro-batch, rank 1's two
        for k, batch in enumerate(batches):
            assert batch["text"].shape == (2, 17) and batch["text"].dtype == torch.int64
            for row, i in enumerate((8 + 4 * k + 2, 8 + 4 * k + 3)):
                item = dataset[i]
                np.testing.assert_array_equal(batch["text"][row].numpy(), np.asarray(item["text"]))
                if "dataset_idx" in item:
                    assert int(batch["dataset_idx"][row]) == item["dataset_idx"]


def test_cyclic_sampler_partitions_each_epoch_and_resumes():
    total, mbs, dp = 40, 2, 2
    steps = total // (mbs * dp)
    epoch0 = _global_order(CyclicSampler, total, 0, mbs, dp, steps)
    flat = sorted(i for step in epoch0 for i in step)
    assert flat == list(range(total)), "each epoch visits every sample once"
    resumed = _global_order(CyclicSampler, total, 3 * mbs * dp, mbs, dp, steps - 3)
    assert resumed == epoch0[3:]
    epoch1 = _global_order(CyclicSampler, total, total, mbs, dp, steps)
    assert epoch1 != epoch0 and sorted(i for s in epoch1 for i in s) == list(range(total))


@pytest.mark.parametrize("total, mbs, dp", [(40, 2, 2), (10, 1, 4), (14, 2, 4)])
def test_cyclic_sampler_without_data_sharding_deals_one_permutation(total, mbs, dp):
    """--no-data-sharding: one permutation of the whole set per epoch, rank r taking every
    dp-th sample of it (Megatron's order), so a rank is not confined to its own bucket;
    every rank gets as many micro-batches per epoch (no rank waits for another), and a
    resume continues at the next global micro-batch."""
    def unsharded(t, consumed, m, r, d):
        return CyclicSampler(t, consumed, m, r, d, data_sharding=False)

    steps = total // (mbs * dp)
    epoch0 = _global_order(unsharded, total, 0, mbs, dp, steps + 1)
    perm = torch.randperm((total // mbs) * mbs, generator=torch.Generator().manual_seed(0))
    rank0 = [i for step in epoch0[:steps] for i in step[:mbs]]
    assert rank0 == perm.tolist()[0::dp][:steps * mbs]
    flat = [i for step in epoch0[:steps] for i in step]
    assert len(set(flat)) == len(flat) == steps * mbs * dp, "no sample twice in an epoch"
    assert epoch0[steps] == _global_order(unsharded, total, steps * mbs * dp, mbs, dp, 1)[0], \
        "every rank moves on to epoch 1 together"
    assert _global_order(unsharded, total, mbs * dp, mbs, dp, steps - 1) == epoch0[1:steps]
    if dp > 1:
        sharded = _global_order(CyclicSampler, total, 0, mbs, dp, steps)
        bucket = (total // (mbs * dp)) * mbs
        assert all(i < bucket for step in sharded for i in step[:mbs]), "sharded: own bucket"
        assert any(i >= bucket for i in rank0), "unsharded: rank 0 reads the whole set"


def _eval_config(train_iters, eval_interval, eval_iters, skip_train=False):
    cfg = tiny_config(mbs=2, gbs=8, iters=train_iters)
    return dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, eval_interval=eval_interval, eval_iters=eval_iters, skip_train=skip_train))


def test_validation_shortfall_counts_the_evaluations_left():
    # Megatron's validation size (100 // 10 + 1) * 2 * 8 = 176 samples serves an unchanged
    # run from any iteration: 10 evaluations in the loop and the final one.
    cfg = _eval_config(100, 10, 2)
    for it in (0, 35, 100):
        assert validation_shortfall(cfg, it, (it // 10) * 16, 176) is None
    # One sample short: the final evaluation runs out (resumed at 35: 3 x 16 consumed).
    assert "the final evaluation would run out" in validation_shortfall(cfg, 35, 48, 175)
    # 48 + 16 * 3 fits, the 4th evaluation after iteration 35 (at 70) does not.
    assert "the evaluation at iteration 70 would" in validation_shortfall(cfg, 35, 48, 111)
    # --skip-train: one draw only; no validation: nothing to check.
    assert validation_shortfall(_eval_config(100, 10, 2, skip_train=True), 100, 176, 192) is None
    assert "the 1 evaluation(s) left" in validation_shortfall(
        _eval_config(100, 10, 2, skip_train=True), 100, 176, 191)
    assert validation_shortfall(_eval_config(100, 10, 0), 0, 10**6, 0) is None


def test_train_shortfall_counts_the_steps_left():
    """Sized for 100 iterations x 8 = 800 samples, resumed at iteration 60 after 60 x 16
    samples (a larger global batch before): nothing left, the first step runs out; after
    60 x 8 it fits exactly, one sample less and the last step runs out."""
    cfg = _eval_config(100, 10, 2)
    assert train_shortfall(cfg, 0, 0, 800) is None
    assert train_shortfall(cfg, 60, 480, 800) is None
    assert "would run out of data at iteration 100" in train_shortfall(cfg, 60, 480, 799)
    out = train_shortfall(cfg, 60, 960, 805)
    assert out.startswith("the train set has 805 samples and 960 are already consumed "
                          "(consumed_train_samples at iteration 60, 16 a step)")
    assert "would run out of data at iteration 61" in out
    assert "resume with the --global-batch-size the checkpoint was trained with" in out
    # the same batch, more samples read: a rollback skipped batches (the advice was the
    # batch size alone, the same already)
    assert "where a --nan-loss-policy rollback skipped batches (counted as read), with a " \
           "larger --train-iters (or --train-samples)" in train_shortfall(cfg, 60, 500, 800)
    assert train_shortfall(cfg, 100, 10**6, 800) is None  # nothing left to train
    cyclic = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataloader_type="cyclic"))
    assert train_shortfall(cyclic, 60, 960, 805) is None  # wraps into another epoch
    skip = _eval_config(100, 10, 2, skip_train=True)
    assert train_shortfall(skip, 60, 960, 805) is None


def test_train_shortfall_of_a_release_checkpoint_names_finetune():
    """A release checkpoint loads at iteration 0 but keeps the consumed samples of the run
    it was saved from (Megatron-LM's rule): a blend sized for 100 x 8 samples then runs out
    at the same batch size. The message said '80 a step' and told to resume at the
    checkpoint's --global-batch-size (this one) or to lengthen the run (no length fits: the
    set grows with it); --finetune reads the data from sample 0."""
    out = train_shortfall(_eval_config(100, 10, 2), 0, 80, 804)
    assert out.startswith("the train set has 804 samples and 80 are already consumed "
                          "(the consumed_train_samples of a checkpoint loaded at iteration 0, "
                          "a release checkpoint: Megatron-LM keeps them)"), out
    assert "would run out of data at iteration 91" in out
    assert "a step" not in out and "--global-batch-size the checkpoint" not in out
    assert out.endswith("pass --finetune to read the train data from sample 0, or "
                        "--dataloader-type cyclic to start another epoch where it runs out")


def test_train_shortfall_follows_the_rampup():
    """Under --rampup-batch-size 2 2 20 (final 8) the steps take 2, 2, ..., 8 samples:
    the count a fresh run reads is exactly what it needs."""
    from megatron.microbatches import rampup_consumed_samples

    cfg = _eval_config(30, 10, 2)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, rampup_batch_size=[2, 2, 20], target_global_batch_size=8))
    need = rampup_consumed_samples(30, (2, 2, 20), 8)
    assert need < 30 * 8
    assert train_shortfall(cfg, 0, 0, need) is None
    assert "at iteration 30" in train_shortfall(cfg, 0, 0, need - 1)
    done = rampup_consumed_samples(5, (2, 2, 20), 8)
    assert train_shortfall(cfg, 5, done, need) is None


def test_resume_at_a_smaller_global_batch_that_runs_out_of_train_data_stops_first(
        tmp_path, capsys):
    """A blend holds barely more samples than asked: stopped at iteration 8 with a global
    batch of 16 (128 samples read) and resumed at 8 (the data sized 10 x 8 x 1.005), the
    first step would run out (Megatron: an assertion, or a bare StopIteration later). The
    run stops before training, naming the counts and the fix."""
    corpora, path = _corpora(tmp_path, blend=True)
    save = str(tmp_path / "ckpt")
    flags = ["--split", "98,2,0", "--train-iters", "10", "--eval-iters", "0"]
    _recorded_run(0, 1, _order_argv(path, save, flags + ["--global-batch-size", "16",
                                                         "--exit-interval", "8"]))
    with pytest.raises(SystemExit) as stop:
        _recorded_run(0, 1, _order_argv(path, save, flags + [
            "--global-batch-size", "8", "--load", save, "--override-opt_param-scheduler"]))
    out = capsys.readouterr()
    assert ("error: the train set has 81 samples and 128 are already consumed"
            in f"{stop.value.code}{out.out}{out.err}")


def test_validation_shortfall_ignores_the_cyclic_loader():
    """--dataloader-type cyclic wraps the validation set (CyclicSampler starts another
    epoch), so a resume whose evaluations read past its end runs: not refused."""
    cfg = _eval_config(100, 10, 2)
    assert validation_shortfall(cfg, 35, 48, 111) is not None  # `single`: it runs out
    cyclic = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataloader_type="cyclic"))
    assert validation_shortfall(cyclic, 35, 48, 111) is None
    sampler = iter(CyclicSampler(16, 16 * 5, 2, 0, 1))  # consumed past the end: still serves
    assert all(len(next(sampler)) == 2 for _ in range(20))


def test_dataset_builder_warnings_are_one_warning_line_on_rank_0(tmp_path, capsys):
    """A cache of another document range is skipped with a warning: printed once by rank 0
    as `WARNING: ...`, not as `<file>:<line>: UserWarning` plus a source line on every
    rank (64 copies on 64 GPUs)."""
    import warnings

    from megatron.arguments import parse_and_validate
    from megatron.data_loading import build_datasets
    from tests.test_gpt_dataset import make_corpus

    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 30, vocab=250)
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
            "--train-iters 4 --eval-iters 1 --tokenizer-type NullTokenizer --vocab-size 250 "
            "--split 90,10,0").split()

    def build(extra):
        cfg = parse_and_validate(base + extra, world_size=1, env={}, cuda_available=False)
        return build_datasets(cfg, 0, cfg.model.padded_vocab_size)

    build(["--train-data-path", prefix])  # the whole corpus, cached in index-cache/
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none may escape as a Python warning
        build(["--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")])
    out = capsys.readouterr()
    assert out.out.count("WARNING: ignoring the index cache ") == 1
    assert "UserWarning" not in out.err + out.out


def test_the_validation_split_fix_names_a_split_that_gives_each_dataset_a_document(tmp_path):
    """The never-evaluates warning's fix comes from the smallest dataset's document count
    (it suggested --split 969,30,1 to a run already using it); one document cannot be split."""
    from megatron.core.datasets.gpt_dataset import get_train_valid_test_split
    from megatron.data_loading import validation_split_fix
    from tests.test_gpt_dataset import make_corpus

    big, _ = make_corpus(tmp_path / "big", [20] * 9)
    small, _ = make_corpus(tmp_path / "small", [20] * 4)
    one, _ = make_corpus(tmp_path / "one", [20])
    fix = validation_split_fix(["0.7", big, "0.3", small])
    assert fix.endswith(f"with 4 documents in {small}, e.g. --split 3,1,0"), fix
    for n in (4, 9):
        bounds = get_train_valid_test_split("3,1,0", n)
        assert bounds[2] > bounds[1], (n, bounds)
    assert validation_split_fix([one]).startswith(f"{one} holds one document, which --split "
                                                  "cannot share")
    assert "--train-data-path and --valid-data-path" in validation_split_fix([one])


def test_the_validation_split_fix_keeps_the_test_split(tmp_path):
    """A --split with a test share but none for validation (90,0,10): the fix keeps the
    train and test numbers (it suggested --split 8,1,0, which drops the test set), and the
    warning does not say the run never evaluates (the test set is evaluated at the end)."""
    from megatron.core.datasets.gpt_dataset import get_train_valid_test_split
    from megatron.data_loading import no_validation_reason, validation_split_fix
    from tests.test_gpt_dataset import make_corpus

    big, _ = make_corpus(tmp_path / "big", [20] * 9)
    fix = validation_split_fix([big], "90,0,10")
    assert fix.endswith(f"with 9 documents in {big}, e.g. --split 90,10,10"), fix
    b = get_train_valid_test_split("90,10,10", 9)
    assert 0 < b[1] < b[2] < b[3] == 9, b
    assert validation_split_fix([big], "100,0,0").endswith("e.g. --split 8,1,0")
    # a test share too small for the documents is kept too (it suggested 3,1,0 and 49,1,0,
    # which drop the test set of every larger dataset of a blend)
    small, _ = make_corpus(tmp_path / "small", [20] * 4)  # 90,0,10 gives test nothing there
    assert validation_split_fix([small], "90,0,10").endswith("e.g. --split 90,20,10")
    assert get_train_valid_test_split("90,20,10", 4) == [0, 3, 4, 4]
    fifty, _ = make_corpus(tmp_path / "fifty", [20] * 50)
    assert validation_split_fix([fifty], "990,9,1").endswith("e.g. --split 990,20,1")
    assert get_train_valid_test_split("990,20,1", 50) == [0, 49, 50, 50]
    b = get_train_valid_test_split("990,20,1", 5000)  # a larger dataset keeps its test share
    assert b[3] - b[2] == 5 == b[3] - get_train_valid_test_split("990,9,1", 5000)[2], b
    cfg = tiny_config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_path=[big],
                                                            split="90,0,10"))
    reason = no_validation_reason(cfg, has_test=True)
    assert "never evaluates" not in reason
    assert ("so this run computes no validation loss (only the test set is evaluated, at the "
            "end)") in reason and reason.endswith("--eval-iters 0 to train without evaluation")
    assert "so this run never evaluates" in no_validation_reason(cfg)
    no_path = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_path=None))
    assert no_validation_reason(no_path, has_test=True).startswith(
        "no --valid-data-path, so this run computes no validation loss (only the test set")


# ---------------------------------------------------------------- Megatron's order, end to end

from tests import megatron_data_reference as mref  # noqa: E402

_RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --max-position-embeddings 32 "
        "--lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 1000 --num-workers 0").split()


@pytest.mark.parametrize("flags", [
    "--train-iters 100 --global-batch-size 8 --micro-batch-size 2 --eval-interval 30 --eval-iters 5",
    "--train-iters 7 --global-batch-size 12 --micro-batch-size 3 --eval-interval 1000",
    "--train-samples 1000 --global-batch-size 16 --micro-batch-size 4 --eval-interval 20 "
    "--eval-iters 3",
    "--train-samples 200 --global-batch-size 16 --micro-batch-size 2 --eval-interval 5 "
    "--eval-iters 2 --rampup-batch-size 4 4 60",
    "--train-samples 50 --global-batch-size 16 --micro-batch-size 1 --eval-interval 2 "
    "--eval-iters 1 --rampup-batch-size 2 2 70",
])
def test_split_sample_counts_are_megatrons(flags):
    """train = --train-samples or train_iters x GBS; valid = (train_iters // eval_interval
    + 1) x eval_iters x GBS; test = eval_iters x GBS, with train_iters of a sample-based
    run counted through the ramp-up and GBS the final --global-batch-size."""
    from megatron.arguments import parse_and_validate
    from megatron.data_loading import split_sample_counts

    cfg = parse_and_validate(_RUN + ["--mock-data", "--seq-length", "16"] + flags.split(),
                             world_size=2, env={}, cuda_available=False)
    f = flags.split()
    value = {k: f[f.index(k) + 1] for k in ("--global-batch-size", "--eval-interval")}
    gbs, interval = int(value["--global-batch-size"]), int(value["--eval-interval"])
    eval_iters = int(f[f.index("--eval-iters") + 1]) if "--eval-iters" in f else 100
    samples = int(f[f.index("--train-samples") + 1]) if "--train-samples" in f else None
    iters = int(f[f.index("--train-iters") + 1]) if "--train-iters" in f else None
    ramp = [int(x) for x in f[f.index("--rampup-batch-size") + 1:][:3]] \
        if "--rampup-batch-size" in f else None
    train_iters = mref.train_iters_of(iters, samples, gbs, ramp)
    assert cfg.training.train_iters == train_iters
    assert split_sample_counts(cfg) == mref.split_num_samples(train_iters, samples, gbs,
                                                              interval, eval_iters)


def _corpora(tmp_path, blend: bool):
    """One corpus (--data-path A) or three with uneven weights; prefix -> documents."""
    from tests.test_gpt_dataset import make_corpus

    sizes = {"a": [7, 30, 2, 11, 1, 45] * 100}
    if blend:
        sizes.update(b=[40, 3, 9] * 170, c=[5, 17] * 260)  # >= 500: a test document each
    corpora = {}
    for i, (name, doc_sizes) in enumerate(sizes.items()):
        prefix, docs = make_corpus(tmp_path / name, doc_sizes, seed=20 + i)
        corpora[prefix] = docs
    prefixes = list(corpora)
    path = [prefixes[0]] if not blend else ["3", prefixes[0], "1", prefixes[1], "0.5",
                                            prefixes[2]]
    return corpora, path


def _reference_windows(cfg, corpora, path, rank, **run):
    """(split, [mbs, seq + 1] tokens) of each micro-batch rank `rank` reads, Megatron's way."""
    d, t = cfg.data, cfg.training
    gbs = d.target_global_batch_size or d.global_batch_size
    counts = mref.split_num_samples(t.train_iters, t.train_samples, gbs, t.eval_interval,
                                    t.eval_iters)
    ref = dict(zip(("train", "valid", "test"),
                   mref.reference_datasets(corpora, path, d.split, counts, d.seq_length,
                                           d.seed)))
    reads = mref.run_reads(t.train_iters, gbs, d.micro_batch_size, cfg.parallel.dp_size, rank,
                           t.eval_interval, t.eval_iters, d.rampup_batch_size, **run)
    return [(split, np.stack([ref[split][i] for i in ids])) for split, ids in reads
            if ref[split] is not None]  # no test documents: no test draw


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("blend", [False, True])
def test_each_data_parallel_rank_reads_megatrons_windows(tmp_path, dp, blend):
    """build_datasets + make_iterator per data-parallel rank, from 0 and resumed at a
    consumed_samples count, give each rank Megatron's token windows micro-batch by
    micro-batch (mbs 2, --split 969,30,1 / 98,2,0)."""
    from megatron.arguments import parse_and_validate
    from megatron.data_loading import build_datasets

    corpora, path = _corpora(tmp_path, blend)
    split = "98,2,0" if blend else "969,30,1"
    cfg = parse_and_validate(_RUN + ["--data-path", *path, "--split", split, "--seq-length",
                                     "16", "--micro-batch-size", "2", "--global-batch-size",
                                     str(4 * dp), "--train-iters", "12", "--eval-interval", "4",
                                     "--eval-iters", "2", "--seed", "77"],
                             world_size=dp, env={}, cuda_available=False)
    datasets = build_datasets(cfg, 0, cfg.model.padded_vocab_size)
    gbs = 4 * dp
    for rank in range(dp):
        want = _reference_windows(cfg, corpora, path, rank)
        for split_name, consumed in (("train", 0), ("train", 5 * gbs), ("valid", 0),
                                     ("valid", 2 * gbs), ("test", 0)):
            expected = [w for s, w in want if s == split_name]
            skip = consumed // (2 * dp)  # micro-batches of this rank before `consumed`
            if datasets[split_name] is None:  # --split 98,2,0: no test documents
                assert not expected and split_name == "test"
                continue
            it = make_iterator(cfg, datasets[split_name], consumed, rank, dp, pin=False)
            try:
                for m, window in enumerate(expected[skip:skip + 12]):
                    np.testing.assert_array_equal(next(it)["text"].numpy(), window,
                                                  err_msg=f"{split_name} from {consumed}, "
                                                          f"rank {rank}/{dp}, micro-batch {m}")
            finally:
                it.close()


def _recorded_run(rank, world_size, argv):
    """Every micro-batch's tokens a pretrain() run reads on this rank, in order."""
    import megatron.train_step as train_step_module
    import megatron.training as training
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed, set_random_seed

    cfg = parse_and_validate(argv, world_size=world_size, env={"RANK": str(rank)},
                             cuda_available=False)
    rt = initialize_distributed(cfg.parallel, rank, world_size, 0)
    set_random_seed(cfg.training.seed, rt)
    reads, original = [], train_step_module.get_batch

    def recording(micro, *args, **kwargs):
        reads.append(micro["text"].numpy().copy())
        return original(micro, *args, **kwargs)

    train_step_module.get_batch = recording
    try:
        training.pretrain(cfg, rt)
    finally:
        train_step_module.get_batch = original
    return reads


def _compare_reads(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} micro-batches read, Megatron reads {len(want)}"
    for m, (tokens, (split, window)) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(tokens, window, err_msg=f"{what}: micro-batch {m} ({split})")


def _order_argv(path, save, extra):
    return _RUN + ["--data-path", *path, "--seq-length", "16", "--micro-batch-size", "2",
                   "--seed", "5", "--eval-interval", "2", "--eval-iters", "2",
                   "--log-interval", "1000", "--save", save, "--save-interval", "1000",
                   *extra]


def _resume_in_two(rank, world_size, argv_first, argv_second):
    return (_recorded_run(rank, world_size, argv_first),
            _recorded_run(rank, world_size, argv_second))


@pytest.mark.parametrize("extra", [
    ["--split", "969,30,1", "--global-batch-size", "8", "--train-iters", "6"],
    ["--split", "98,2,0", "--global-batch-size", "8", "--train-samples", "60",
     "--rampup-batch-size", "2", "2", "20"],
], ids=["iterations", "rampup"])
def test_training_reads_megatrons_samples_and_resumes_there(tmp_path, extra):
    """pretrain() reads, micro-batch by micro-batch, Megatron's sequence: the training
    steps, an --eval-iters validation draw every --eval-interval steps at the current batch
    size, the final validation and test draws; stopped by --exit-interval 3 and resumed
    with --load, the two runs read that same sequence (single process, a 3-way blend)."""
    from megatron.arguments import parse_and_validate

    corpora, path = _corpora(tmp_path, blend=True)
    save = str(tmp_path / "ckpt")
    argv = _order_argv(path, save, extra)
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    want = _reference_windows(cfg, corpora, path, 0)
    first = _recorded_run(0, 1, argv + ["--exit-interval", "3"])
    second = _recorded_run(0, 1, argv + ["--load", save])
    _compare_reads(first + second, want, "stopped at 3, resumed")


def test_two_data_parallel_ranks_read_megatrons_samples(tmp_path):
    """The same with 2 data-parallel processes (one corpus, --split 969,30,1), resumed."""
    from megatron.arguments import parse_and_validate

    corpora, path = _corpora(tmp_path, blend=False)
    save = str(tmp_path / "ckpt")
    argv = _order_argv(path, save, ["--split", "969,30,1", "--global-batch-size", "8",
                                    "--train-iters", "5"])
    cfg = parse_and_validate(argv, world_size=2, env={}, cuda_available=False)
    runs = run_distributed(_resume_in_two, 2, argv + ["--exit-interval", "2"],
                           argv + ["--load", save])
    for rank, (first, second) in enumerate(runs):
        _compare_reads(first + second, _reference_windows(cfg, corpora, path, rank),
                       f"rank {rank}")


def test_skip_train_evaluates_a_ramp_up_checkpoint_at_its_batch_size(tmp_path):
    """--skip-train --load of a checkpoint saved during the batch-size ramp-up draws
    --eval-iters global batches of the size the ramp had reached (Megatron's checkpoint
    load sets the micro-batch count from its consumed samples), not the final
    --global-batch-size: validation and test from their first sample."""
    from megatron.arguments import parse_and_validate

    corpora, path = _corpora(tmp_path, blend=False)
    save = str(tmp_path / "ckpt")
    argv = _order_argv(path, save, ["--split", "969,30,1", "--global-batch-size", "8",
                                    "--train-samples", "60", "--rampup-batch-size", "2", "2",
                                    "30"])
    _recorded_run(0, 1, argv + ["--exit-interval", "5"])  # 2+2+2+4+4 = 14 samples
    evaluated = _recorded_run(0, 1, argv + ["--load", save, "--skip-train"])
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    want = _reference_windows(cfg, corpora, path, 0, start_iteration=5, consumed_train=14,
                              skip_train=True)
    assert [w.shape[0] for _, w in want] == [2] * 8  # 2 draws x 2 iterations x 2 micro-batches
    _compare_reads(evaluated, want, "--skip-train at iteration 5")


def _documents(prefix, docs):
    """.bin/.idx at `prefix` with one document per item of `docs`, each a list of
    sentences (lists of token ids)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for sentences in docs:
        for sentence in sentences:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_eod_flags_on_data_without_end_of_document_tokens_are_warned(tmp_path):
    """--eod-mask-loss on data preprocessed without --append-eod acts on nothing (Megatron
    says nothing): a WARNING names the file and the fix. Data whose documents end with the
    id -- also when a document holds several sentences and only its last one has it --
    and runs without the flags get none."""
    from megatron.data_loading import missing_eod_warning

    eod = 99
    plain = _documents(str(tmp_path / "plain"), [[[5, 6, 7]], [[8, 9]]] * 40)
    marked = _documents(str(tmp_path / "marked"),
                        [[[5, 6], [7, 8, eod]], [[8, 9, eod]]] * 40)  # sentences: EOD at the end
    cfg = tiny_config(mbs=2, gbs=8, iters=10)

    def with_data(paths, **flags):
        data = dataclasses.replace(cfg.data, mock_data=False, data_path=paths, **flags)
        return dataclasses.replace(cfg, data=data)

    out = missing_eod_warning(with_data(["1", plain, "1", marked], eod_mask_loss=True), eod)
    assert out.startswith("WARNING: --eod-mask-loss acts at the end-of-document token (id 99)")
    assert plain in out and marked not in out and "--append-eod" in out
    both = with_data([plain], reset_position_ids=True, reset_attention_mask=True)
    assert "--reset-position-ids and --reset-attention-mask act" in missing_eod_warning(both, eod)
    assert missing_eod_warning(with_data([marked], eod_mask_loss=True), eod) is None
    assert missing_eod_warning(with_data([plain]), eod) is None  # no EOD flag
    assert missing_eod_warning(with_data([plain], eod_mask_loss=True), None) is None


def test_mock_data_draws_the_tokenizers_ids_not_the_padding_rows():
    """With a tokenizer's files (no --vocab-size) mock samples were drawn over the padded
    vocabulary: ids no tokenizer decodes, and other samples at each tensor-parallel size
    (the padding depends on it), though every layout is to see the same samples."""
    import dataclasses

    from megatron.arguments import parse_and_validate
    from megatron.data_loading import build_datasets

    cfg = parse_and_validate(_RUN + ["--mock-data", "--seq-length", "16", "--train-iters", "2",
                                     "--micro-batch-size", "1"],
                             world_size=1, env={}, cuda_available=False)
    files = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, vocab_size=None))
    at_tp = [build_datasets(files, 0, padded, tokenizer_vocab_size=1001)["train"]
             for padded in (1024, 1152)]
    samples = [torch.stack([ds[i]["text"] for i in range(64)]) for ds in at_tp]
    assert torch.equal(samples[0], samples[1]) and int(samples[0].max()) < 1001
    assert int(samples[0].max()) > 900  # drawn over the whole vocabulary
    null = build_datasets(cfg, 0, 1000, tokenizer_vocab_size=1001)["train"]  # --vocab-size
    assert null.vocab_size == 1000


def test_mock_data_with_the_cyclic_loader_has_epochs_of_the_runs_samples():
    """--mock-data --dataloader-type cyclic: each epoch is the samples the run asks for
    (train_iters x global batch), not the mock set's 2**40 samples, whose permutation
    (8 TiB) ended the run in an out-of-memory report. `single` keeps the endless set."""
    from megatron.data_loading import build_datasets

    cfg = tiny_config(world_size=2, mbs=2, gbs=8, iters=3)
    cfg.data = dataclasses.replace(cfg.data, dataloader_type="cyclic", seq_length=8)
    cfg.training = dataclasses.replace(cfg.training, eval_interval=2, eval_iters=1)
    datasets = build_datasets(cfg, 0, 128)
    assert [len(datasets[s]) for s in ("train", "valid", "test")] == [24, 16, 8]
    it = make_iterator(cfg, datasets["train"], consumed=0, dp_rank=1, dp_size=2, pin=False)
    try:
        batches = [next(it)["text"] for _ in range(7)]  # one epoch is 6 per rank: wraps
    finally:
        it.close()
    assert all(b.shape == (2, 9) for b in batches)
    single = dataclasses.replace(cfg.data, dataloader_type="single")
    assert len(build_datasets(dataclasses.replace(cfg, data=single), 0, 128)["train"]) == 2**40


@pytest.mark.parametrize("layout", ["data-path", "blend", "split-paths"])
def test_eval_interval_0_builds_no_validation_or_test_index(tmp_path, layout):
    """--eval-interval 0 (no evaluation, not even the final one) on a training run reads
    no validation or test sample: their index files were built anyway (time and disk on
    real data). A --skip-train run evaluates whatever the interval, and a run with an
    interval evaluates: both still build them."""
    from megatron.arguments import parse_and_validate
    from megatron.data_loading import build_datasets, split_sample_counts
    from tests.test_gpt_dataset import make_corpus

    a, _ = make_corpus(tmp_path / "a", [40] * 30, vocab=250)
    b, _ = make_corpus(tmp_path / "b", [30] * 20, seed=1, vocab=250)
    data = {"data-path": ["--data-path", a], "blend": ["--data-path", "1", a, "2", b],
            "split-paths": ["--train-data-path", a, "--valid-data-path", b,
                            "--test-data-path", b]}[layout]
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
            "--train-iters 4 --eval-iters 2 --tokenizer-type NullTokenizer --vocab-size 250 "
            "--split 80,10,10").split() + data

    def built(extra, cache):
        cfg = parse_and_validate(base + extra + ["--data-cache-path", str(tmp_path / cache)],
                                 world_size=1, env={}, cuda_available=False)
        datasets = build_datasets(cfg, 0, cfg.model.padded_vocab_size)
        names = {line.split()[-1] for f in (tmp_path / cache).rglob("*.dsc")
                 for line in f.read_text().splitlines() if line.startswith("Dataset name")}
        return cfg, {s for s, d in datasets.items() if d is not None}, names

    cfg, splits, names = built(["--eval-interval", "0"], "off")
    assert split_sample_counts(cfg) == [16, 0, 0]
    assert splits == names == {"train"}
    for extra in (["--eval-interval", "2"], ["--eval-interval", "0", "--skip-train"]):
        _, splits, names = built(extra, "on" + str(len(extra)))
        assert splits == names == {"train", "valid", "test"}, extra


def test_mock_data_builds_no_set_and_no_iterator_the_run_never_reads():
    """--mock-data --eval-interval 0 (no evaluation at all) builds no validation or test
    set, as real data does: the run's test iterator started a loader thread (or --num-workers
    processes) for a set never read. With an interval, or --skip-train, both are built."""
    from megatron.arguments import parse_and_validate
    from megatron.data_loading import build_datasets

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
            "--train-iters 4 --eval-iters 2 --tokenizer-type NullTokenizer --vocab-size 250 "
            "--mock-data").split()
    for extra, read in ((["--eval-interval", "0"], {"train"}),
                        (["--eval-interval", "2"], {"train", "valid", "test"}),
                        (["--eval-interval", "0", "--skip-train"], {"train", "valid", "test"})):
        cfg = parse_and_validate(base + extra, world_size=1, env={}, cuda_available=False)
        datasets = build_datasets(cfg, 0, cfg.model.padded_vocab_size)
        assert {s for s, d in datasets.items() if d is not None} == read, extra
        test = make_iterator(cfg, datasets["test"], consumed=0, dp_rank=0, dp_size=1, pin=False)
        assert (test is None) == ("test" not in read), extra
        if test is not None:
            test.close()
