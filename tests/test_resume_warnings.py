"""Resume warnings for another --layernorm-epsilon, for --mock-data samples that differ
from the saving run's (another --seed, the cyclic loader's epoch), and for another --seed
with --train-data-path. Megatron-LM resumes silently in each case; here one line names
both values, on the resume and in --dry-run."""
from __future__ import annotations

from megatron.arguments import run_dry_run
from megatron.checkpoint_args import data_order_warning, norm_epsilon_warning
from megatron.core.datasets.mock import MockGPTDataset
from megatron.data_loading import CyclicSampler
from tests.test_resume_guards import config, run_pretrain, save_run


def test_norm_epsilon_warning_text():
    saved = {"layernorm_epsilon": 1e-6}
    assert norm_epsilon_warning(saved, {"layernorm_epsilon": 1e-6}, "d") is None
    assert norm_epsilon_warning({}, {"layernorm_epsilon": 1e-5}, "d") is None  # older writer
    assert norm_epsilon_warning(None, {"layernorm_epsilon": 1e-5}, "d") is None
    text = norm_epsilon_warning(saved, {"layernorm_epsilon": 1e-5, "finetune": True}, "d/i")
    assert text == ("WARNING: --layernorm-epsilon 1e-05 differs from the checkpoint's 1e-06 "
                    "(d/i), which its norms were trained with (Megatron-LM does not check); "
                    "continuing is allowed, to keep the checkpoint's value pass "
                    "--layernorm-epsilon 1e-06, or leave the flag out and pass "
                    "--use-checkpoint-args")


def test_resume_with_another_norm_epsilon_warns_also_in_dry_run(tmp_path, capsys):
    save_run(tmp_path)
    capsys.readouterr()
    resume = ["--seq-length", "16", "--train-iters", "3", "--load", str(tmp_path)]
    tr = run_pretrain(resume + ["--layernorm-epsilon", "1e-6"])
    assert tr.state.iteration == 3
    out = capsys.readouterr().out
    assert out.count("WARNING: --layernorm-epsilon 1e-06 differs from the checkpoint's "
                     "1e-05") == 1, out
    assert run_dry_run(config(resume + ["--layernorm-epsilon", "1e-6"]), 1) == 0
    out = capsys.readouterr().out
    assert "WARNING: --layernorm-epsilon 1e-06 differs" in out, out
    assert "  model:" in out and "layernorm epsilon 1e-06" in out  # the flag's name there too
    assert run_dry_run(config(resume), 1) == 0  # the checkpoint's value: silent
    assert "--layernorm-epsilon" not in capsys.readouterr().out


MOCK = {"mock_data": True, "seed": 1234, "data_path": None, "train_data_path": None,
        "dataloader_type": "single", "train_iters": 10, "train_samples": None,
        "global_batch_size": 4, "micro_batch_size": 2, "data_parallel_size": 1,
        "consumed_train_samples": 8}


def test_mock_data_warning_text():
    # the premise: another seed draws other samples at every index
    one, other = (MockGPTDataset(100, 8, seed) for seed in (1234, 7))
    assert all(one[i]["text"].tolist() != other[i]["text"].tolist() for i in range(8))
    run = {**MOCK, "finetune": False, "skip_train": False}
    assert data_order_warning(MOCK, run, "w") is None
    assert data_order_warning(MOCK, {**run, "train_iters": 20}, "w") is None  # single loader
    assert data_order_warning(MOCK, {**run, "seed": 7, "finetune": True}, "w") is None
    assert data_order_warning(MOCK, {**run, "seed": 7, "skip_train": True}, "w") is None
    assert data_order_warning({**MOCK, "mock_data": False}, {**run, "seed": 7}, "w") is None
    seed = data_order_warning(MOCK, {**run, "seed": 7}, "w/iter_0000002")
    assert seed == ("WARNING: --seed 7 differs from the checkpoint's 1234 (w/iter_0000002): "
                    "--mock-data gives other samples from here on than the run that saved the "
                    "checkpoint would have read (Megatron-LM does not check); continuing is "
                    "allowed, to resume them rerun with the checkpoint's values")
    cyclic = {**MOCK, "dataloader_type": "cyclic"}
    assert data_order_warning(cyclic, {**run, "dataloader_type": "cyclic"}, "w") is None
    epoch = data_order_warning(cyclic, {**run, "dataloader_type": "cyclic", "train_iters": 20},
                               "w")
    assert epoch.startswith("WARNING: the cyclic loader's epoch of 80 train samples differs "
                            "from the checkpoint's 40 (--train-iters x --global-batch-size, "
                            "or --train-samples) (w): --mock-data gives other samples"), epoch


def _next_global_batch(total: int, consumed: int, dp: int) -> list:
    """The samples of the cyclic loader's next global batch (micro-batch 2) at `dp`."""
    return sum((next(iter(CyclicSampler(total, consumed, 2, r, dp))) for r in range(dp)), [])


def test_mock_data_with_the_cyclic_loader_at_another_dp_size_warns():
    """The cyclic loader permutes each data-parallel rank's bucket of the mock set as of a
    real one, so the resume reads other samples at another size (was silent for
    --mock-data, warned for --data-path); the wording is the real data's."""
    assert _next_global_batch(40, 8, 1) != _next_global_batch(40, 8, 2)  # the premise
    saved = {**MOCK, "dataloader_type": "cyclic", "data_parallel_size": 2,
             "data_sharding": True}
    run = {**saved, "finetune": False, "skip_train": False}
    assert data_order_warning(saved, run, "w") is None
    text = data_order_warning(saved, {**run, "data_parallel_size": 1}, "w/i")
    assert text == ("WARNING: the data-parallel size 1 differs from the checkpoint's 2 under "
                    "--dataloader-type cyclic (each data-parallel rank permutes its own share "
                    "of the set) (w/i): the epoch in progress is read in another order, so "
                    "some of the 8 consumed so far will come again and others never; "
                    "--mock-data gives other samples from here on than the run that saved "
                    "the checkpoint would have read (Megatron-LM does not check); continuing "
                    "is allowed, to resume them rerun with the checkpoint's values")
    unsharded = {**run, "data_parallel_size": 1, "data_sharding": False}
    assert data_order_warning({**saved, "data_sharding": False}, unsharded, "w") is None
    kind = data_order_warning(saved, {**run, "dataloader_type": "single"}, "w")
    assert kind.startswith("WARNING: --dataloader-type single differs from the checkpoint's "
                           "cyclic (w): the training samples are read in another order"), kind


def test_resume_of_mock_data_with_another_seed_warns_also_in_dry_run(tmp_path, capsys):
    save_run(tmp_path)
    capsys.readouterr()
    resume = ["--seq-length", "16", "--train-iters", "3", "--load", str(tmp_path)]
    assert run_pretrain(resume + ["--seed", "99"]).state.iteration == 3
    out = capsys.readouterr().out
    assert out.count("WARNING: --seed 99 differs from the checkpoint's 1234") == 1, out
    assert "--mock-data gives other samples" in out
    assert run_dry_run(config(resume + ["--seed", "99"]), 1) == 0
    assert "WARNING: --seed 99 differs" in capsys.readouterr().out
    assert run_dry_run(config(resume), 1) == 0
    assert "differs from the checkpoint" not in capsys.readouterr().out


def test_train_data_path_with_another_seed_warns():
    """--train-data-path is shuffled with --seed as --data-path is (was silent)."""
    saved = {"seed": 1234, "data_path": None, "train_data_path": ["t"], "mock_data": False,
             "split": "969, 30, 1", "consumed_train_samples": 40}
    run = {**saved, "finetune": False}
    assert data_order_warning(saved, run, "w") is None
    assert data_order_warning(saved, {**run, "split": "90,5,5"}, "w") is None  # not read
    text = data_order_warning(saved, {**run, "seed": 7}, "w")
    assert text.startswith("WARNING: --seed 7 differs from the checkpoint's 1234 (w): the "
                           "samples are shuffled in another order, so some of the 40 consumed "
                           "so far will come again and others never"), text
