"""The CLI layer: Megatron-LM 23.05 flag compatibility, deprecated and rejected flags, YAML
configs, validation messages, derived config values, dry-run parameter counts."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from megatron.arguments import (
    ArgumentsError,
    apply_deprecated,
    build_parser,
    check_not_supported,
    count_parameters,
    dry_run_report,
    format_args_dump,
    pad_vocab_size,
    parse_and_validate,
    parse_args,
    run_dry_run,
    validate_args,
)
from megatron.arguments_common import FLAG_SPECS
from megatron.arguments_table import (
    ALLOWED_IN_REJECTED_GROUPS,
    MEGATRON_GROUPS,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
    REMOVED,
)
from megatron.config import ModelConfig

ARGS_JSON = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference",
                         "megatron-23.06-args.json")
GPT2_VOCAB = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gpt2",
                          "gpt2-vocab.json")
MEGATRON_ORDER = ["network size", "regularization", "training", "initialization",
                  "learning rate", "checkpointing", "mixed precision", "distributed",
                  "validation", "data and dataloader", "autoresume", "biencoder", "vision",
                  "logging", "inference", "Transformer-Engine", "retro"]
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 "
        "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data").split()


def run(extra="", world_size=1, base=BASE, **kw):
    argv = list(base) + (extra.split() if isinstance(extra, str) else list(extra))
    kw.setdefault("cuda_available", False)
    return parse_and_validate(argv, world_size=world_size, env={}, **kw)


def error_of(extra="", world_size=1, base=BASE, **kw) -> str:
    with pytest.raises(ArgumentsError) as info:
        run(extra, world_size, base, **kw)
    assert info.value.code == 2
    return info.value.message


def without(flag, base=BASE):
    """BASE minus one flag and its value."""
    out = list(base)
    i = out.index(flag)
    del out[i:i + 2]
    return out


# ------------------------------------------------------------------ flag table / parser


def test_table_has_megatrons_223_flags_in_megatrons_group_order():
    assert [title for title, _ in MEGATRON_GROUPS] == MEGATRON_ORDER
    sizes = {title: len(rows) for title, rows in MEGATRON_GROUPS}
    assert sum(sizes.values()) == 223
    assert (sizes["training"], sizes["data and dataloader"], sizes["vision"],
            sizes["network size"], sizes["distributed"]) == (28, 25, 25, 23, 18)


def test_help_lists_groups_in_megatron_order():
    text = build_parser().format_help()
    assert text.count("Megatron-LM Arguments") == 1
    positions = [text.index(f"\n{title}:\n") for title in MEGATRON_ORDER]
    assert positions == sorted(positions)
    assert text.index("\nextensions (not in Megatron-LM 23.05):\n") > positions[-1]


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0 and "--tensor-model-parallel-size" in capsys.readouterr().out


def test_sample_of_defaults_matches_megatron():
    ns, _ = parse_args([])
    expected = {
        "split": "969, 30, 1", "initial_loss_scale": 4294967296, "loss_scale_window": 1000,
        "lr_warmup_iters": 0, "log_learning_rate_to_tensorboard": True, "DDP_impl": "local",
        "no_save_optim": None, "use_cpu_initialization": None, "seed": 1234,
        "make_vocab_size_divisible_by": 128, "retriever_report_topk_accuracies": [],
        "distributed_backend": "nccl", "barrier_with_L1_time": True, "data_impl": "infer",
        "apply_query_key_layer_scaling": True, "async_tensor_model_parallel_allreduce": True,
        "gradient_accumulation_fusion": True, "tokenizer_type": None, "onnx_safe": None,
        "adam_beta2": 0.999, "clip_grad": 1.0, "eval_iters": 100, "eval_interval": 1000,
        "log_interval": 100, "timing_log_option": "minmax", "dataloader_type": None,
    }
    assert {k: getattr(ns, k) for k in expected} == expected
    assert type(ns.initial_loss_scale) is int


def _json_flags():
    if not os.path.isfile(ARGS_JSON):
        pytest.skip("needs ../shared/reference/megatron-23.06-args.json")
    with open(ARGS_JSON) as f:
        return json.load(f)


def test_every_flag_matches_megatron_json():
    flags = _json_flags()
    actions = {opt: a for a in build_parser()._actions for opt in a.option_strings}
    ns, _ = parse_args([])
    assert len(flags) == 223
    for row in flags:
        flag = row["flag"]
        action, spec = actions[flag], FLAG_SPECS[flag]
        assert (action.dest, spec.group) == (row["dest"], row["group"]), flag
        assert spec.default == row["default"] and type(spec.default) is type(row["default"]), flag
        assert action.nargs == (0 if row["action"] else row["nargs"]), flag
        assert action.choices == row["choices"], flag
        if row["action"]:
            assert type(action).__name__ == {"store_true": "_StoreTrueAction",
                                             "store_false": "_StoreFalseAction"}[row["action"]]
        elif flag != "--warmup":  # documented: int or float (old fraction semantics)
            assert getattr(action.type, "__name__", None) == row["argparse_type"], flag
        if flag not in ("--no-async-tensor-model-parallel-allreduce",
                        "--no-gradient-accumulation-fusion"):
            assert getattr(ns, row["dest"]) == row["default"], flag


def test_odd_spellings_and_no_abbreviations():
    cfg = run("--local_rank 3 --DDP-impl torch --override-opt_param-scheduler "
              "--no-log-learnig-rate-to-tensorboard --no-barrier-with-level-1-timing")
    assert cfg.args["local_rank"] == 3 and cfg.parallel.ddp_impl == "torch"
    assert cfg.optimizer.override_opt_param_scheduler
    assert cfg.logging.log_learning_rate_to_tensorboard is False
    assert cfg.args["barrier_with_L1_time"] is False
    msg = error_of("--num-lay 3")
    assert "unrecognized arguments: --num-lay" in msg and "--num-layers" in msg


def test_local_rank_as_torch_distributed_launch_passes_it():
    """torch >= 2.0's `python -m torch.distributed.launch` (Megatron-LM's example scripts)
    appends --local-rank=N: the same flag as --local_rank."""
    assert run("--local-rank=2").args["local_rank"] == 2
    assert run("--local_rank=1").args["local_rank"] == 1


def test_user_errors_exit_2_and_print_error(capsys):
    with pytest.raises(SystemExit) as info:
        run("--seed 0")
    assert info.value.code == 2
    assert "error: --seed 0 must be > 0" in capsys.readouterr().err


# -------------------------------------------------------------------- deprecated flags


@pytest.mark.parametrize("extra, field, value, text", [
    ("--model-parallel-size 2", "tensor_model_parallel_size", 2, "--tensor-model-parallel-size"),
    ("--batch-size 1", "micro_batch_size", 1, "--micro-batch-size"),
    ("--warmup 0.2", "lr_warmup_fraction", 0.2, "--lr-warmup-fraction"),
    ("--warmup 3", "lr_warmup_iters", 3, "--lr-warmup-iters"),
])
def test_deprecated_flags_map_with_a_warning(caplog, extra, field, value, text):
    base = without(text) if text in BASE else BASE
    cfg = run(extra, world_size=2, base=base)
    assert cfg.args[field] == value
    assert f"is deprecated; using {text} {value}" in caplog.text
    for gone in ("model_parallel_size", "batch_size", "warmup", "checkpoint_activations"):
        assert gone not in cfg.args


def test_deprecated_warmup_sets_schedule_in_samples():
    assert run("--warmup 3 --global-batch-size 4").optimizer.lr_warmup_steps == 12
    assert run("--warmup 0.2 --global-batch-size 4").optimizer.lr_warmup_steps == 8


def test_deprecated_conflicting_with_new_flag_is_an_error():
    msg = error_of("--model-parallel-size 2 --tensor-model-parallel-size 4", world_size=4)
    assert "--model-parallel-size 2" in msg and "--tensor-model-parallel-size 4" in msg


def test_checkpoint_activations_maps_to_full_uniform_recompute(caplog):
    cfg = run("--checkpoint-activations")
    assert "--recompute-granularity full --recompute-method uniform" in caplog.text
    assert (cfg.model.recompute_granularity, cfg.model.recompute_method) == ("full", "uniform")


def test_recompute_flags_reach_the_model_config():
    cfg = run("--recompute-activations")
    assert cfg.model.recompute_granularity == "selective"
    msg = error_of("--recompute-granularity full")
    assert "--recompute-granularity full needs --recompute-method" in msg


def test_mapping_of_checkpoint_activations_is_ready_for_recompute():
    ns, explicit = parse_args(["--checkpoint-activations"])
    apply_deprecated(ns, explicit)
    assert (ns.recompute_granularity, ns.recompute_method) == ("full", "uniform")


@pytest.mark.parametrize("extra, warned", [("", False), ("--distributed-backend gloo", False),
                                           ("--distributed-backend nccl", True)])
def test_distributed_backend_is_detected(caplog, extra, warned):
    cfg = run(extra, cuda_available=False)
    assert cfg.args["distributed_backend"] == "gloo"
    assert ("--distributed-backend nccl ignored: using gloo" in caplog.text) == warned
    assert run(extra, cuda_available=True).args["distributed_backend"] == "nccl"


@pytest.mark.parametrize("extra, value", [
    ("", True),
    ("--no-async-tensor-model-parallel-allreduce", False),
    ("--no-async-tensor-model-parallel-allreduce --async-tensor-model-parallel-allreduce", True),
    ("--async-tensor-model-parallel-allreduce --no-async-tensor-model-parallel-allreduce", False),
])
def test_toggle_pairs_last_one_wins(extra, value):
    cfg = run(extra)
    assert cfg.model.async_tensor_model_parallel_allreduce is value
    flipped = extra.replace("async-tensor-model-parallel-allreduce", "gradient-accumulation-fusion")
    assert run(flipped).args["gradient_accumulation_fusion"] is value


def test_compile_default_follows_cuda_and_flags_override():
    assert run(cuda_available=False).model.compile_layers is False
    assert run(cuda_available=True).model.compile_layers is True
    assert run("--no-compile", cuda_available=True).model.compile_layers is False
    assert run("--compile", cuda_available=False).model.compile_layers is True


@pytest.mark.parametrize("flag", sorted(REMOVED))
def test_removed_old_flags_name_the_modern_equivalent(flag):
    msg = error_of([f"{flag}=1"])
    assert flag in msg and REMOVED[flag] in msg


# ------------------------------------------------------------------- not-supported flags


def _non_default_argv(spec):
    if spec.kind in ("true", "false"):
        return [spec.flag]
    if spec.choices:
        return [spec.flag, str(next(c for c in spec.choices if c != spec.default))]
    value = {"int": str((spec.default or 0) + 3), "float": "0.375", "+int": "5", "bool": "1",
             "list": "x", "str": "x", "raw": "x"}[spec.kind]
    return [spec.flag, value]


def _rejected_specs():
    return [s for s in FLAG_SPECS.values() if s.flag in NOT_SUPPORTED or (
        s.group in NOT_SUPPORTED_GROUPS and s.flag not in ALLOWED_IN_REJECTED_GROUPS)]


def test_every_not_supported_flag_is_rejected_with_its_reason():
    specs = _rejected_specs()
    assert len(specs) > 70
    for spec in specs:
        ns, explicit = parse_args(_non_default_argv(spec))
        with pytest.raises(ArgumentsError) as info:
            check_not_supported(ns, apply_deprecated(ns, explicit))
        reason = NOT_SUPPORTED.get(spec.flag) or NOT_SUPPORTED_GROUPS[spec.group]
        assert f"{spec.flag}: {reason}" in info.value.message, spec.flag


def test_rejection_is_one_error_listing_all_flags():
    msg = error_of("--expert-model-parallel-size 2 --img-h 32 --onnx-safe true", world_size=2)
    assert "--expert-model-parallel-size: expert model parallelism is not supported" in msg
    assert "--img-h: vision models are not part of this GPT framework" in msg
    assert "--onnx-safe: ONNX export is not supported" in msg


def test_not_supported_flags_at_their_default_are_fine():
    cfg = run("--img-h 224 --pipeline-model-parallel-size 1 --transformer-impl local "
              "--recompute-num-layers 1 --expert-model-parallel-size 1")
    assert cfg.parallel.pp_size == 1 and cfg.parallel.ep_size == 1


def test_no_effect_flags_warn(caplog):
    run("--use-flash-attn --no-masked-softmax-fusion --vocab-extra-ids 2")
    assert "--vocab-extra-ids 2 has no effect with NullTokenizer" in caplog.text
    assert "--use-flash-attn has no effect here" in caplog.text
    assert "--no-masked-softmax-fusion has no effect here" in caplog.text


# ------------------------------------------------------------------------------ YAML


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_config_with_command_line_override(tmp_path):
    path = _yaml(tmp_path, "tensor-model-parallel-size: 2\nhidden_size: 128\nbf16: true\n"
                           "--no-position-embedding: true\nuse-rotary-position-embeddings: true\n"
                           "data-path: [0.3, a, 0.7, b]\nlr: 3e-4\nsequence-parallel: false\n")
    base = without("--lr", without("--mock-data"))
    cfg = run(f"--config {path} --hidden-size 256", world_size=2, base=base)
    assert cfg.parallel.tp_size == 2 and cfg.model.hidden_size == 256 and cfg.optimizer.bf16
    assert cfg.model.position_embedding_type == "rope" and cfg.optimizer.lr == 3e-4
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"]
    assert cfg.args["config"] == path


def test_yaml_unknown_key_suggests_closest_flag(tmp_path):
    msg = error_of(f"--config {_yaml(tmp_path, 'tensor-model-paralel-size: 2')}")
    assert "unknown key 'tensor-model-paralel-size'" in msg
    assert "did you mean 'tensor-model-parallel-size'" in msg


@pytest.mark.parametrize("text, expected", [
    ("num-layers: 2.5", "expects int"), ("bf16: yes please", "is a switch"),
    ("optimizer: lamb", "'lamb' is not one of adam, sgd"), ("checkpoint-method: uniform",
                                                              "--recompute-method"),
])
def test_yaml_bad_values(tmp_path, text, expected):
    assert expected in error_of(f"--config {_yaml(tmp_path, text)}")


def test_yaml_values_are_rejected_like_flags(tmp_path):
    assert "--expert-model-parallel-size: expert model parallelism" in error_of(
        f"--config {_yaml(tmp_path, 'expert_model_parallel_size: 2')}")


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
    ("--lr-warmup-iters 10", 1, ["warmup (20 samples)", "decay (20 samples)"]),
    ("--group-query-attention --num-query-groups 3", 1, ["--num-attention-heads 4",
                                                          "--num-query-groups 3"]),
    ("--group-query-attention --num-query-groups 2 --tensor-model-parallel-size 4", 4,
     ["--num-query-groups 2", "--tensor-model-parallel-size 4"]),
    ("--num-query-groups 2", 1, ["--num-query-groups 2 needs --group-query-attention"]),
    ("--bf16 --DDP-impl torch", 1, ["--DDP-impl local (got torch)"]),
    ("--fp16-lm-cross-entropy", 1, ["--fp16-lm-cross-entropy needs --fp16"]),
    ("--weight-decay-incr-style linear", 1, ["needs both --start-weight-decay"]),
    ("--mock-data --data-path x", 1, ["--mock-data and --data-path"]),
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


def test_sample_based_rules():
    base = without("--train-iters")
    assert "--lr-warmup-iters 2" in error_of("--train-samples 100 --lr-warmup-iters 2", base=base)
    assert "--lr-decay-iters 5" in error_of("--train-samples 100 --lr-decay-iters 5", base=base)


def test_layers_divisible_by_pipeline_size():
    ns, explicit = parse_args(BASE + ["--num-layers", "3", "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ArgumentsError, match="--num-layers 3 is not divisible by "
                                             "--pipeline-model-parallel-size 2"):
        validate_args(ns, 2, explicit=explicit)


def test_ffn_size_divisible_by_tensor_parallel_size():
    """--ffn-hidden-size 333 with tp 2 (dense or --num-experts) is refused at validation,
    not by a bare "333 is not divisible by 2" from every rank's model build."""
    for extra in ("", " --num-experts 4"):
        msg = error_of("--ffn-hidden-size 333 --tensor-model-parallel-size 2" + extra,
                       world_size=2)
        assert ("--ffn-hidden-size 333 is not divisible by --tensor-model-parallel-size 2"
                in msg and "(e.g. 332)" in msg)
    assert run("--ffn-hidden-size 334 --tensor-model-parallel-size 2", world_size=2)


def test_tp_larger_than_world_is_clamped_with_warning(caplog):
    assert run("--tensor-model-parallel-size 2", world_size=1).parallel.tp_size == 1
    assert "--tensor-model-parallel-size 2 is larger than the world size 1" in caplog.text


def test_global_batch_default_and_micro_batches(caplog):
    caplog.set_level(logging.INFO, logger="megatron.arguments")
    cfg = run(world_size=4)
    assert cfg.data.global_batch_size == 8 and cfg.data.num_micro_batches == 1
    assert "setting global batch size to 8" in caplog.text
    cfg = run("--global-batch-size 32", world_size=4)
    assert (cfg.parallel.dp_size, cfg.data.num_micro_batches) == (4, 4)


def test_sequence_parallel_with_tp1_is_disabled_with_warning(caplog):
    assert run("--sequence-parallel").model.sequence_parallel is False
    assert "--sequence-parallel needs --tensor-model-parallel-size > 1" in caplog.text
    cfg = run("--sequence-parallel --tensor-model-parallel-size 2", world_size=2)
    assert cfg.parallel.sequence_parallel and cfg.model.sequence_parallel
    assert cfg.model.async_tensor_model_parallel_allreduce is False


def test_swiglu_ffn_rule_and_user_value_kept(caplog):
    assert run("--swiglu --hidden-size 4096 --num-attention-heads 32").model.ffn_hidden_size == 10880
    cfg = run("--swiglu --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008")
    assert cfg.model.ffn_hidden_size == 11008 and cfg.model.activation == "swiglu"
    assert "--ffn-hidden-size 11008 kept; Megatron-LM 23.05 replaces it with 10880" in caplog.text


def test_bf16_forces_fp32_grad_accumulation():
    cfg = run("--bf16")
    assert cfg.parallel.accumulate_allreduce_grads_in_fp32 and cfg.model.params_dtype == torch.bfloat16
    assert cfg.args["params_dtype"] == "torch.bfloat16"


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


# --------------------------------------------------------------- dry run / param counts


def _gpt2(vocab, **kw):
    return ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                       padded_vocab_size=vocab, seq_length=1024, max_position_embeddings=1024, **kw)


def test_param_count_gpt2_124m():
    assert count_parameters(_gpt2(50257)).total == 124_439_808  # Hugging Face GPT-2 count
    counts = count_parameters(_gpt2(50304))  # what this framework builds (padded vocab)
    assert counts.total == 124_439_808 + 47 * 768 and counts.per_stage == [counts.total]
    per_layer_sharded = 12 * 768 * 768 + 3 * 768 + 4 * 768  # qkv/fc1 biases split too
    tp2 = count_parameters(_gpt2(50304), tp_size=2).per_stage[0]
    replicated = 1024 * 768 + 12 * (4 * 768 + 2 * 768) + 2 * 768
    assert tp2 == 50304 * 768 // 2 + replicated + 12 * per_layer_sharded // 2


def test_param_count_variants_by_hand():
    cfg = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=4, padded_vocab_size=16,
                      seq_length=4, max_position_embeddings=4, num_query_groups=2,
                      ffn_hidden_size=12, activation="swiglu", normalization="RMSNorm",
                      add_bias_linear=False, position_embedding_type="rope",
                      untie_embeddings_and_output_weights=True)
    layer = (4 + 2 * 2) * 2 * 8 + 8 * 8 + 2 * 12 * 8 + 12 * 8 + 2 * 8
    assert count_parameters(cfg).total == 16 * 8 * 2 + 2 * layer + 8


def test_rotary_alone_adds_learned_positions_as_megatron(caplog):
    """Megatron-LM 23.05: --use-rotary-position-embeddings without --no-position-embedding
    builds both the learned position table and rotary attention (no warning here); with
    --no-position-embedding, or as --position-embedding-type rope, rotary only."""
    both = run("--use-rotary-position-embeddings")
    m = both.model
    assert (m.position_embedding_type, m.add_position_embedding,
            m.use_rotary_position_embeddings) == ("rope+learned", True, True)
    assert both.args["add_position_embedding"] and both.args["use_rotary_position_embeddings"]
    assert "position" not in caplog.text
    for extra in ("--use-rotary-position-embeddings --no-position-embedding",
                  "--position-embedding-type rope",
                  "--position-embedding-type rope --use-rotary-position-embeddings"):
        rope = run(extra)
        assert rope.model.position_embedding_type == "rope", extra
        assert not rope.args["add_position_embedding"], extra
    assert "contradicts the legacy flags (which give rope+learned)" in error_of(
        "--position-embedding-type learned_absolute --use-rotary-position-embeddings")
    # --dry-run's count: the learned table (max positions x hidden) on top of rotary only
    assert count_parameters(m).total == count_parameters(rope.model).total + 32 * 64
    from megatron.core.models.gpt.gpt_model import GPTModel

    built = GPTModel(m)
    assert sum(p.numel() for p in built.parameters()) == count_parameters(m).total


@pytest.mark.parametrize("pp,standalone,untied", [(2, False, False), (2, True, False),
                                                   (3, True, True), (4, False, True)])
def test_param_count_per_stage_equals_the_stages_the_model_builds(pp, standalone, untied):
    """Per-stage counts (the --dry-run report, the memory estimate) equal the parameters of
    the stages built on the meta device, also with --standalone-embedding-stage (stage 0:
    the embedding only), which the count used to ignore."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.stages import stage_layout

    cfg = ModelConfig(num_layers=6 if pp == 3 else 4, hidden_size=16, num_attention_heads=4,
                      padded_vocab_size=64, seq_length=8, max_position_embeddings=8,
                      untie_embeddings_and_output_weights=untied)
    counts = count_parameters(cfg, pp_size=pp, standalone_embedding_stage=standalone)
    built = []
    for stage in range(pp):
        (spec,) = stage_layout(cfg.num_layers, pp, stage, standalone_embedding_stage=standalone)
        model = GPTModel(cfg, pre_process=spec.pre_process, post_process=spec.post_process,
                         num_layers=spec.num_layers, layer_offset=spec.layer_offset,
                         device="meta")
        built.append(sum(p.numel() for p in model.parameters()))
    assert counts.per_stage == built


def test_param_count_1_3b_shape():
    cfg = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16,
                      padded_vocab_size=50304, seq_length=2048, max_position_embeddings=2048)
    counts = count_parameters(cfg, tp_size=2)
    assert 1.30e9 < counts.total < 1.33e9
    assert 0.49 < counts.per_stage[0] / counts.total < 0.51


def test_dry_run_report_and_missing_inputs(tmp_path, capsys):
    cfg = run("--dry-run", world_size=2)
    text = dry_run_report(cfg, 2)
    assert "world size 2 = tensor 1 x pipeline 1 x data 2" in text
    assert "parameters:" in text and "all input files found" in text
    assert run_dry_run(cfg, 2) == 0
    prefix = tmp_path / "corpus_text_document"
    (tmp_path / "corpus_text_document.idx").write_bytes(b"")
    cfg = run(f"--data-path 1.0 {prefix} --load {tmp_path}/none --exit-on-missing-checkpoint",
              base=without("--mock-data"))
    text = dry_run_report(cfg, 1)
    assert f"{prefix}.bin (--data-path)" in text and f"{prefix}.idx" not in text
    assert f"{tmp_path}/none (--load" in text
    assert run_dry_run(cfg, 1) == 1
    cfg = run(f"--data-path {prefix}.idx", base=without("--mock-data"))
    assert (f"{prefix}.idx.bin and {prefix}.idx.idx (--data-path: a dataset is named by its "
            f"prefix without .bin/.idx: pass {prefix})") in dry_run_report(cfg, 1)


# ------------------------------------------------ dry run: the checkpoint --load would read
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of BASE's model at iteration 10 (20 samples): "full" (optimizer and RNG
    states), "bare" (--no-save-optim --no-save-rng), "tp2" (full's shard duplicated as tp
    rank 1 and its args saying tp 2: the layout is all the dry run reads)."""
    from megatron.checkpoint_files import load_checkpoint_file
    from megatron.trainer_checkpoint import save_trainer_checkpoint
    from tests.gpt_helpers import cli_trainer

    root = tmp_path_factory.mktemp("ckpt")
    for name, extra in (("full", []), ("bare", ["--no-save-optim", "--no-save-rng"])):
        _, _, tr = cli_trainer(BASE + ["--save", str(root / name), "--save-interval", "10"] + extra)
        tr.state.iteration, tr.state.consumed_train_samples = 10, 20
        tr.scheduler.step(20)
        save_trainer_checkpoint(tr)
    it = root / "tp2" / "iter_0000010"
    shutil.copytree(root / "full", root / "tp2")
    shutil.copytree(it / "mp_rank_00", it / "mp_rank_01")
    state = load_checkpoint_file(str(it / "mp_rank_00" / "model_optim_rng.pt"))
    state["args"]["tensor_model_parallel_size"] = 2
    torch.save(state, it / "mp_rank_00" / "model_optim_rng.pt")
    return root


def dry(capsys, extra):
    """(exit status, printed report) of pretrain_gpt.py's --dry-run path."""
    status = run_dry_run(run(extra), 1)
    return status, capsys.readouterr().out


def test_dry_run_resumes_from_the_checkpoint(saved, capsys, tmp_path):
    status, out = dry(capsys, f"--load {saved}/full")
    assert status == 0 and "checkpoint problems" not in out
    assert (f"checkpoint (--load {saved}/full):\n  resumes from iteration 10 ({saved}/full/"
            "iter_0000010), consumed samples 20\n  loads: model weights, optimizer and "
            "learning-rate schedule, RNG states\n  layout: saved with tp 1, pp 1, fp32 "
            "optimizer; each rank reads its own shard") in out
    status, out = dry(capsys, f"--load {tmp_path}")
    assert status == 0 and (f"no checkpoint ({tmp_path}/latest_checkpointed_iteration.txt "
                            "does not exist): starts from scratch") in out
    status, out = dry(capsys, f"--load {saved}/full --finetune --lr 5e-4 --no-load-rng")
    assert status == 0 and f"finetune: weights only from {saved}/full/iter_0000010, " \
                           "iteration 0" in out


def test_dry_run_lists_every_schedule_mismatch(saved, capsys):
    """The real run stops at max_lr; the dry run names max_lr and the decay length (in
    samples: --train-iters changed it) with the flags that settle them."""
    status, out = dry(capsys, f"--load {saved}/full --lr 5e-4 --train-iters 40")
    assert status == 1 and "checkpoint problems (3; the real run stops at the first)" in out
    assert (f"error: loading {saved}/full/iter_0000010: optimizer-parameter-scheduler value "
            "'max_lr' from the checkpoint (0.001) differs from the command line (0.0005); pass "
            "--override-opt_param-scheduler to use the command line or "
            "--use-checkpoint-opt_param-scheduler to use the checkpoint") in out
    assert "'lr_decay_steps' (in samples: iterations x global batch size) from the " \
           "checkpoint (20) differs from the command line (80)" in out
    assert out.rstrip().endswith("the run would stop when it loads the checkpoint")
    status, out = dry(capsys, f"--load {saved}/full --lr 5e-4 --override-opt_param-scheduler")
    assert status == 0 and "learning-rate schedule: max_lr: using the command line's " \
                           "0.0005, not the checkpoint's 0.001" in out
    assert dry(capsys, f"--load {saved}/full --lr 5e-4 "
                       "--use-checkpoint-opt_param-scheduler")[0] == 0


def test_dry_run_global_batch_size_changes_the_schedule(saved, capsys):
    status, out = dry(capsys, f"--load {saved}/full --global-batch-size 4")
    assert status == 1
    for name in ("lr_decay_steps", "wd_incr_steps"):
        assert (f"'{name}' (in samples: iterations x global batch size) from the checkpoint "
                "(20) differs from the command line (40)") in out


def test_dry_run_checkpoint_without_optimizer_or_rng(saved, capsys):
    status, out = dry(capsys, f"--load {saved}/bare")
    path = f"{saved}/bare/iter_0000010/mp_rank_00/model_optim_rng.pt"
    assert status == 1 and "checkpoint problems (2;" in out
    assert (f"error: unable to load optimizer from checkpoint {path}: it holds no optimizer "
            "state") in out and "Specify --no-load-optim or --finetune" in out
    assert f"error: unable to load rng state from checkpoint {path}" in out
    status, out = dry(capsys, f"--load {saved}/bare --no-load-optim --no-load-rng")
    assert status == 0 and "loads: model weights\n  --no-load-optim: the optimizer state " \
                           "and the learning-rate schedule start fresh" in out


def test_dry_run_model_shape_mismatch_names_every_argument(saved, capsys):
    status, out = dry(capsys, f"--load {saved}/full --hidden-size 128 --num-layers 3 "
                              "--vocab-size 300")
    assert status == 1
    for line in ("--num-layers: checkpoint 2, this run 3",
                 "--hidden-size: checkpoint 64, this run 128",
                 "padded vocabulary size (rows of the word embedding): checkpoint 128, this "
                 "run 384", "--vocab-size: checkpoint 100, this run 300"):
        assert f"\n    {line}\n" in out
    assert "or leave these flags out and pass --use-checkpoint-args" in out


def test_dry_run_bad_tracker(saved, capsys, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved / "full", root)
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_text("abc")
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: malformed checkpoint tracker file {tracker}: content " \
                           "'abc'" in out
    tracker.write_text("20")
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"{tracker} names 20, but the checkpoint directory " \
                           f"{root}/iter_0000020 does not exist" in out
    tracker.unlink()
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: --load {root} has no latest_checkpointed_iteration.txt " \
                           "but holds checkpoints" in out
    assert dry(capsys, f"--load {root} --exit-on-missing-checkpoint")[0] == 1


def test_dry_run_other_tensor_parallel_size_reshards(saved, capsys, tmp_path):
    status, out = dry(capsys, f"--load {saved}/tp2")
    assert status == 0 and ("resharded on load: saved with tp 2, pp 1, fp32 optimizer, this "
                            "run has tp 1, pp 1, fp32 optimizer; every rank reads all 2 shard "
                            "file(s) and takes its slice; RNG states start fresh") in out
    root = tmp_path / "ck"
    shutil.copytree(saved / "tp2", root)
    shard = root / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:5000])
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"error: cannot read checkpoint file {shard}" in out
    shard.unlink()
    status, out = dry(capsys, f"--load {root}")
    assert status == 1 and f"checkpoint file(s) missing: {shard}" in out


def test_format_args_dump():
    text = format_args_dump({"lr": 0.1, "DDP_impl": "local", "b": None})
    assert text.splitlines() == [
        "------------------------ arguments ------------------------",
        "  b " + "." * 47 + " None",
        "  DDP_impl " + "." * 40 + " local",
        "  lr " + "." * 46 + " 0.1",
        "-------------------- end of arguments ---------------------",
    ]
