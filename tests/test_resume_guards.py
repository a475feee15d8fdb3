"""What a resume says or skips when the command line and the checkpoint disagree in ways
that are allowed: another --seq-length, --seed or --split (a warning naming both values,
also in --dry-run), a checkpoint that already reaches --train-iters (nothing trained, nothing re-saved).
Single-process runs through the real driver (`parse_and_validate` -> `pretrain`)."""
from __future__ import annotations

from pathlib import Path

import megatron.training as training
from megatron.arguments import parse_and_validate, run_dry_run
from megatron.checkpoint_args import data_order_warning, seq_length_warning, tokenizer_warning
from megatron.initialize import initialize_distributed, set_random_seed

BASE = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 100 --use-cpu-initialization --num-workers 0 "
    "--log-interval 1000 --eval-iters 0 --eval-interval 1000"
).split()


def config(extra, base=BASE):
    return parse_and_validate(list(base) + list(extra), world_size=1, env={"RANK": "0"},
                              cuda_available=False)


def run_pretrain(extra, base=BASE):
    cfg = config(extra, base)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    return training.pretrain(cfg, rt)


def save_run(root, seq_length=16, iters=3, stop_at=2):
    """A run of `iters` iterations with --save, stopped at `stop_at` by --exit-interval
    (same schedule for the resume: --train-iters sets the decay length)."""
    run_pretrain(["--seq-length", str(seq_length), "--train-iters", str(iters),
                  "--save", str(root), "--save-interval", str(stop_at),
                  "--exit-interval", str(stop_at)])


# ------------------------------------------------------------------- --seq-length


def test_seq_length_warning_text():
    saved = {"seq_length": 8, "position_embedding_type": "learned_absolute"}
    assert seq_length_warning(saved, dict(saved), "d") is None
    assert seq_length_warning({}, saved, "d") is None  # an older writer: nothing to compare
    longer = seq_length_warning(saved, {**saved, "seq_length": 16}, "d/iter_0000002")
    assert longer.startswith("WARNING: --seq-length 16 differs from the checkpoint's 8 "
                             "(d/iter_0000002)")
    assert "learned position embeddings 8..15 were not trained" in longer
    assert "rerun with --seq-length 8" in longer and "\n" not in longer
    shorter = seq_length_warning(saved, {**saved, "seq_length": 4}, "d")
    assert "position embeddings" not in shorter
    rope = {"seq_length": 16, "position_embedding_type": "rope"}
    assert "rotary positions" in seq_length_warning(saved, rope, "d")
    assert "shuffled anew" not in longer  # mock data: no index to rebuild
    data = seq_length_warning(saved, {**saved, "seq_length": 16, "data_path": ["p"]}, "d")
    assert ("; the --data-path documents are cut into samples of the new length and shuffled "
            "anew, so of the text consumed so far some comes again and some never (as in "
            "Megatron-LM); continuing") in data


def test_resume_with_other_seq_length_warns(tmp_path, capsys):
    save_run(tmp_path, seq_length=8)
    capsys.readouterr()
    tr = run_pretrain(["--seq-length", "16", "--train-iters", "3", "--load", str(tmp_path)])
    assert tr.state.iteration == 3
    out = capsys.readouterr().out
    assert out.count("WARNING: --seq-length 16 differs from the checkpoint's 8") == 1, out
    assert "learned position embeddings 8..15" in out


def test_dry_run_load_prints_the_seq_length_warning(tmp_path, capsys):
    save_run(tmp_path, seq_length=16)
    capsys.readouterr()
    status = run_dry_run(config(["--seq-length", "8", "--train-iters", "3", "--load",
                                 str(tmp_path)]), 1)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "WARNING: --seq-length 8 differs from the checkpoint's 16" in out, out


# ------------------------------------------------------------------- the tokenizer


def test_tokenizer_warning_text(tmp_path):
    """Another tokenizer whose vocabulary pads to the checkpoint's rows resumed in silence
    (Megatron-LM compares --tokenizer-type only with a --vocab-file, never the files)."""
    trained, other, copy = tmp_path / "sp.model", tmp_path / "other.model", tmp_path / "c"
    trained.write_bytes(b"model one")
    other.write_bytes(b"model two")
    copy.write_bytes(b"model one")
    saved = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": str(trained)}
    assert tokenizer_warning(saved, dict(saved), "d") is None
    assert tokenizer_warning(saved, {**saved, "tokenizer_model": str(copy)}, "d") is None
    gone = {**saved, "tokenizer_model": str(tmp_path / "moved-away.model")}
    assert tokenizer_warning(gone, {**saved, "tokenizer_model": str(other)}, "d") is None
    assert tokenizer_warning({}, saved, "d") is None  # an older writer: nothing to compare
    text = tokenizer_warning(saved, {**saved, "tokenizer_model": str(other)}, "d/iter_2")
    assert text.startswith("WARNING: this run's tokenizer is likely not the one the "
                           f"checkpoint in d/iter_2 was trained with: --tokenizer-model "
                           f"{other} differs from the file the checkpoint was trained with, "
                           f"{trained}; training goes on")
    kind = tokenizer_warning(saved, {**saved, "tokenizer_type": "GPTSentencePieceTokenizer"},
                             "d")
    assert ("--tokenizer-type GPTSentencePieceTokenizer is not the checkpoint's "
            "SentencePieceTokenizer") in kind
    assert tokenizer_warning(saved, {**saved, "tokenizer_model": str(other),
                                     "finetune": True}, "d") is None


def test_resume_with_another_sentencepiece_model_warns_also_in_dry_run(tmp_path, capsys):
    from pretrain_gpt import tokenizer_vocab_size
    from tests.test_tokenizer import _train_sentencepiece

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _train_sentencepiece(tmp_path / "a")
    two = _train_sentencepiece(tmp_path / "b", max_sentencepiece_length=2)  # 128 rows too
    sp = ["--tokenizer-type", "SentencePieceTokenizer", "--seq-length", "8"]
    base = [a for a in BASE if a not in ("NullTokenizer", "--vocab-size", "100")] + sp
    base.remove("--tokenizer-type")

    def sp_config(extra):
        return parse_and_validate(base + extra, world_size=1, env={"RANK": "0"},
                                  cuda_available=False, vocab_size_fn=tokenizer_vocab_size)

    def sp_run(extra):
        cfg = sp_config(extra)
        rt = initialize_distributed(cfg.parallel, 0, 1, 0)
        set_random_seed(cfg.training.seed, rt)
        return training.pretrain(cfg, rt)

    sp_run(["--tokenizer-model", one, "--train-iters", "3", "--save", str(tmp_path),
            "--save-interval", "2", "--exit-interval", "2"])
    capsys.readouterr()
    resume = ["--tokenizer-model", two, "--train-iters", "3", "--load", str(tmp_path)]
    assert sp_run(resume).state.iteration == 3
    out = capsys.readouterr().out
    assert out.count(f"WARNING: this run's tokenizer is likely not the one the checkpoint in "
                     f"{tmp_path}/iter_0000002 was trained with: --tokenizer-model {two} "
                     f"differs from the file the checkpoint was trained with, {one};") == 1, out
    assert run_dry_run(sp_config(resume), 1) == 0
    assert f"--tokenizer-model {two} differs" in capsys.readouterr().out


# ------------------------------------------------------------ --seed / --split



def test_data_order_warning_skip_train_says_only_the_split():
    """--skip-train --load evaluates a checkpoint, often on other data or another seed: it
    reads no training data, so 'the new data is read from its sample N on' (and the seed's
    reshuffle of the consumed samples) would be false; a --split change still is said (the
    evaluated ranges may hold trained-on documents)."""
    saved = {"seed": 1234, "split": "969, 30, 1", "data_path": ["d"], "mock_data": False,
             "consumed_train_samples": 40}
    run = {**saved, "finetune": False, "skip_train": True}
    assert data_order_warning(saved, {**run, "data_path": ["0.5", "d", "0.5", "e"]}, "w") is None
    assert data_order_warning(saved, {**run, "seed": 7}, "w") is None
    split = data_order_warning(saved, {**run, "seed": 7, "split": "90,5,5",
                                       "data_path": ["e"]}, "w")
    assert split.startswith("WARNING: --split '90,5,5' differs from the checkpoint's")
    assert "--seed" not in split and "--data-path" not in split

def test_data_order_warning_text():
    saved = {"seed": 1234, "split": "969, 30, 1", "data_path": ["d"], "mock_data": False,
             "consumed_train_samples": 40}
    run = {**saved, "finetune": False}
    assert data_order_warning(saved, run, "w") is None
    assert data_order_warning(saved, {**run, "split": "969,30,1"}, "w") is None  # same shares
    assert data_order_warning(saved, {**run, "seed": 7, "finetune": True}, "w") is None
    assert data_order_warning({**saved, "mock_data": True}, {**run, "seed": 7}, "w") is None
    seed = data_order_warning(saved, {**run, "seed": 7}, "w/iter_0000010")
    assert seed.startswith("WARNING: --seed 7 differs from the checkpoint's 1234 "
                           "(w/iter_0000010): the samples are shuffled in another order, so "
                           "some of the 40 consumed so far will come again and others never")
    both = data_order_warning(saved, {**run, "seed": 7, "split": "90,5,5"}, "w")
    assert "and --split '90,5,5' differs from the checkpoint's '969, 30, 1'" in both
    assert "validation loss may be measured on documents already trained on" in both
    assert "\n" not in both
    # another blend: read from the consumed count on (Megatron-LM's rule), said; the same
    # blend written otherwise is not
    assert data_order_warning({**saved, "data_path": ["1", "a", "1", "b"]},
                              {**run, "data_path": ["0.5", "./a", "0.5", "b"]}, "w") is None
    blend = data_order_warning(saved, {**run, "data_path": ["0.5", "d", "0.5", "e"]}, "w/i")
    assert blend == ("WARNING: --data-path 0.5 d 0.5 e differs from the checkpoint's d (w/i): "
                     "the new data is read from its sample 40 on, so samples of a dataset added "
                     "or weighted up are skipped and of one weighted down some come again (if "
                     "the files only moved, nothing changes); continuing is allowed, to resume "
                     "the saved order rerun with the checkpoint's values")


def test_data_order_warning_of_the_training_loader():
    """The sharded cyclic loader permutes each data-parallel rank's bucket, so its epoch
    order depends on the data-parallel size; another --dataloader-type reads another order
    too. Megatron-LM resumes either silently; the single loader at another size does not
    change the order (silent)."""
    saved = {"seed": 1234, "split": "969, 30, 1", "data_path": ["d"], "mock_data": False,
             "consumed_train_samples": 40, "dataloader_type": "cyclic",
             "data_parallel_size": 2, "data_sharding": True}
    run = {**saved, "finetune": False}
    assert data_order_warning(saved, run, "w") is None
    dp = data_order_warning(saved, {**run, "data_parallel_size": 1}, "w/i")
    assert dp == ("WARNING: the data-parallel size 1 differs from the checkpoint's 2 under "
                  "--dataloader-type cyclic (each data-parallel rank permutes its own share of "
                  "the set) (w/i): the epoch in progress is read in another order, so some of "
                  "the 40 consumed so far will come again and others never; continuing is "
                  "allowed, to resume the saved order rerun with the checkpoint's values")
    kind = data_order_warning(saved, {**run, "dataloader_type": "single"}, "w")
    assert kind.startswith("WARNING: --dataloader-type single differs from the checkpoint's "
                           "cyclic (w): the training samples are read in another order")
    for same_order in ({**run, "data_parallel_size": 1, "data_sharding": False},
                       {**run, "data_parallel_size": 1, "skip_train": True},
                       {**run, "data_parallel_size": 1, "finetune": True}):
        assert data_order_warning({**saved, "data_sharding": same_order["data_sharding"]},
                                  same_order, "w") is None
    single = {**saved, "dataloader_type": "single"}
    assert data_order_warning(single, {**single, "data_parallel_size": 4}, "w") is None
    assert data_order_warning({**single, "dataloader_type": None}, single, "w") is None


def test_a_cyclic_resume_at_another_data_parallel_size_warns(tmp_path, capsys):
    """Through the driver: the checkpoint's saved data-parallel size (2, as a two-rank run
    writes it) against this single-rank run's."""
    import torch

    from tests.test_gpt_dataset import make_corpus

    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 50, vocab=100)
    data = ["--data-path", prefix, "--seq-length", "16", "--train-iters", "3",
            "--dataloader-type", "cyclic"]
    root, base = tmp_path / "ck", [a for a in BASE if a != "--mock-data"]
    run_pretrain(data + ["--save", str(root), "--save-interval", "2", "--exit-interval", "2"],
                 base)
    capsys.readouterr()
    run_pretrain(data + ["--load", str(root)], base)  # the saved layout: silent
    assert "differs from the checkpoint" not in capsys.readouterr().out
    path = root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"]["data_parallel_size"] = 2
    torch.save(state, path)
    run_pretrain(data + ["--load", str(root)], base)
    out = capsys.readouterr().out
    assert out.count("WARNING: the data-parallel size 1 differs from the checkpoint's 2 under "
                     "--dataloader-type cyclic") == 1, out


def test_resume_with_another_seed_warns_also_in_dry_run(tmp_path, capsys):
    """Megatron-LM resumes silently in another sample order; said once, and by --dry-run."""
    from tests.test_gpt_dataset import make_corpus

    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 50, vocab=100)
    data = ["--data-path", prefix, "--seq-length", "16", "--train-iters", "3"]
    root, base = str(tmp_path / "ck"), [a for a in BASE if a != "--mock-data"]
    run_pretrain(data + ["--save", root, "--save-interval", "2", "--exit-interval", "2"], base)
    capsys.readouterr()
    tr = run_pretrain(data + ["--load", root, "--seed", "99"], base)
    assert tr.state.iteration == 3
    out = capsys.readouterr().out
    assert out.count("WARNING: --seed 99 differs from the checkpoint's 1234") == 1, out
    run_pretrain(data + ["--load", root], base)  # the saved order: silent
    assert "differs from the checkpoint" not in capsys.readouterr().out
    assert run_dry_run(config(data + ["--load", root, "--split", "90,5,5"], base), 1) == 0
    assert "--split '90,5,5' differs from the checkpoint's '969, 30, 1'" in capsys.readouterr().out


def test_a_longer_run_whose_data_needs_more_epochs_warns_of_the_new_order(tmp_path, capsys):
    """The train index is sized by --train-iters x --global-batch-size (Megatron-LM's rule):
    a resume that asks the data for more epochs than the saving run did shuffles all its
    samples anew -- silently in Megatron-LM -- and the consumed count points into the new
    order. Said once, with the --train-iters that keep the order; nothing when they do."""
    import numpy as np

    from megatron.core.datasets.gpt_index import build_index_arrays
    from tests.test_gpt_dataset import make_corpus

    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 20, vocab=100)  # train: 19 documents
    data = ["--data-path", prefix, "--seq-length", "16"]  # 760 tokens: 47 samples an epoch
    root, base = str(tmp_path / "ck"), [a for a in BASE if a != "--mock-data"]
    run_pretrain(data + ["--train-iters", "3", "--save", root, "--save-interval", "2",
                         "--exit-interval", "2"], base)  # asks 12 samples: one epoch
    capsys.readouterr()
    resume = data + ["--load", root, "--override-opt_param-scheduler", "--exit-interval", "3"]
    run_pretrain(resume + ["--train-iters", "40"], base)
    out = capsys.readouterr().out
    assert out.count("WARNING: this run asks its train data for 160 samples, the run that "
                     "saved the checkpoint for 12 ") == 1, out
    assert (f"the train index of {prefix} (now 4 epoch(s), the last shuffled apart; 1 "
            "epoch(s) before) changes: its samples are shuffled in another order, some of the "
            "8 consumed so far come again and others never") in out
    assert "--train-iters 1 to 11 keeps the saved order at global batch size 4" in out
    run_pretrain(resume + ["--train-iters", "11"], base)
    assert "WARNING: this run asks" not in capsys.readouterr().out
    # what the warning says of Megatron-LM's index: 44 samples, the order of 12; 160, another
    sizes, documents = np.full(20, 40, dtype=np.int32), np.arange(19, dtype=np.int32)
    saved = build_index_arrays(documents, sizes, 12, 16, 1234)
    assert all(np.array_equal(a, b) for a, b in
               zip(saved, build_index_arrays(documents, sizes, 44, 16, 1234)))
    assert not np.array_equal(saved[2][:12], build_index_arrays(documents, sizes, 160, 16,
                                                               1234)[2][:12])


def test_a_longer_run_warns_that_its_validation_set_is_shuffled_anew(tmp_path, capsys):
    """The validation set is sized by (--train-iters // --eval-interval + 1) x --eval-iters
    x global batch (Megatron-LM's rule): 16 samples at --train-iters 3, 164 at 40, which
    spans 7 epochs of the validation documents instead of 1, so the index is shuffled
    anew and consumed_valid_samples (8) points into the new order. Said once; the test set
    (--eval-iters x global batch) does not depend on --train-iters."""
    import numpy as np

    from megatron.core.datasets.gpt_index import build_index_arrays
    from megatron.data_loading import split_sample_counts
    from tests.test_gpt_dataset import make_corpus

    prefix, _ = make_corpus(tmp_path / "corpus", [40] * 20, vocab=100)
    data = ["--data-path", prefix, "--seq-length", "16", "--split", "50,50,0"]
    base = [a for a in BASE if a != "--mock-data"][:-4] + ["--eval-iters", "1",
                                                          "--eval-interval", "1"]
    root = str(tmp_path / "ck")
    run_pretrain(data + ["--train-iters", "3", "--save", root, "--save-interval", "2",
                         "--exit-interval", "2"], base)
    capsys.readouterr()
    resume = data + ["--load", root, "--override-opt_param-scheduler", "--exit-interval", "3"]
    run_pretrain(resume + ["--train-iters", "40"], base)
    out = capsys.readouterr().out
    assert out.count("WARNING: this run asks its validation data for 164 samples, the run "
                     "that saved the checkpoint for 16 ") == 1, out
    assert (f"the validation index of {prefix} (now 7 epoch(s), the last shuffled apart; 1 "
            "epoch(s) before) changes: its samples are shuffled in another order") in out
    assert "some of the 8 evaluated so far again" in out
    run_pretrain(resume + ["--train-iters", "3"], base)
    assert "its validation data" not in capsys.readouterr().out
    # --eval-iters 0 after a run whose validation set spanned 7 epochs: this run evaluates
    # nothing, so no evaluation reads another order (it was warned of "0 samples", "now 1
    # epoch(s)" and "the evaluations from here on")
    root40 = str(tmp_path / "ck40")
    run_pretrain(data + ["--train-iters", "40", "--save", root40, "--save-interval", "2",
                         "--exit-interval", "2"], base)
    capsys.readouterr()
    resume40 = data + ["--load", root40, "--exit-interval", "3", "--train-iters", "40"]
    run_pretrain(resume40 + ["--eval-iters", "0"], base)
    assert "its validation data" not in capsys.readouterr().out
    sizes, documents = np.full(20, 40, dtype=np.int32), np.arange(10, 20, dtype=np.int32)
    assert not np.array_equal(build_index_arrays(documents, sizes, 16, 16, 1234)[2][:16],
                              build_index_arrays(documents, sizes, 164, 16, 1234)[2][:16])
    counts = [split_sample_counts(config(data + ["--train-iters", n], base)) for n in "3 40".split()]
    assert counts[0][1] != counts[1][1] and counts[0][2] == counts[1][2] == 4


def test_train_order_warning_rules():
    """Which resumes `train_order_warning` speaks for: a blend names each member whose
    layout changes (its share of the request, ceil(n * w * 1.005)); nothing for an
    evaluation only, another seed (its own warning), or the request the checkpoint made."""
    from types import SimpleNamespace

    from megatron.checkpoint_args import train_order_warning

    def member(prefix, tokens, asked):
        return SimpleNamespace(data_prefix=prefix, tokens_per_epoch=tokens, seq_length=16,
                               num_samples=asked)

    args = {"seed": 1, "split": "969, 30, 1", "seq_length": 16, "mock_data": False,
            "train_data_path": None, "data_path": ["0.5", "big", "0.5", "small"],
            "train_iters": 3, "global_batch_size": 4, "train_samples": None}
    run = {**args, "train_iters": 40}  # asks 160: each member ceil(160 * 0.5 * 1.005) = 81
    blend = SimpleNamespace(datasets=[member("big", 16000, 81), member("small", 800, 81)])
    text = train_order_warning(args, run, blend, 160, 8)
    assert ("the train index of small (now 2 epoch(s), the last shuffled apart; 1 epoch(s) "
            "before) changes") in text and "big" not in text
    assert "keeps the saved order" not in text  # no simple bound for a blend
    assert train_order_warning(args, {**run, "skip_train": True}, blend, 160, 8) is None
    assert train_order_warning(args, {**run, "seed": 2}, blend, 160, 8) is None
    assert train_order_warning(args, run, blend, 160, 0) is None  # nothing consumed yet
    same = SimpleNamespace(datasets=[member("big", 16000, 7), member("small", 800, 7)])
    assert train_order_warning(args, args, same, 12, 8) is None


# ------------------------------------------------------------------- --skip-train


def test_skip_train_evaluates_a_checkpoint_without_its_training_schedule(tmp_path, capsys):
    """--skip-train only evaluates and saves nothing: the optimizer, schedule and RNG
    states are not loaded. An evaluation without --train-iters (allowed with --skip-train)
    stopped on the schedule check ('lr_decay_steps' 12 vs 1), and one of a checkpoint saved
    with --no-save-optim --no-save-rng needed --no-load-optim --no-load-rng."""
    root = tmp_path / "ck"
    run_pretrain(["--seq-length", "16", "--train-iters", "3", "--save", str(root),
                  "--save-interval", "2", "--exit-interval", "2", "--no-save-optim",
                  "--no-save-rng"])
    capsys.readouterr()
    evaluate = ["--seq-length", "16", "--load", str(root), "--skip-train", "--eval-iters", "1"]
    tr = run_pretrain(evaluate)
    out = capsys.readouterr().out
    assert tr.state.iteration == 2 and "validation loss at iteration 2" in out, out
    assert "start fresh" not in out
    assert run_dry_run(config(evaluate), 1) == 0
    assert "--skip-train: evaluates only" in capsys.readouterr().out
    full = tmp_path / "full"  # with its optimizer and schedule (12 samples of decay)
    save_run(full)
    capsys.readouterr()
    tr = run_pretrain(["--seq-length", "16", "--load", str(full), "--skip-train",
                       "--eval-iters", "1"])
    assert tr.state.iteration == 2 and "validation loss at iteration 2" in capsys.readouterr().out


def test_skip_train_does_not_create_its_save_dir(tmp_path):
    """--skip-train writes no checkpoint (Megatron: it saves only after training); the
    start-up probe of --save still created the directory, left empty."""
    root = tmp_path / "ck"
    save_run(root)
    out = tmp_path / "never"
    tr = run_pretrain(["--seq-length", "16", "--load", str(root), "--skip-train",
                       "--eval-iters", "1", "--save", str(out), "--save-interval", "1"])
    assert tr.state.iteration == 2
    assert not out.exists()


# ------------------------------------------------- --train-samples at another batch size


def test_sample_based_resume_at_another_global_batch_warns_and_names_the_fix(tmp_path, capsys):
    """--train-samples 28 at global batch 4, stopped at iteration 3 (12 samples), resumed
    at global batch 8: Megatron-LM's count gives 28 // 8 = 3 iterations, so the run trains
    nothing and ends at 12 of the 28 samples (it said only 'nothing to train'). The warning
    names the --train-samples that trains the 16 left; that command reaches 28."""
    root = str(tmp_path / "ck")
    samples = ["--seq-length", "16", "--train-samples", "28"]
    run_pretrain(samples + ["--save", root, "--save-interval", "3", "--exit-interval", "3"])
    capsys.readouterr()
    tr = run_pretrain(samples + ["--load", root, "--global-batch-size", "8"])
    out = capsys.readouterr().out
    assert tr.state.iteration == 3 and tr.state.consumed_train_samples == 12
    assert ("WARNING: --train-samples 28 at global batch size 8 makes 3 iterations "
            "(Megatron-LM's count: as if every batch had 8 samples), but the checkpoint "
            "consumed 12 samples in 3 iterations of another batch size: this run trains 0 "
            "more and ends at 12 samples, not 28. To train the 16 left (in whole batches), "
            "pass --train-samples 40 with --use-checkpoint-opt_param-scheduler") in out, out
    # --dry-run --load says the same before anything runs, and nothing for the fixed command
    assert run_dry_run(config(samples + ["--load", root, "--global-batch-size", "8"]), 1) == 0
    out = capsys.readouterr().out
    assert "this run trains 0 more and ends at 12 samples, not 28" in out, out
    fixed = ["--seq-length", "16", "--train-samples", "40", "--load", root,
             "--global-batch-size", "8", "--use-checkpoint-opt_param-scheduler"]
    assert run_dry_run(config(fixed), 1) == 0
    assert "WARNING: --train-samples" not in capsys.readouterr().out
    tr = run_pretrain(["--seq-length", "16", "--train-samples", "40", "--load", root,
                       "--global-batch-size", "8", "--use-checkpoint-opt_param-scheduler"])
    assert (tr.state.iteration, tr.state.consumed_train_samples) == (5, 28)
    assert "WARNING: --train-samples" not in capsys.readouterr().out
    run_pretrain(samples + ["--load", root])  # the same batch size: nothing to say
    assert "WARNING: --train-samples" not in capsys.readouterr().out


def test_sample_based_resume_under_another_rampup_warns_and_names_the_fix(tmp_path, capsys):
    """--train-samples 28 at global batch 4 without ramp-up, stopped at iteration 3 (12
    samples), resumed with --rampup-batch-size 2 2 8: Megatron-LM's count is the ramp from
    sample 0 (5 steps, 12 samples) then 16 // 4 = 4 batches, 9 iterations; from iteration 3
    the run takes 6 more batches of 4 and ends at 36 samples, 8 past --train-samples,
    silently (the warning left every ramped run out). The --train-samples it names (20)
    makes 7 iterations and ends at 28."""
    root = str(tmp_path / "ck")
    samples = ["--seq-length", "16", "--train-samples", "28"]
    ramp = ["--rampup-batch-size", "2", "2", "8"]
    run_pretrain(samples + ["--save", root, "--save-interval", "3", "--exit-interval", "3"])
    capsys.readouterr()
    tr = run_pretrain(samples + ramp + ["--load", root])
    out = capsys.readouterr().out
    assert (tr.state.iteration, tr.state.consumed_train_samples) == (9, 36)
    expected = ("WARNING: --train-samples 28 with --rampup-batch-size 2 2 8 makes 9 iterations "
                "(Megatron-LM's count: the ramp from sample 0, then batches of 4), but the "
                "checkpoint consumed 12 samples in 3 iterations, not the 6 this ramp takes: "
                "this run trains 6 more and ends at 36 samples, not 28. To train the 16 left "
                "(in whole batches), pass --train-samples 20 with "
                "--use-checkpoint-opt_param-scheduler")
    assert expected in out, out
    assert run_dry_run(config(samples + ramp + ["--load", root]), 1) == 0
    assert expected in capsys.readouterr().out
    tr = run_pretrain(["--seq-length", "16", "--train-samples", "20", "--load", root,
                       "--use-checkpoint-opt_param-scheduler"] + ramp)
    assert (tr.state.iteration, tr.state.consumed_train_samples) == (7, 28)
    assert "WARNING: --train-samples" not in capsys.readouterr().out


def test_rampup_resume_on_the_same_ramp_is_not_warned(tmp_path, capsys):
    """A ramped run stopped inside its ramp (iteration 3, 6 samples) and resumed with the
    same flags: the count is exact (5 ramp steps to 12 samples, then 4 batches of 4), it
    ends at --train-samples 28 with nothing to warn about."""
    root = str(tmp_path / "ck")
    flags = ["--seq-length", "16", "--train-samples", "28", "--rampup-batch-size", "2", "2", "8"]
    run_pretrain(flags + ["--save", root, "--save-interval", "3", "--exit-interval", "3"])
    capsys.readouterr()
    tr = run_pretrain(flags + ["--load", root])
    assert "WARNING: --train-samples" not in capsys.readouterr().out
    assert (tr.state.iteration, tr.state.consumed_train_samples) == (9, 28)


def test_longer_train_samples_at_the_same_batch_keeping_the_schedule_is_not_warned(
        tmp_path, capsys):
    """--train-samples 28 -> 40 at the same global batch with
    --use-checkpoint-opt_param-scheduler (train on at the checkpoint's final lr): Megatron's
    count is exact, the run ends at 40. The warning took the checkpoint's 28 for the goal
    and told to pass --train-samples 28 (ending the run where it was meant to go on)."""
    root = str(tmp_path / "ck")
    run_pretrain(["--seq-length", "16", "--train-samples", "28", "--save", root,
                  "--save-interval", "3", "--exit-interval", "3"])
    longer = ["--seq-length", "16", "--train-samples", "40", "--load", root,
              "--use-checkpoint-opt_param-scheduler"]
    capsys.readouterr()
    assert run_dry_run(config(longer), 1) == 0
    assert "WARNING: --train-samples" not in capsys.readouterr().out
    tr = run_pretrain(longer)
    assert "WARNING: --train-samples" not in capsys.readouterr().out
    assert (tr.state.iteration, tr.state.consumed_train_samples) == (10, 40)
    assert tr.scheduler.lr_decay_steps == 28 and tr.scheduler.get_lr() == 0.0  # --min-lr 0
    # a --train-samples the checkpoint already passed: 'nothing to train', and no claim of
    # another batch size
    run_pretrain(["--seq-length", "16", "--train-samples", "8", "--load", root,
                  "--override-opt_param-scheduler"])
    out = capsys.readouterr().out
    assert "already reaches --train-samples 8" in out and "WARNING: --train-samples" not in out


# ------------------------------------------------------------ nothing left to train


def _files(root):
    """{path: (size, mtime_ns, bytes)} of every file under `root`."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p)] = (st.st_size, st.st_mtime_ns, p.read_bytes())
    return out


def test_resume_at_train_iters_trains_and_saves_nothing(tmp_path, capsys):
    save_run(tmp_path, iters=2, stop_at=2)  # reaches --train-iters 2 with a save at 2
    before = _files(tmp_path)
    capsys.readouterr()
    tr = run_pretrain(["--seq-length", "16", "--train-iters", "2", "--load", str(tmp_path),
                       "--save", str(tmp_path), "--save-interval", "2"])
    out = capsys.readouterr().out
    assert tr.state.iteration == 2
    assert ("checkpoint at iteration 2 already reaches --train-iters 2: nothing to train; "
            f"not saving it again (--save {tmp_path} holds it)") in out, out
    assert "saving checkpoint" not in out, out
    assert _files(tmp_path) == before


def test_a_lowered_train_iters_schedule_error_says_nothing_would_train(tmp_path, capsys):
    """--train-iters lowered below the checkpoint's iteration: the schedule check stops the
    run (as Megatron-LM's assert does) naming the two scheduler flags, but either flag
    then only loads and stops; said in the same error, and by --dry-run. Not said for a
    longer run."""
    import pytest

    save_run(tmp_path, iters=3, stop_at=2)
    note = ("note: the checkpoint at iteration 2 already reaches --train-iters 1, so with "
            "either flag this run trains nothing; to train on, pass a run longer than 2 "
            "iterations")
    lowered = ["--seq-length", "16", "--train-iters", "1", "--load", str(tmp_path)]
    with pytest.raises(SystemExit) as err:
        run_pretrain(lowered)
    message = str(err.value)
    assert "--override-opt_param-scheduler" in message, message
    assert message.endswith("\n" + note), message
    capsys.readouterr()
    assert run_dry_run(config(lowered), 1) == 1
    assert f"  {note}\n" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        run_pretrain(["--seq-length", "16", "--train-iters", "5", "--load", str(tmp_path)])
    assert "--override-opt_param-scheduler" in str(err.value)
    assert "note:" not in str(err.value)


def test_resume_at_train_iters_into_another_directory_still_saves(tmp_path, capsys):
    """--save elsewhere does not hold the state: saved there, as Megatron-LM does."""
    save_run(tmp_path / "a", iters=2, stop_at=2)
    capsys.readouterr()
    run_pretrain(["--seq-length", "16", "--train-iters", "2", "--load", str(tmp_path / "a"),
                  "--save", str(tmp_path / "b"), "--save-interval", "5"])
    out = capsys.readouterr().out
    assert "already reaches --train-iters 2: nothing to train\n" in out, out
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


# ------------------------------------------------------------------- a file without weights
def _saved_without(root: Path, iters: int, entry: str) -> None:
    """A run of `iters` iterations saved at the last (and every 2nd) into `root`, then
    `entry` removed from its last model file."""
    import torch

    run_pretrain(["--seq-length", "16", "--train-iters", str(iters), "--save", str(root),
                  "--save-interval", "2"])
    path = root / f"iter_{iters:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    del state[entry]
    torch.save(state, path)



def test_resume_from_a_file_without_model_weights_names_it_and_the_other_checkpoints(
        tmp_path):
    """A model_optim_rng.pt without its 'model' entry was blamed on
    --num-layers-per-virtual-pipeline-stage (`has model entries []`), naming no file."""
    import pytest

    _saved_without(tmp_path, 4, "model")
    with pytest.raises(SystemExit) as err:
        run_pretrain(["--seq-length", "16", "--train-iters", "4", "--load", str(tmp_path)])
    message = str(err.value)
    assert f"checkpoint {tmp_path}/iter_0000004 holds no model weights" in message, message
    assert "virtual-pipeline" not in message
    assert f"printf 2 > {tmp_path}/latest_checkpointed_iteration.txt" in message, message


def test_a_checkpoint_without_its_arguments_says_they_are_not_checked(tmp_path, capsys):
    """(Resumed in silence: no word that the model flags went unchecked.)"""
    _saved_without(tmp_path, 2, "args")
    capsys.readouterr()
    run_pretrain(["--seq-length", "16", "--train-iters", "3", "--load", str(tmp_path),
                  "--override-opt_param-scheduler"])
    assert (f" > the checkpoint in {tmp_path}/iter_0000002 stores no arguments: this run's "
            "model flags are not checked against it") in capsys.readouterr().out
