"""The CLI layer's validation (messages that name the values and the fix, the rules Megatron
applies with a warning), the padded vocabulary size, and the config dataclasses built from
the flags."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from megatron.arguments import (
    ArgumentsError,
    pad_vocab_size,
    parse_and_validate,
    parse_args,
    validate_args,
)
from tests.args_helpers import BASE, error_of, run, without

GPT2_VOCAB = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gpt2",
                          "gpt2-vocab.json")


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize("extra, world, parts", [
    ("--tensor-model-parallel-size 4", 6, ["world size 6", "--tensor-model-parallel-size 4",
                                           "multiple of 4"]),
    ("--num-attention-heads 6 --hidden-size 48 --tensor-model-parallel-size 4", 4,
     ["--num-attention-heads 6", "--tensor-model-parallel-size 4"]),
    ("--global-batch-size 10 --micro-batch-size 4", 1,
     ["--global-batch-size 10", "--micro-batch-size 4", "multiple of 4"]),
    ("--global-batch-size 6", 2, ["--global-batch-size 6", "data-parallel size 2", "= 4"]),
    ("--seq-length 64", 1, ["--seq-length 64", "--max-position-embeddings 32", "at least 64"]),
    ("--hidden-size 66", 1, ["--hidden-size 66", "--num-attention-heads 4", "--kv-channels"]),
    ("--fp16 --bf16", 1, ["--fp16 and --bf16 are exclusive"]),
    ("--save /tmp/ckpt", 1, ["--save /tmp/ckpt needs --save-interval"]),
    ("--min-lr 0.1", 1, ["--min-lr 0.1", "--lr 0.001"]),
    ("--train-samples 100", 1, ["--train-iters 10 and --train-samples 100 are exclusive"]),
    ("--lr-decay-samples 50", 1, ["--lr-decay-samples 50", "iteration-based"]),
    ("--lr-warmup-samples 5", 1, ["--lr-warmup-samples 5", "iteration-based"]),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", 1, [
        "--lr-warmup-fraction 0.1 and --lr-warmup-iters 2",
        "with --lr-warmup-fraction set, --lr-warmup-iters must be 0"]),
    ("--seed 0", 1, ["--seed 0 must be > 0"]),
    ("--lr-warmup-iters 10", 1, ["--lr-warmup-iters 10 is not shorter than the 10 iterations",
                                 "(--train-iters 10)"]),
    ("--group-query-attention --num-query-groups 3", 1, ["--num-attention-heads 4",
                                                          "--num-query-groups 3"]),
    ("--group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4", 4,
     ["--num-query-groups 2", "--tensor-model-parallel-size 4", "use --num-query-groups 4 (a "
      "multiple of 4 that divides --num-attention-heads 4)"]),
    ("--group-query-attention --tensor-model-parallel-size 2", 2,
     ["--num-query-groups 1 (the default with --group-query-attention) is not divisible by "
      "--tensor-model-parallel-size 2", "use --num-query-groups 2"]),
    ("--DDP-impl torch --pipeline-model-parallel-size 2", 2,
     ["--pipeline-model-parallel-size 2 needs --DDP-impl local", "drop --DDP-impl torch"]),
    ("--num-query-groups 2", 1, ["--num-query-groups 2 needs --group-query-attention"]),
    ("--bf16 --DDP-impl torch", 1, ["--DDP-impl local (got torch)"]),
    ("--fp16-lm-cross-entropy", 1, ["--fp16-lm-cross-entropy needs --fp16"]),
    ("--weight-decay-incr-style linear", 1, ["needs both --start-weight-decay"]),
    ("--mock-data --data-path x", 1, ["--mock-data and --data-path"]),
    ("--valid-data-path v", 1, ["--mock-data and --valid-data-path are exclusive",
                                "drop --valid-data-path"]),
    ("--test-data-path t --valid-data-path v", 1, [
        "--mock-data and --valid-data-path/--test-data-path are exclusive"]),
])
def test_validation_errors_name_values_and_fix(extra, world, parts):
    msg = error_of(extra, world_size=world)
    for part in parts:
        assert part in msg, (part, msg)


def test_missing_required_flags_listed_together():
    base = [a for a in without("--lr", without("--hidden-size", without("--train-iters")))]
    msg = error_of(base=base)
    assert "--hidden-size" in msg and "--lr" in msg and "--train-iters or --train-samples" in msg
    assert run("--skip-train", base=without("--train-iters")).training.skip_train


def test_errors_name_the_alias_the_user_gave():
    """--encoder-seq-length / --encoder-num-layers (Megatron-LM 23.05's other names of
    --seq-length / --num-layers) were reported as --seq-length / --num-layers, a flag the
    command line does not have."""
    seq = without("--seq-length")
    assert error_of("--encoder-seq-length 64", base=seq) == (
        "--encoder-seq-length 64 is larger than --max-position-embeddings 32; raise "
        "--max-position-embeddings to at least 64")
    assert error_of("--encoder-seq-length 0", base=seq) == "--encoder-seq-length 0 must be > 0"
    message = error_of("--encoder-seq-length 31 --sequence-parallel "
                       "--tensor-model-parallel-size 2", world_size=2, base=seq)
    assert message.startswith("--encoder-seq-length 31 is not divisible by "
                              "--tensor-model-parallel-size 2"), message
    assert "use a --encoder-seq-length that is a multiple of 2 (e.g. 30 or 32)" in message
    layers = without("--num-layers")
    message = error_of("--encoder-num-layers 3 --pipeline-model-parallel-size 2", world_size=2,
                       base=layers)
    assert message.startswith("--encoder-num-layers 3 is not divisible by "
                              "--pipeline-model-parallel-size 2"), message
    assert "use --encoder-num-layers e.g. 2 or 4" in message
    assert error_of("--seq-length 64").startswith("--seq-length 64 is larger than")
    assert run("--encoder-seq-length 16", base=seq).args["seq_length"] == 16


def test_sample_based_rules():
    base = without("--train-iters")
    assert "--lr-warmup-iters 2" in error_of("--train-samples 100 --lr-warmup-iters 2", base=base)
    assert "--lr-decay-iters 5" in error_of("--train-samples 100 --lr-decay-iters 5", base=base)


def test_layers_divisible_by_pipeline_size():
    ns, explicit = parse_args(BASE + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ArgumentsError, match="--num-layers 3 is not divisible by "
                                             "--pipeline-model-parallel-size 2"):
        validate_args(ns, 2, explicit=explicit)


@pytest.mark.parametrize("extra, world, parts", [
    ("--num-layers 6 --pipeline-model-parallel-size 4", 4,
     ["--num-layers 6 is not divisible by --pipeline-model-parallel-size 4",
      "use --num-layers e.g. 4 or 8, or --pipeline-model-parallel-size 3"]),
    # the stage count without layers is not a size the user typed: say where it comes from
    ("--num-layers 4 --pipeline-model-parallel-size 4 --standalone-embedding-stage", 4,
     ["--num-layers 4 is not divisible by the 3 pipeline stages that hold layers "
      "(--pipeline-model-parallel-size 4 less the first",
      "use --num-layers e.g. 3 or 6, or --pipeline-model-parallel-size 3"]),
])
def test_uneven_layer_split_names_the_stages_and_the_fix(extra, world, parts):
    msg = error_of(extra, world_size=world, base=without("--num-layers"))
    for part in parts:
        assert part in msg, (part, msg)
    assert "--pipeline-model-parallel-size 3;" not in msg


@pytest.mark.parametrize("value", ["0", "-1"])
def test_layers_per_virtual_stage_below_one_is_named_as_such(value):
    """Not 'must divide the 2 layers of each pipeline stage': no count below 1 is a stage."""
    msg = error_of(f"--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage "
                   f"{value} --num-layers 4 --global-batch-size 8", world_size=2,
                   base=without("--num-layers"))
    assert msg == (f"--num-layers-per-virtual-pipeline-stage {value} must be >= 1 (transformer "
                   "layers in each virtual pipeline stage)")


@pytest.mark.parametrize("extra, world, fix", [
    ("--num-attention-heads 12 --hidden-size 48 --tensor-model-parallel-size 8 --num-layers 2", 8,
     "use --tensor-model-parallel-size 1 or 2 or 4 (dividing both 12 and the world size 8), "
     "or a --num-attention-heads that is a multiple of 8"),
    ("--num-attention-heads 6 --hidden-size 48 --tensor-model-parallel-size 4 "
     "--pipeline-model-parallel-size 2 --num-layers 2", 8,
     "use --tensor-model-parallel-size 1 or 2 (dividing both 6 and world size 8 / "
     "--pipeline-model-parallel-size 2 = 4), or a --num-attention-heads that is a multiple of 4"),
])
def test_heads_not_divisible_by_tp_names_the_tp_sizes_that_fit(extra, world, fix):
    """'use a tp size that divides 12' let a user pick 6 or 12, which the world size of 8
    refuses next: the sizes listed divide the heads and a pipeline stage's processes."""
    msg = error_of(extra, world_size=world, base=without("--num-layers"))
    heads, tp = extra.split()[1], extra.split()[5]
    assert msg == (f"--num-attention-heads {heads} is not divisible by "
                   f"--tensor-model-parallel-size {tp}; {fix}")
    first = fix.split()[2]
    assert run(extra.replace(f"--tensor-model-parallel-size {tp}",
                             f"--tensor-model-parallel-size {first}"),
               world_size=world, base=without("--num-layers"))


@pytest.mark.parametrize("layers, pp, per_vstage, fix", [
    (8, 2, 3, "; use --num-layers-per-virtual-pipeline-stage 1 or 2, or use --num-layers 12 "
              "(two virtual stages of 3 per pipeline rank)"),
    (4, 4, 2, "; a stage of 1 layer cannot be interleaved: drop "
              "--num-layers-per-virtual-pipeline-stage, or use --num-layers 16 (two virtual "
              "stages of 2 per pipeline rank)"),
])
def test_virtual_stage_that_misses_the_stage_names_sizes_that_fit(layers, pp, per_vstage, fix):
    """The refusal lists the virtual stage sizes that divide a stage's layers (a stage of
    one layer has none) and the --num-layers that the given size fits; it gave no fix."""
    msg = error_of(f"--pipeline-model-parallel-size {pp} --num-layers {layers} "
                   f"--num-layers-per-virtual-pipeline-stage {per_vstage} --global-batch-size 8",
                   world_size=pp, base=without("--num-layers"))
    per_stage = layers // pp
    assert msg == (f"--num-layers-per-virtual-pipeline-stage {per_vstage} must divide the "
                   f"{per_stage} layer{'s' if per_stage > 1 else ''} of each pipeline stage "
                   f"(--num-layers {layers} / --pipeline-model-parallel-size {pp}){fix}")
    fixed = fix.split("use --num-layers ")[1].split()[0]
    cfg = run(f"--pipeline-model-parallel-size {pp} --num-layers {fixed} "
              f"--num-layers-per-virtual-pipeline-stage {per_vstage} --global-batch-size 8",
              world_size=pp, base=without("--num-layers"))
    assert cfg.parallel.virtual_pp_size == 2


def test_interleaved_schedule_needs_micro_batches_a_multiple_of_pp():
    """Megatron's interleaved schedule raises a RuntimeError mid-run when the micro-batch
    count is not a multiple of the pipeline size: refused at startup with the count, how it
    came about and a global batch size that works; a multiple is accepted."""
    flags = ("--pipeline-model-parallel-size 4 --num-layers 8 "
             "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size {}")
    msg = error_of(flags.format(12), world_size=4, base=without("--num-layers"))
    assert msg == ("the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs the "
                   "number of micro-batches (6 = --global-batch-size 12 / (--micro-batch-size 2 "
                   "x data-parallel size 1)) to be a multiple of --pipeline-model-parallel-size "
                   "4; use a global batch size that is a multiple of 8")
    # no --global-batch-size given: its default is named as one, not as the user's value
    msg = error_of("--pipeline-model-parallel-size 4 --num-layers 8 "
                   "--num-layers-per-virtual-pipeline-stage 1", world_size=8,
                   base=without("--num-layers"))
    assert msg == ("the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs the "
                   "number of micro-batches (1 = --global-batch-size (default: --micro-batch-size "
                   "2 x data-parallel size 2 = 4) / (--micro-batch-size 2 x data-parallel size "
                   "2)) to be a multiple of --pipeline-model-parallel-size 4; pass a "
                   "--global-batch-size that is a multiple of 16")
    cfg = run(flags.format(16), world_size=4, base=without("--num-layers"))
    assert (cfg.parallel.virtual_pp_size, cfg.data.num_micro_batches) == (2, 8)


def test_one_virtual_stage_per_rank_needs_no_multiple_of_pp_micro_batches(caplog):
    """--num-layers-per-virtual-pipeline-stage equal to the layers of a stage runs the plain
    1F1B schedule (warned), which takes any micro-batch count: it was refused with the
    interleaved schedule's multiple-of-pp rule, and once the batch was changed to satisfy
    that, the run said it would not interleave after all."""
    cfg = run("--pipeline-model-parallel-size 4 --num-layers 4 "
              "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4",
              world_size=4, base=without("--num-layers"))
    assert (cfg.parallel.virtual_pp_size, cfg.data.num_micro_batches) == (None, 2)
    assert "one virtual stage per rank, using the non-interleaved 1F1B" in caplog.text


def test_recompute_num_layers_megatron_cannot_run_with(caplog):
    """Megatron-LM's uniform recompute loops over groups of --recompute-num-layers layers and
    never ends below 1: refused. Block with N <= 0 recomputes no layer there (and here),
    although the run asked for full recompute: warned. A count that does not divide the
    layers of a stage is valid here (see MIGRATING.md)."""
    full = "--recompute-granularity full --recompute-method"
    for n in ("0", "-2"):
        msg = error_of(f"{full} uniform --recompute-num-layers {n}")
        assert (f"--recompute-num-layers {n} must be >= 1 with --recompute-method uniform"
                in msg and "pass 1 or leave the flag out" in msg)
        run(f"{full} block --recompute-num-layers {n}")
        assert (f"--recompute-method block --recompute-num-layers {n} recomputes no layer"
                in caplog.text)
        caplog.clear()
    for method in ("uniform", "block"):  # 3 of the 2 layers of each stage
        run(f"{full} {method} --recompute-num-layers 3 --pipeline-model-parallel-size 2 "
            "--num-layers 4", world_size=2, base=without("--num-layers"))
    assert "recomputes no layer" not in caplog.text


def test_sequence_parallel_needs_a_sequence_tp_divides():
    """Each tensor-parallel rank holds seq_length / tp positions under --sequence-parallel:
    an odd split is refused before start-up (it was a ValueError traceback from every rank
    at the first forward)."""
    msg = error_of("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 31",
                   world_size=2)
    assert ("--seq-length 31 is not divisible by --tensor-model-parallel-size 2" in msg
            and "(e.g. 30 or 32) or drop --sequence-parallel" in msg)
    assert run("--tensor-model-parallel-size 2 --seq-length 31", world_size=2)  # no sp
    assert run("--tensor-model-parallel-size 2 --sequence-parallel --seq-length 30",
               world_size=2).model.sequence_parallel


def test_ffn_size_divisible_by_tensor_parallel_size():
    """--ffn-hidden-size 333 with tp 2 (dense or --num-experts) is refused at validation,
    not by a bare "333 is not divisible by 2" from every rank's model build."""
    for extra in ("", " --num-experts 4"):
        msg = error_of("--ffn-hidden-size 333 --tensor-model-parallel-size 2" + extra,
                       world_size=2)
        assert ("--ffn-hidden-size 333 is not divisible by --tensor-model-parallel-size 2"
                in msg and "(e.g. 332 or 334)" in msg)
    assert run("--ffn-hidden-size 334 --tensor-model-parallel-size 2", world_size=2)
    # an ffn size below tp: the suggestion is a size the split can use, not 0
    assert "(e.g. 3)" in error_of("--ffn-hidden-size 2 --tensor-model-parallel-size 3 "
                                  "--num-attention-heads 3 --hidden-size 48", world_size=3)


@pytest.mark.parametrize("extra, derived, sizes", [
    ("--hidden-size 48 --num-attention-heads 6 --swiglu",
     "128 (--swiglu's int(4 x --hidden-size 48 x 2/3 / 64) x 64; no --ffn-hidden-size given)",
     "(e.g. 126 or 129)"),
    ("--hidden-size 40 --num-attention-heads 6 --kv-channels 8",
     "160 (4 x --hidden-size 40; no --ffn-hidden-size given)", "(e.g. 159 or 162)"),
])
def test_derived_ffn_size_that_tp_cannot_split_is_named_as_derived(extra, derived, sizes):
    """Without --ffn-hidden-size the width comes from --hidden-size (or --swiglu's rule):
    the message says so instead of naming a --ffn-hidden-size the user never typed, and
    the fix is to pass one."""
    msg = error_of(extra + " --tensor-model-parallel-size 3", world_size=3)
    assert f"the MLP width {derived} is not divisible by --tensor-model-parallel-size 3" in msg
    assert f"pass --ffn-hidden-size with a multiple of 3 {sizes}" in msg
    assert "--ffn-hidden-size 1" not in msg
    assert run(extra + " --tensor-model-parallel-size 3 --ffn-hidden-size 126", world_size=3)


def test_swiglu_rule_that_gives_an_empty_mlp_is_refused():
    """--swiglu's int(4 x hidden x 2/3 / 64) x 64 is 0 below --hidden-size 24: the run
    crashed in the backward pass with a reshape error; now validation names the rule and
    the fix, and a given --ffn-hidden-size runs."""
    msg = error_of("--hidden-size 16 --num-attention-heads 2 --swiglu")
    assert ("the MLP width 0 (--swiglu's int(4 x --hidden-size 16 x 2/3 / 64) x 64; no "
            "--ffn-hidden-size given) leaves the MLP empty" in msg), msg
    assert "pass --ffn-hidden-size (e.g. 42)" in msg
    assert run("--hidden-size 16 --num-attention-heads 2 --swiglu --ffn-hidden-size 42")


def test_tp_larger_than_world_is_clamped_with_warning(caplog):
    """Clamped as in Megatron-LM; the warning says how to launch the processes the sizes
    need (a script run with plain python instead of torchrun trains on alone)."""
    assert run("--tensor-model-parallel-size 2", world_size=1).parallel.tp_size == 1
    assert "--tensor-model-parallel-size 2 is larger than the world size 1" in caplog.text
    assert ("the given sizes need 2 processes (or a multiple), this run is a single one: "
            "launch them, e.g. torchrun --nproc-per-node 2 ") in caplog.text
    caplog.clear()
    cfg = run("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", world_size=2)
    assert (cfg.parallel.tp_size, cfg.parallel.pp_size) == (2, 1)
    assert caplog.text.count("the given sizes need") == 1
    assert "need 4 processes (or a multiple): launch them, e.g. torchrun --nproc-per-node 4 " \
        in caplog.text


def test_global_batch_default_and_micro_batches(caplog):
    caplog.set_level(logging.INFO, logger="megatron.arguments")
    cfg = run(world_size=4)
    assert cfg.data.global_batch_size == 8 and cfg.data.num_micro_batches == 1
    assert "setting global batch size to 8" in caplog.text
    cfg = run("--global-batch-size 32", world_size=4)
    assert (cfg.parallel.dp_size, cfg.data.num_micro_batches) == (4, 4)


@pytest.mark.parametrize("extra, lines", [
    ("", ["using torch.float32 for parameters ..."]),
    ("--fp16", ["using torch.float16 for parameters ..."]),
    ("--bf16", ["accumulate and all-reduce gradients in fp32 for bfloat16 data type.",
                "using torch.bfloat16 for parameters ..."]),
])
def test_parameter_dtype_lines_as_megatron_prints_them(caplog, extra, lines):
    caplog.set_level(logging.INFO, logger="megatron.arguments")
    run(extra)
    printed = [r.getMessage() for r in caplog.records]
    assert [m for m in printed if m in lines] == lines


def test_sequence_parallel_with_tp1_is_disabled_with_warning(caplog):
    assert run("--sequence-parallel").model.sequence_parallel is False
    assert "--sequence-parallel needs --tensor-model-parallel-size > 1" in caplog.text
    cfg = run("--sequence-parallel --tensor-model-parallel-size 2", world_size=2)
    assert cfg.parallel.sequence_parallel and cfg.model.sequence_parallel
    assert cfg.model.async_tensor_model_parallel_allreduce is False


def test_no_data_sharding_is_accepted_for_the_cyclic_loader(caplog):
    """Megatron lists --no-data-sharding with the vision flags, but its cyclic GPT loader
    reads it: accepted (it was refused as a vision flag), warned without --dataloader-type
    cyclic, where nothing reads it."""
    cfg = run("--dataloader-type cyclic --no-data-sharding")
    assert cfg.data.data_sharding is False and cfg.data.dataloader_type == "cyclic"
    assert "no-data-sharding" not in caplog.text
    assert run("").data.data_sharding is True
    assert run("--no-data-sharding").data.data_sharding is False
    assert "--no-data-sharding has no effect without --dataloader-type cyclic" in caplog.text


def test_swiglu_ffn_rule_and_user_value_kept(caplog):
    assert run("--swiglu --hidden-size 4096 --num-attention-heads 32").model.ffn_hidden_size == 10880
    cfg = run("--swiglu --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008")
    assert cfg.model.ffn_hidden_size == 11008 and cfg.model.activation == "swiglu"
    assert ("--swiglu with --ffn-hidden-size 11008: the MLP width is this value; Megatron-LM "
            "23.05 ignores the flag under --swiglu and uses 10880" in caplog.text)
    assert "then leave --ffn-hidden-size out" in caplog.text


def test_several_activation_switches_follow_megatrons_mlp_order(caplog):
    """Megatron-LM 23.05's MLP takes the first of --openai-gelu, --swiglu, --squared-relu;
    --swiglu with --openai-gelu builds a double-width fc1 for a GeLU and fails there."""
    assert run("--squared-relu --openai-gelu").model.activation == "openai_gelu"
    assert "--openai-gelu and --squared-relu given; --openai-gelu wins" in caplog.text
    assert run("--squared-relu --swiglu").model.activation == "swiglu"
    assert "--swiglu and --squared-relu given; --swiglu wins" in caplog.text
    msg = error_of("--swiglu --openai-gelu")
    assert "--swiglu and --openai-gelu are exclusive" in msg and "pass one" in msg
    from megatron.checkpoint_files import complete_saved_args  # a Megatron checkpoint's args

    saved = {"openai_gelu": True, "squared_relu": True, "swiglu": False}
    assert complete_saved_args(saved)["activation"] == "openai_gelu"


def test_bf16_forces_fp32_grad_accumulation():
    cfg = run("--bf16")
    assert cfg.parallel.accumulate_allreduce_grads_in_fp32 and cfg.model.params_dtype == torch.bfloat16
    assert cfg.args["params_dtype"] == "torch.bfloat16"


def test_megatron_notes_go_to_stdout_and_warnings_to_stderr():
    """Megatron prints its start-up lines on stdout (rank 0): the layout, the derived
    global batch, the micro-batches, the parameter dtype, the padded vocabulary. They
    went to stderr with the warnings, so `torchrun ... | tee run.log` (or a log parser
    reading stdout) lost the layout line. Run in a fresh interpreter: under pytest its
    logging handlers take the messages."""
    import subprocess
    import sys

    code = ("from megatron.arguments import parse_and_validate\n"
            f"parse_and_validate({BASE + ['--sequence-parallel']!r}, world_size=4, "
            "env={'RANK': '0'}, cuda_available=False)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
    assert done.returncode == 0, done.stderr
    notes = ["using world size: 4, data-parallel-size: 4, tensor-model-parallel size: 1, "
             "pipeline-model-parallel size: 1 ", "setting global batch size to 8",
             "setting number of micro-batches to constant 1",
             "using torch.float32 for parameters ...",
             " > padded vocab (size: 101) with 27 dummy tokens (new size: 128)"]
    for note in notes:
        assert note in done.stdout and note not in done.stderr, (note, done.stdout)
    assert "WARNING: --sequence-parallel needs" in done.stderr, done.stderr
    assert "WARNING" not in done.stdout, done.stdout


def test_warnings_only_on_rank_zero(capsys):
    parse_and_validate(BASE + ["--sequence-parallel"], 1, env={"RANK": "1"}, cuda_available=False)
    assert "sequence-parallel" not in capsys.readouterr().err


# ---------------------------------------------------------------------------- vocab


@pytest.mark.parametrize("tp, padded", [(1, 50304), (2, 50432), (4, 50688), (8, 51200)])
def test_pad_vocab_size_megatron_examples(tp, padded):
    assert pad_vocab_size(50257, 128, tp) == padded


def test_vocab_sizes_from_tokenizers(tmp_path):
    assert run().model.padded_vocab_size == 128  # NullTokenizer 100 -> 101 -> 128
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(300)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    base = without("--vocab-size", without("--tokenizer-type")) + [
        "--merge-file", str(tmp_path / "merges.txt")]
    assert run(f"--vocab-file {vocab}", base=base).model.padded_vocab_size == 384
    assert f"--vocab-file {tmp_path}/nope.json: file not found" in error_of(
        f"--vocab-file {tmp_path}/nope.json", base=base)
    assert "needs --vocab-file" in error_of(base=base)
    (tmp_path / "spm.model").write_bytes(b"")
    assert run(f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {tmp_path}/spm.model",
               base=without("--tokenizer-type"),
               vocab_size_fn=lambda a: 1000).model.padded_vocab_size == 1024


@pytest.mark.skipif(not os.path.isfile(GPT2_VOCAB), reason="needs ../shared/data/gpt2")
def test_gpt2_vocab_file_pads_to_50304():
    base = without("--vocab-size", without("--tokenizer-type"))
    merges = os.path.join(os.path.dirname(GPT2_VOCAB), "gpt2-merges.txt")
    assert run(f"--vocab-file {GPT2_VOCAB} --merge-file {merges}",
               base=base).model.padded_vocab_size == 50304


# ------------------------------------------------------------------------- config build


def test_model_config_mapping():
    m = run().model  # biases + the default GeLU: Megatron-LM's fused bias-GeLU (tanh form)
    assert (m.position_embedding_type, m.activation, m.add_bias_linear) == (
        "learned_absolute", "openai_gelu", True)
    assert run("--no-bias-gelu-fusion").model.activation == "gelu"  # torch's erf GeLU
    assert run("--disable-bias-linear").model.activation == "gelu"
    assert m.params_dtype == torch.float32 and m.apply_query_key_layer_scaling
    m = run("--use-rotary-position-embeddings --no-position-embedding --disable-bias-linear "
            "--squared-relu --fp16 --no-query-key-layer-scaling --normalization RMSNorm "
            "--group-query-attention --num-query-groups 2 --rotary-base 500000").model
    assert (m.position_embedding_type, m.activation, m.add_bias_linear) == (
        "rope", "squared_relu", False)
    assert m.params_dtype == torch.float16 and not m.apply_query_key_layer_scaling
    assert (m.normalization, m.num_query_groups, m.rotary_base) == ("RMSNorm", 2, 500000.0)
    assert run("--no-position-embedding").model.position_embedding_type == "none"
    assert run("--position-embedding-type rope").model.position_embedding_type == "rope"
    assert run("--openai-gelu").model.activation == "openai_gelu"


def test_schedule_lengths_in_samples():
    o = run("--global-batch-size 8 --lr-decay-iters 6 --lr-warmup-iters 2").optimizer
    assert (o.lr_warmup_steps, o.lr_decay_steps, o.wd_incr_steps) == (16, 48, 80)
    o = run("--global-batch-size 8 --lr-warmup-fraction 0.25").optimizer
    assert (o.lr_warmup_steps, o.lr_decay_steps) == (20, 80)
    cfg = run("--global-batch-size 8 --train-samples 100 --lr-warmup-samples 10",
              base=without("--train-iters"))
    o = cfg.optimizer
    assert (o.lr_warmup_steps, o.lr_decay_steps, o.wd_incr_steps) == (10, 100, 100)
    assert cfg.training.train_iters == 12 and cfg.training.train_samples == 100


def test_parallel_logging_checkpoint_mapping():
    cfg = run("--tensor-model-parallel-size 2 --global-batch-size 16 --overlap-grad-reduce "
              "--ddp-bucket-size 1000 --log-timers-to-tensorboard --no-load-optim "
              "--tensorboard-dir tb --timing-log-level 2", world_size=8)
    p = cfg.parallel
    assert (p.tp_size, p.pp_size, p.dp_size, p.world_size) == (2, 1, 4, 8)
    assert p.overlap_grad_reduce and p.ddp_bucket_size == 1000
    assert cfg.data.num_micro_batches == 2
    assert cfg.logging.log_timers_to_tensorboard and cfg.logging.timing_log_level == 2
    assert cfg.logging.tensorboard_dir == "tb"
    assert cfg.checkpoint.no_load_optim is True and cfg.checkpoint.no_save_optim is False


def test_args_are_plain_json_data():
    args = run("--bf16").args
    assert json.loads(json.dumps(args)) == args
    assert args["dry_run"] is False and args["padded_vocab_size"] == 128
    assert run("--dry-run").args["dry_run"] is True


@pytest.mark.parametrize("extra, head, channels", [
    ("--hidden-size 60 --num-attention-heads 12 --position-embedding-type rope",
     "the head size 5 (--hidden-size 60 / --num-attention-heads 12)", "6 channels of a 5"),
    ("--kv-channels 7 --use-rotary-position-embeddings --rotary-percent 1.5",
     "--kv-channels 7", "8 channels of a 7"),
])
def test_rotary_over_an_odd_whole_head_is_refused(extra, head, channels):
    """An odd head rotated whole turns one channel more than it has: the first forward pass
    failed with a ValueError traceback on every rank after the model was built."""
    msg = error_of(extra)
    assert msg.startswith(f"{head} is odd: rotary embeddings over whole heads"), msg
    assert channels in msg and "a --rotary-percent below 1 (e.g. 0.5)" in msg, msg
    assert run(extra.replace("--rotary-percent 1.5", "") + " --rotary-percent 0.5")
    assert run(extra.replace("--use-rotary-position-embeddings", "")
               .replace("--position-embedding-type rope", "").replace("--rotary-percent 1.5", ""))


def test_rotary_percent_that_turns_no_channel_is_warned(caplog):
    """int(16 x 0.05) = 0: the rotary embeddings turn nothing, the model sees no position."""
    with caplog.at_level(logging.WARNING):
        run("--position-embedding-type rope --rotary-percent 0.05")
    assert ("--rotary-percent 0.05 of the head size 16 (--hidden-size 64 / "
            "--num-attention-heads 4) is 0.8 channels, int() makes 0: the rotary embeddings "
            "turn no channel and the model sees no positions; use a --rotary-percent of at "
            "least 0.125") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run("--position-embedding-type rope --rotary-percent 0.125")
    assert "turn no channel" not in caplog.text
