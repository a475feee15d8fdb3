"""The CLI layer: Megatron-LM 23.05 flag compatibility, deprecated and rejected flags, YAML
configs, the arguments dump. Validation and derived config values are tested in
test_arguments_validation.py, --dry-run and parameter counts in test_arguments_dry_run.py;
the command line they share is in args_helpers.py."""
from __future__ import annotations

import json
import os

import pytest

from megatron.arguments import (
    ArgumentsError,
    apply_deprecated,
    build_parser,
    check_not_supported,
    format_args_dump,
    parse_args,
)
from megatron.arguments_common import FLAG_SPECS
from megatron.arguments_table import (
    ALLOWED_IN_REJECTED_GROUPS,
    LATER_FLAGS,
    MEGATRON_GROUPS,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
    REMOVED,
)
from megatron.cli_suggest import option_strings
from tests.args_helpers import BASE, error_of, run, without

ARGS_JSON = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference",
                         "megatron-23.06-args.json")
MEGATRON_ORDER = ["network size", "regularization", "training", "initialization",
                  "learning rate", "checkpointing", "mixed precision", "distributed",
                  "validation", "data and dataloader", "autoresume", "biencoder", "vision",
                  "logging", "inference", "Transformer-Engine", "retro"]


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


# Choices this framework adds to a Megatron flag (README/MIGRATING name them).
EXTENSION_CHOICES = {"--tokenizer-type": ("HuggingFaceTokenizer",),
                     "--data-impl": ("lazy", "cached")}


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
        extra = EXTENSION_CHOICES.get(flag, ())
        assert action.choices == (None if row["choices"] is None and not extra
                                  else list(row["choices"]) + list(extra)), flag
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


def test_deprecated_warmup_of_a_fractional_iteration_count_is_an_error():
    """--warmup 1.5 (1 or more: --lr-warmup-iters) silently became 1 iteration."""
    assert error_of("--warmup 1.5") == (
        "--warmup 1.5: 1 or more counts iterations, so it must be a whole number; pass "
        "--lr-warmup-iters 2 (or a fraction below 1, read as --lr-warmup-fraction)")
    assert run("--warmup 4.0").args["lr_warmup_iters"] == 4


def test_deprecated_conflicting_with_new_flag_is_an_error():
    msg = error_of("--model-parallel-size 2 --tensor-model-parallel-size 4", world_size=4)
    assert "--model-parallel-size 2" in msg and "--tensor-model-parallel-size 4" in msg


def test_checkpoint_activations_maps_to_full_uniform_recompute(caplog):
    cfg = run("--checkpoint-activations")
    assert "--recompute-granularity full --recompute-method uniform" in caplog.text
    assert (cfg.model.recompute_granularity, cfg.model.recompute_method) == ("full", "uniform")


def test_checkpoint_activations_beside_selective_recompute_names_the_conflict(caplog):
    """--checkpoint-activations is full recompute: beside --recompute-activations or
    --recompute-granularity selective the error named a --recompute-method uniform the
    user never typed."""
    for selective in ("--recompute-activations", "--recompute-granularity selective"):
        msg = error_of(f"--checkpoint-activations {selective}")
        assert "--checkpoint-activations (deprecated: --recompute-granularity full " in msg
        assert f"conflicts with {selective} (selective recompute" in msg
        assert "drop the deprecated --checkpoint-activations" in msg
    cfg = run("--checkpoint-activations --recompute-method block")
    assert (cfg.model.recompute_granularity, cfg.model.recompute_method) == ("full", "block")
    assert ("--checkpoint-activations is deprecated; using --recompute-granularity full "
            "with the given --recompute-method block") in caplog.text


def test_recompute_activations_with_a_recompute_method_says_it_means_selective():
    msg = error_of("--recompute-activations --recompute-granularity full "
                   "--recompute-method uniform")
    assert "--recompute-activations means --recompute-granularity selective" in msg
    assert "replace --recompute-activations by --recompute-granularity full" in msg


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
    assert flag in msg and REMOVED[flag].replace(" <value>", "") in msg


@pytest.mark.parametrize("flag", sorted(LATER_FLAGS))
def test_later_megatron_flags_say_what_they_are_not_a_look_alike(flag):
    """Flags copied from a later Megatron-LM script: `--use-mcore-models` was answered
    'did you mean --compile-mode?', `--norm-epsilon 1e-6` with the hint before its value,
    `--moe-router-topk` with nothing at all."""
    assert flag not in option_strings(build_parser())  # a flag this project lacks
    msg = error_of(f"{flag} 1")
    assert f"{flag} ({LATER_FLAGS[flag]})" in msg and "did you mean" not in msg


@pytest.mark.parametrize("flag", ["--moe-token-dispatcher-type alltoall",
                                  "--moe-z-loss-coeff=0.001", "--moe-per-layer-logging",
                                  "--expert-tensor-parallel-size 2"])
def test_every_later_moe_flag_is_named_as_later_megatron_moe(flag, tmp_path):
    """Any --moe-* flag (later Megatron-LM's MoE), not only the three in LATER_FLAGS: they
    were answered with look-alikes ('--moe-token-dispatcher-type (did you mean
    --tokenizer-type?)', '--moe-z-loss-coeff (did you mean --min-loss-scale?)',
    '--expert-tensor-parallel-size (did you mean --expert-model-parallel-size?)', a flag
    refused above 1), on the command line and as a --config key."""
    token = flag.split()[0]
    name = token.split("=")[0]
    msg = error_of(flag)
    assert f"{token} (later Megatron-LM's MoE: not offered" in msg, msg
    assert "did you mean" not in msg, msg
    config = tmp_path / "c.yaml"
    config.write_text(f"{name[2:]}: 1\n")
    msg = error_of(["--config", str(config)])
    assert f"unknown key '{name[2:]}': later Megatron-LM's MoE" in msg, msg


def test_norm_epsilon_names_the_23_05_spelling(tmp_path):
    msg = error_of("--normalization RMSNorm --norm-epsilon=1e-6")
    assert "--norm-epsilon=1e-6 (later Megatron-LM's name of --layernorm-epsilon" in msg
    path = _yaml(tmp_path, "norm-epsilon: 1.0e-6")
    assert error_of(f"--config {path}").endswith(
        "unknown key 'norm-epsilon': later Megatron-LM's name of --layernorm-epsilon: pass "
        "that instead")
    assert run("--normalization RMSNorm --layernorm-epsilon 1e-6").model.layernorm_epsilon == 1e-6


def test_removed_recompute_flags_are_named_together_with_their_values(tmp_path):
    """Old scripts (Megatron-LM's sc21 examples) pass --activations-checkpoint-method
    uniform with --activations-checkpoint-num-layers: the error named only the first, with
    `--recompute-method <value>` to fill in, and the next run refused the second."""
    msg = error_of("--activations-checkpoint-method uniform --activations-checkpoint-num-layers 2")
    assert msg == ("--activations-checkpoint-method and --activations-checkpoint-num-layers "
                   "were removed from Megatron-LM before 23.05; use --recompute-granularity "
                   "full --recompute-method uniform --recompute-num-layers 2")
    assert error_of("--checkpoint-num-layers=3").endswith("; use --recompute-num-layers 3")
    assert error_of("--model-parallel-memory-opt").endswith("; use --sequence-parallel")
    cfg = tmp_path / "old.yaml"
    cfg.write_text("activations-checkpoint-method: block\n")
    assert error_of(f"--config {cfg}").endswith(
        "use --recompute-granularity full --recompute-method block")
    cfg.write_text("model-parallel-memory-opt: true\n")
    assert error_of(f"--config {cfg}").endswith("; use --sequence-parallel")


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
    run("--use-flash-attn --no-masked-softmax-fusion --vocab-extra-ids 2 --data-impl mmap")
    assert "--vocab-extra-ids 2 has no effect with NullTokenizer" in caplog.text
    assert "--use-flash-attn has no effect here" in caplog.text
    assert "--no-masked-softmax-fusion has no effect here" in caplog.text
    # every Megatron-LM 23.05 script passes --data-impl mmap: what is read anyway, no warning
    assert "--data-impl" not in caplog.text


@pytest.mark.parametrize("value, warned", [("lazy", True), ("cached", True),
                                           ("infer", False), ("mmap", False)])
def test_data_impl_values_of_older_scripts_warn_once(caplog, value, warned):
    """Megatron-LM 23.04's lazy and cached (23.05 refuses them) name how legacy TNTIDX
    files were read; the format is read from each index's magic here, so they run, with
    one warning. mmap and infer name what happens anyway: no warning."""
    run(f"--data-impl {value}")
    assert caplog.text.count("--data-impl has no effect here") == int(warned)


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


def test_command_line_run_length_replaces_a_preset_counted_the_other_way(tmp_path, caplog):
    """A preset in samples (the gpt3-* ones) plus --train-iters on the command line: the
    command line wins, the preset's sample schedule is dropped with a warning (it was an
    error naming two exclusive flags); and the other way round for a preset in iterations."""
    samples = _yaml(tmp_path, "train-samples: 4000\nlr-decay-samples: 3000\n"
                              "lr-warmup-samples: 100\n")
    cfg = run(f"--config {samples} --train-iters 7", base=without("--train-iters"))
    assert cfg.args["train_iters"] == 7 and cfg.args["train_samples"] is None
    assert cfg.args["lr_decay_samples"] is None and cfg.args["lr_warmup_samples"] == 0
    assert (f"--train-iters 7 on the command line replaces the run length of --config "
            f"{samples}") in caplog.text
    assert ("--train-samples 4000, --lr-decay-samples 3000, --lr-warmup-samples 100 ignored; "
            "pass --lr-decay-iters / --lr-warmup-iters") in caplog.text
    iters = tmp_path / "iters.yaml"
    iters.write_text("train-iters: 50\nlr-warmup-iters: 5\nlr-decay-iters: 40\n")
    cfg = run(f"--config {iters} --train-samples 64 --lr-decay-samples 60",
              base=without("--train-iters"))
    assert cfg.args["train_samples"] == 64 and cfg.args["lr_decay_samples"] == 60
    assert ("--train-iters 50, --lr-decay-iters 40, --lr-warmup-iters 5 ignored; pass "
            "--lr-warmup-samples to set") in caplog.text
    caplog.clear()
    cfg = run(f"--config {iters} --train-iters 9", base=without("--train-iters"))  # same way
    assert cfg.args["train_iters"] == 9 and cfg.args["lr_decay_iters"] == 40
    assert "replaces the run length" not in caplog.text


def test_command_line_warmup_replaces_a_preset_warmup_spelled_another_way(tmp_path, caplog):
    """A preset's lr-warmup-samples (the gpt3-* ones) plus --lr-warmup-fraction on the
    command line: the command line wins, with a warning (it was an error naming the two
    exclusive flags, one of them the file's, that no command-line flag could take back)."""
    samples = _yaml(tmp_path, "train-samples: 4000\nlr-warmup-samples: 100\n")
    cfg = run(f"--config {samples} --lr-warmup-fraction 0.01", base=without("--train-iters"))
    assert cfg.args["lr_warmup_fraction"] == 0.01 and cfg.args["lr_warmup_samples"] == 0
    assert (f"--lr-warmup-fraction 0.01 on the command line replaces the warmup of --config "
            f"{samples}: its --lr-warmup-samples 100 ignored") in caplog.text
    iters = tmp_path / "iters.yaml"
    iters.write_text("train-iters: 50\nlr-warmup-fraction: 0.1\n")
    cfg = run(f"--config {iters} --lr-warmup-iters 5", base=without("--train-iters"))
    assert cfg.args["lr_warmup_iters"] == 5 and cfg.args["lr_warmup_fraction"] is None
    caplog.clear()
    cfg = run(f"--config {samples} --train-iters 9 --lr-warmup-fraction 0.1",
              base=without("--train-iters"))  # no hint to pass a warmup: one is given
    assert "pass --lr-decay-iters to set the schedule" in caplog.text
    cfg = run(f"--config {samples} --warmup 0.05", base=without("--train-iters"))  # deprecated
    assert cfg.args["lr_warmup_fraction"] == 0.05 and cfg.args["lr_warmup_samples"] == 0


def test_command_line_precision_and_data_replace_the_configs(tmp_path, caplog):
    """A bf16 preset plus --fp16 (a GPU without bf16), a config naming data-path plus
    --mock-data (to try it out): the command line wins, with a warning. Both were an error
    ('--fp16 and --bf16 are exclusive; pass one') that no command-line flag could take back."""
    preset = _yaml(tmp_path, "bf16: true\nfp16: false\ndata-path: [a_text_document]\n")
    cfg = run(f"--config {preset} --fp16")
    assert cfg.optimizer.fp16 and not cfg.optimizer.bf16 and cfg.data.data_path is None
    assert (f"--fp16 on the command line replaces the precision of --config {preset}: its "
            "--bf16 ignored") in caplog.text
    assert (f"--mock-data on the command line replaces the data of --config {preset}: its "
            "--data-path a_text_document ignored") in caplog.text
    mock = _yaml(tmp_path, "fp16: true\nmock-data: true\n")
    cfg = run(f"--config {mock} --bf16 --data-path b_text_document --dry-run",
              base=without("--mock-data"))
    assert cfg.optimizer.bf16 and not cfg.optimizer.fp16
    assert cfg.data.data_path == ["b_text_document"] and not cfg.args["mock_data"]
    caplog.clear()
    run(f"--config {_yaml(tmp_path, 'fp16: false')} --bf16")  # nothing of the file's dropped
    assert "replaces" not in caplog.text


def test_command_line_wins_over_a_configs_deprecated_spelling(tmp_path, caplog):
    """An old config's deprecated key (batch-size, model-parallel-size,
    checkpoint-activations) plus the modern flag on the command line, or the other way
    round: the command line wins, with a warning. It was an error ('--batch-size 4
    conflicts with --micro-batch-size 8; drop the deprecated --batch-size') about a value
    the command line had just overridden."""
    old = _yaml(tmp_path, "batch-size: 4\nmodel-parallel-size: 2\ncheckpoint-activations: true\n")
    base = without("--micro-batch-size")
    cfg = run(f"--config {old} --micro-batch-size 8 --tensor-model-parallel-size 1 "
              "--recompute-granularity selective", world_size=2, base=base)
    assert cfg.data.micro_batch_size == 8 and cfg.parallel.tp_size == 1
    assert cfg.args["recompute_granularity"] == "selective"
    assert (f"--micro-batch-size 8 on the command line replaces the micro batch size of "
            f"--config {old}: its --batch-size 4 ignored") in caplog.text
    assert "its --model-parallel-size 2 ignored" in caplog.text
    assert "its --checkpoint-activations ignored" in caplog.text
    new = _yaml(tmp_path, "micro-batch-size: 4\ntensor-model-parallel-size: 2\n"
                          "recompute-activations: true\n")
    cfg = run(f"--config {new} --batch-size 8 --model-parallel-size 1 --checkpoint-activations",
              world_size=2, base=base)
    assert cfg.data.micro_batch_size == 8 and cfg.parallel.tp_size == 1
    assert cfg.args["recompute_granularity"] == "full"
    assert "its --micro-batch-size 4 ignored" in caplog.text
    assert "its --recompute-activations ignored" in caplog.text


def test_command_line_switch_false_turns_off_a_configs_switch(tmp_path):
    """A preset's `bf16: true`, `sequence-parallel: true` or `swiglu: true` could not be
    turned off from the command line (Megatron's switches have no --no-SWITCH): an fp32
    try-out of gpt3-125m.yaml meant editing the file. `--SWITCH=false` does it now, and
    `--SWITCH=true` is the bare switch."""
    preset = _yaml(tmp_path, "bf16: true\nsequence-parallel: true\nswiglu: true\n"
                             "tensor-model-parallel-size: 2\n")
    cfg = run(f"--config {preset} --bf16=false --sequence-parallel=False --swiglu=false",
              world_size=2)
    assert not cfg.optimizer.bf16 and not cfg.parallel.sequence_parallel
    assert cfg.model.activation != "swiglu"
    assert run("--fp16=true").optimizer.fp16
    assert "argument --lr: invalid float value: 'false'" in error_of("--lr=false")


def test_yaml_null_value_leaves_the_flag_at_its_default(tmp_path):
    """`load: ~` or an empty value is YAML's null: the flag keeps its default. It was the
    string 'None' (a --load and a --tensorboard-dir named ./None) or an error ('expects
    int, got None', 'is a switch')."""
    path = _yaml(tmp_path, "load: ~\ntensorboard-dir:\nlr-decay-iters: null\nfp16: null\n")
    cfg = run(f"--config {path}")
    assert cfg.args["load"] is None and cfg.args["tensorboard_dir"] is None
    assert cfg.args["lr_decay_iters"] == cfg.args["train_iters"] and not cfg.args["fp16"]


def test_yaml_compile_false_turns_compilation_off(tmp_path):
    """`compile: false` is --no-compile: it was read as 'not given', so a GPU run compiled
    the layers (the default with CUDA) although the file said false."""
    off = run(f"--config {_yaml(tmp_path, 'compile: false')}", cuda_available=True)
    assert off.args["compile_layers"] is False
    auto = run(f"--config {_yaml(tmp_path, 'no-compile: false')}", cuda_available=True)
    assert auto.args["compile_layers"] is True  # not forced off: the default, on with CUDA
    assert run(f"--config {_yaml(tmp_path, 'no-save-optim: false')}").args["no_save_optim"] \
        is None


def test_yaml_list_flag_given_as_one_line_is_split_into_words(tmp_path):
    """'rampup-batch-size: 4 4 16' and 'data-path: 0.3 a 0.7 b' (the command line's
    spelling) are read as the words: they were one value ('--rampup-batch-size 4 4 16:
    expected 3 values', a data prefix '0.3 a 0.7 b')."""
    path = _yaml(tmp_path, "rampup-batch-size: 4 4 16\ndata-path: 0.3 a 0.7 'b c'\n"
                           "train-samples: 64\n")
    cfg = run(f"--config {path} --global-batch-size 8",
              base=without("--train-iters", without("--mock-data")))
    assert cfg.args["rampup_batch_size"] == ["4", "4", "16"]  # the words, as Megatron keeps
    assert cfg.data.rampup_batch_size == [4, 4, 16]
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b c"]
    unbalanced = _yaml(tmp_path, "data-path: a 'b\n")
    assert "key 'data-path': cannot split \"a 'b\"" in error_of(f"--config {unbalanced}")


def test_missing_relative_config_names_where_it_was_looked_for(tmp_path, monkeypatch):
    # scripts/pretrain_gpt.sh runs from the repository root: 'my.yaml' is looked for there
    monkeypatch.chdir(tmp_path)
    assert error_of("--config my.yaml") == (f"--config my.yaml: file not found (looked for "
                                            f"{tmp_path}/my.yaml)")
    assert error_of(f"--config {tmp_path}/a.yaml") == f"--config {tmp_path}/a.yaml: file not found"


def test_config_given_twice_is_an_error_naming_both_files(tmp_path):
    """`--config preset.yaml --config mine.yaml` read only the last file: the preset's
    flags were lost in silence (then 'missing required flags' for one it held)."""
    preset = _yaml(tmp_path, "train-iters: 5\n")
    mine = str(tmp_path / "mine.yaml")
    (tmp_path / "mine.yaml").write_text("lr: 0.5\n")
    base = without("--train-iters")
    assert error_of(f"--config {preset} --config={mine}", base=base) == (
        f"--config is given twice ({preset}, {mine}) and only one file is read; merge them "
        "into one file, or pass the other file's flags on the command line")
    assert run(f"--config {mine} --config {mine}", base=without("--lr")).optimizer.lr == 0.5


def test_config_that_is_a_directory_pipe_or_empty_says_what_it_is(tmp_path, caplog):
    """`--config /tmp` and `--config /dev/null` both said "file not found", and so did a
    pipe (`--config <(...)`, /dev/fd/N) that holds a valid config; a list or a scalar
    document did not say what it held."""
    assert error_of(f"--config {tmp_path}") == (
        f"--config {tmp_path}: is a directory, not a file; pass the path of the YAML file "
        "of flag: value lines")
    cfg = run("--config /dev/null")
    assert cfg.model.num_layers == 2
    assert "--config /dev/null: the file holds no flags (it is empty" in caplog.text
    read, write = os.pipe()
    os.write(write, b"seed: 7\n")
    os.close(write)
    try:
        assert run(f"--config /dev/fd/{read}").args["seed"] == 7
    finally:
        os.close(read)
    listed = _yaml(tmp_path, "- num-layers\n- 2\n")
    assert error_of(f"--config {listed}") == (
        f"--config {listed}: expected a mapping of flag: value pairs, not a list of 2 items; "
        "write one 'flag: value' per line")


def test_yaml_damaged_or_mistyped_config_names_the_fix(tmp_path):
    """A config saved as UTF-16 (or any binary file) ended in a UnicodeDecodeError
    traceback; a tab was reported without saying what to do; a flag named twice (or as
    num-layers and num_layers) silently took the last value."""
    path = tmp_path / "bad.yaml"
    path.write_bytes("num-layers: 2\n".encode("utf-16"))
    assert error_of(f"--config {path}") == (
        f"--config {path}: not a UTF-8 text file (it holds byte 0xff); a config is a YAML "
        "text file of flag: value lines")
    msg = error_of(f"--config {_yaml(tmp_path, 'num-layers: 2' + chr(10) + chr(9) + 'x: 1')}")
    assert msg.endswith("line 2, column 1); replace the tab with spaces (YAML allows no tabs "
                        "there)")
    for second in ("num-layers", "num_layers"):
        path = _yaml(tmp_path, f"num-layers: 2\nhidden-size: 64\n{second}: 4\n")
        assert error_of(f"--config {path}") == (
            f"--config {path}: key '{second}' on line 3 names the flag of line 1 again; keep "
            "one of them")


def test_yaml_unknown_key_suggests_closest_flag(tmp_path):
    msg = error_of(f"--config {_yaml(tmp_path, 'tensor-model-paralel-size: 2')}")
    assert "unknown key 'tensor-model-paralel-size'" in msg
    assert "did you mean 'tensor-model-parallel-size'" in msg


@pytest.mark.parametrize("text, expected", [
    ("num-layers: 2.5", "expects int"), ("bf16: yes please", "is a switch"),
    ("optimizer: lamb", "'lamb' is not one of adam, sgd"), ("checkpoint-method: uniform",
                                                              "--recompute-method"),
    # a quoted boolean said 'give true or false, not 'false''; a list for --split, no fix
    ('bf16: "false"', "key 'bf16' is a switch and 'false' is a quoted string; write bf16: "
                      "false (no quotes)"),
    ("split: [969, 30, 1]", "got the list [969, 30, 1]; write split: 969,30,1"),
    # a mapping or a nested list was read as its Python text: a --save directory named
    # "{'dir': 'ckpt'}", a blend of weights to paths as one path "{0.3: 'a', 0.7: 'b'}"
    ("save: {dir: ckpt}", "key 'save' takes one value, not the mapping {'dir': 'ckpt'}"),
    ("data-path: {0.3: a, 0.7: b}", "key 'data-path' takes a list, not the mapping "
                                    "{0.3: 'a', 0.7: 'b'}; write data-path: [0.3, a, 0.7, b]"),
    ("data-path: [[0.3, a], [0.7, b]]", "key 'data-path' takes a list of single values, not "
                                        "the nested [[0.3, 'a'], [0.7, 'b']]; write "
                                        "data-path: [0.3, a, 0.7, b]"),
])
def test_yaml_bad_values(tmp_path, text, expected):
    assert expected in error_of(f"--config {_yaml(tmp_path, text)}")


def test_yaml_values_are_rejected_like_flags(tmp_path):
    assert "--expert-model-parallel-size: expert model parallelism" in error_of(
        f"--config {_yaml(tmp_path, 'expert_model_parallel_size: 2')}")


# ------------------------------------------------------------------------ arguments dump


def test_format_args_dump():
    text = format_args_dump({"lr": 0.1, "DDP_impl": "local", "b": None})
    assert text.splitlines() == [
        "------------------------ arguments ------------------------",
        "  b " + "." * 47 + " None",
        "  DDP_impl " + "." * 40 + " local",
        "  lr " + "." * 46 + " 0.1",
        "-------------------- end of arguments ---------------------",
    ]


def test_dump_prints_local_rank_and_rampup_as_megatron_does():
    """Users diff the dumps of the two frameworks. Under torchrun (LOCAL_RANK in the
    environment, no --local_rank) Megatron-LM prints local_rank None, where this printed 0;
    --rampup-batch-size (nargs='*', no type) stays strings there, where this printed ints.
    The run itself uses the integers."""
    from megatron.arguments import parse_and_validate

    argv = without("--train-iters") + "--train-samples 64 --rampup-batch-size 4 4 16 " \
        "--global-batch-size 8".split()
    cfg = parse_and_validate(argv, world_size=2, env={"RANK": "0", "LOCAL_RANK": "0"},
                             cuda_available=False)
    dump = format_args_dump(cfg.args).splitlines()
    assert "  local_rank " + "." * 38 + " None" in dump
    assert "  rampup_batch_size " + "." * 31 + " ['4', '4', '16']" in dump
    assert cfg.data.rampup_batch_size == [4, 4, 16]
    assert run("--local_rank 1").args["local_rank"] == 1  # as given, as Megatron-LM keeps it
