"""Audit of the command line: every flag the parser accepts does something.

Each flag that is not refused (NOT_SUPPORTED / NOT_SUPPORTED_GROUPS in arguments_table.py)
is either listed in IMPLEMENTED_BY below with the module that consumes it and the name it
is read under there, or in NO_EFFECT with the reason it changes nothing. The test checks
that the table covers exactly the accepted flags and that each listed module really
mentions the name (a config field, a namespace attribute). Flags consumed by
`arguments_validate.py` are turned into derived values there (schedule lengths in
samples, the position-embedding type, ...). A new flag needs a row here.

Then a few behaviours that only the command line shows: the timer block, the
tensorboard scalars of the logging flags, --skip-train, --eval-interval 0.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.arguments_common import FLAG_SPECS
from megatron.arguments_table import (
    ALLOWED_IN_REJECTED_GROUPS,
    NO_EFFECT,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
)

ROOT = Path(__file__).resolve().parents[1]
VALIDATE = "megatron/arguments_validate.py"
PARALLEL = "megatron/arguments_parallel.py"  # the layout and recompute rules
SCHEDULE = "megatron/arguments_schedule.py"
GPT = "megatron/core/models/gpt/gpt_model.py"
LAYERS = "megatron/core/models/gpt/transformer.py"
NORMS = "megatron/core/models/gpt/norms.py"
OPTIM = "megatron/core/optimizer/build.py"
SCHED = "megatron/core/optimizer/lr_scheduler.py"
DDP = "megatron/core/distributed/ddp.py"
DATA = "megatron/data_loading.py"
LOADER = "megatron/data_iterators.py"
LOGS = "megatron/logging_utils.py"
STEP = "megatron/train_step.py"
TRAIN = "megatron/training.py"
INTERVAL_LOG = "megatron/interval_log.py"
CKPT = "megatron/trainer_checkpoint.py"
TOK = "megatron/tokenizer/tokenizer.py"
PROF = "megatron/profiling.py"

# flag -> (module that implements it, name it reads there)
IMPLEMENTED_BY = {
    # network size
    "--num-layers": ("megatron/core/models/gpt/stages.py", "num_layers"),
    "--encoder-num-layers": (VALIDATE, "encoder_num_layers"),  # mirror of --num-layers
    "--hidden-size": (LAYERS, "hidden_size"),
    "--ffn-hidden-size": (LAYERS, "ffn_hidden_size"),
    "--num-attention-heads": (LAYERS, "num_attention_heads"),
    "--kv-channels": (LAYERS, "kv_channels"),
    "--max-position-embeddings": (GPT, "max_position_embeddings"),
    "--use-rotary-position-embeddings": (VALIDATE, "use_rotary_position_embeddings"),
    "--rotary-percent": (GPT, "rotary_percent"),
    "--no-position-embedding": (VALIDATE, "add_position_embedding"),  # -> position type
    "--make-vocab-size-divisible-by": (VALIDATE, "make_vocab_size_divisible_by"),
    "--layernorm-epsilon": (NORMS, "layernorm_epsilon"),
    "--apply-layernorm-1p": (NORMS, "apply_layernorm_1p"),
    "--apply-residual-connection-post-layernorm":
        (LAYERS, "apply_residual_connection_post_layernorm"),
    "--openai-gelu": (VALIDATE, "openai_gelu"),  # -> activation, read by the MLP
    "--no-bias-gelu-fusion": (VALIDATE, "bias_gelu_fusion"),  # -> activation (tanh form)
    "--squared-relu": (VALIDATE, "squared_relu"),
    "--swiglu": (VALIDATE, "swiglu"),
    "--num-experts": (LAYERS, "num_experts"),
    "--untie-embeddings-and-output-weights": (GPT, "untie_embeddings_and_output_weights"),
    "--embedding-weights-in-fp32": (GPT, "embedding_weights_in_fp32"),
    # regularization
    "--attention-dropout": (LAYERS, "attention_dropout"),
    "--hidden-dropout": (LAYERS, "hidden_dropout"),
    "--weight-decay": (OPTIM, "weight_decay"),
    "--start-weight-decay": (SCHED, "start_weight_decay"),
    "--end-weight-decay": (SCHED, "end_weight_decay"),
    "--weight-decay-incr-style": (SCHED, "weight_decay_incr_style"),
    "--clip-grad": (OPTIM, "clip_grad"),
    "--adam-beta1": (OPTIM, "adam_beta1"),
    "--adam-beta2": (OPTIM, "adam_beta2"),
    "--adam-eps": (OPTIM, "adam_eps"),
    "--sgd-momentum": (OPTIM, "sgd_momentum"),
    # training
    "--micro-batch-size": (LOADER, "micro_batch_size"),
    "--batch-size": ("megatron/arguments.py", "batch_size"),  # deprecated -> micro batch
    "--global-batch-size": (STEP, "global_batch_size"),
    "--rampup-batch-size": ("megatron/microbatches.py", "rampup_batch_size"),
    "--recompute-activations": (PARALLEL, "recompute_activations"),  # -> selective
    "--recompute-granularity": (LAYERS, "recompute_granularity"),
    "--recompute-method": (LAYERS, "recompute_method"),
    "--recompute-num-layers": (LAYERS, "recompute_num_layers"),
    "--distribute-saved-activations": (LAYERS, "distribute_saved_activations"),
    "--checkpoint-activations": ("megatron/arguments.py", "checkpoint_activations"),
    "--train-iters": (TRAIN, "train_iters"),
    "--train-samples": (VALIDATE, "train_samples"),  # -> train_iters, schedule in samples
    "--log-interval": (TRAIN, "log_interval"),
    "--exit-interval": (TRAIN, "exit_interval"),
    "--exit-duration-in-mins": (TRAIN, "exit_duration_in_mins"),
    "--exit-signal-handler": (TRAIN, "exit_signal_handler"),
    "--tensorboard-dir": (LOGS, "tensorboard_dir"),
    "--disable-bias-linear": (LAYERS, "add_bias_linear"),
    "--optimizer": (OPTIM, "config.optimizer"),
    "--dataloader-type": (LOADER, "dataloader_type"),
    "--no-data-sharding": (LOADER, "data_sharding"),  # Megatron's vision group; cyclic GPT loader
    "--no-async-tensor-model-parallel-allreduce":
        (LAYERS, "async_tensor_model_parallel_allreduce"),
    "--sequence-parallel": (LAYERS, "sequence_parallel"),
    "--no-gradient-accumulation-fusion": (LAYERS, "gradient_accumulation_fusion"),
    # initialization
    "--seed": ("pretrain_gpt.py", "config.training.seed"),
    "--data-parallel-random-init": (STEP, "data_parallel_random_init"),
    "--init-method-std": (LAYERS, "init_method_std"),
    "--init-method-xavier-uniform": (LAYERS, "init_method_xavier_uniform"),
    # learning rate (schedule lengths become samples in arguments_schedule.schedule_steps)
    "--lr": (SCHED, "lr"),
    "--lr-decay-style": (SCHED, "lr_decay_style"),
    "--lr-decay-iters": (SCHEDULE, "lr_decay_iters"),
    "--lr-decay-samples": (SCHEDULE, "lr_decay_samples"),
    "--lr-warmup-fraction": (SCHEDULE, "lr_warmup_fraction"),
    "--lr-warmup-iters": (SCHEDULE, "lr_warmup_iters"),
    "--lr-warmup-samples": (SCHEDULE, "lr_warmup_samples"),
    "--warmup": ("megatron/arguments.py", "warmup"),  # deprecated -> warmup fraction/iters
    "--min-lr": (SCHED, "min_lr"),
    "--override-opt_param-scheduler": (SCHED, "override_opt_param_scheduler"),
    "--use-checkpoint-opt_param-scheduler": (SCHED, "use_checkpoint_opt_param_scheduler"),
    # checkpointing
    "--save": (TRAIN, "save"),
    "--save-interval": (TRAIN, "save_interval"),
    "--no-save-optim": (CKPT, "no_save_optim"),
    "--no-save-rng": (CKPT, "no_save_rng"),
    "--load": (TRAIN, "load"),
    "--no-load-optim": (CKPT, "no_load_optim"),
    "--no-load-rng": ("megatron/checkpoint_preflight.py", "no_load_rng"),
    "--finetune": (CKPT, "finetune"),
    "--no-initialization": (LAYERS, "perform_initialization"),
    "--use-checkpoint-args": ("megatron/arguments.py", "use_checkpoint_args"),
    "--exit-on-missing-checkpoint": (CKPT, "exit_on_missing_checkpoint"),
    # mixed precision
    "--fp16": (OPTIM, "fp16"),
    "--bf16": (OPTIM, "bf16"),
    "--loss-scale": (OPTIM, "loss_scale"),
    "--initial-loss-scale": (OPTIM, "initial_loss_scale"),
    "--min-loss-scale": (OPTIM, "min_loss_scale"),
    "--loss-scale-window": (OPTIM, "loss_scale_window"),
    "--hysteresis": (OPTIM, "hysteresis"),
    "--fp32-residual-connection": (LAYERS, "fp32_residual_connection"),
    "--accumulate-allreduce-grads-in-fp32": (DDP, "accumulate_allreduce_grads_in_fp32"),
    "--fp16-lm-cross-entropy": (GPT, "fp16_lm_cross_entropy"),
    # distributed
    "--tensor-model-parallel-size": ("megatron/initialize.py", "parallel.tp_size"),
    "--pipeline-model-parallel-size": ("megatron/initialize.py", "parallel.pp_size"),
    "--model-parallel-size": ("megatron/arguments.py", "model_parallel_size"),  # deprecated
    "--num-layers-per-virtual-pipeline-stage":
        (PARALLEL, "num_layers_per_virtual_pipeline_stage"),  # -> virtual_pp_size
    "--overlap-p2p-communication": (STEP, "overlap_p2p_comm"),
    "--distributed-backend": (VALIDATE, "distributed_backend"),  # nccl iff CUDA, warned
    "--distributed-timeout-minutes": ("megatron/initialize.py", "distributed_timeout_minutes"),
    "--DDP-impl": (DDP, "ddp_impl"),
    # refused where Megatron asserts (fp32 accumulation, distributed optimizer), else warned
    # as without effect: the local DDP always keeps contiguous gradient buffers
    "--no-contiguous-buffers-in-local-ddp": (VALIDATE, "use_contiguous_buffers_in_local_ddp"),
    # Kept in args as given (None under torchrun, as Megatron-LM); the device comes from
    # $LOCAL_RANK, which torchrun and torch.distributed.launch always set.
    "--local_rank": ("megatron/arguments.py", "local_rank"),
    "--use-cpu-initialization": ("megatron/core/tensor_parallel/layers.py",
                                 "use_cpu_initialization"),
    "--empty-unused-memory-level": (STEP, "empty_unused_memory_level"),
    "--standalone-embedding-stage": ("megatron/core/models/gpt/stages.py",
                                     "standalone_embedding_stage"),
    "--use-distributed-optimizer": (DDP, "use_distributed_optimizer"),
    # validation
    "--eval-iters": (TRAIN, "eval_iters"),
    "--eval-interval": (TRAIN, "eval_interval"),
    "--skip-train": (TRAIN, "skip_train"),
    # data
    "--data-path": (DATA, "data_path"),
    "--split": (DATA, "split"),
    "--train-data-path": (DATA, "train_data_path"),
    "--valid-data-path": (DATA, "valid_data_path"),
    "--test-data-path": (DATA, "test_data_path"),
    "--data-cache-path": (DATA, "data_cache_path"),
    "--vocab-size": (DATA, "vocab_size"),
    "--vocab-file": (DATA, "vocab_file"),
    "--merge-file": (DATA, "merge_file"),
    "--vocab-extra-ids": (DATA, "vocab_extra_ids"),
    "--seq-length": (DATA, "seq_length"),
    "--encoder-seq-length": (VALIDATE, "encoder_seq_length"),  # mirror of --seq-length
    "--num-workers": (LOADER, "num_workers"),
    "--tokenizer-type": (DATA, "tokenizer_type"),
    "--tokenizer-model": (DATA, "tokenizer_model"),
    "--reset-position-ids": (LOADER, "reset_position_ids"),
    "--reset-attention-mask": (LOADER, "reset_attention_mask"),
    "--eod-mask-loss": (LOADER, "eod_mask_loss"),
    # logging
    "--log-params-norm": (INTERVAL_LOG, "log_params_norm"),
    "--log-num-zeros-in-grad": (OPTIM, "log_num_zeros_in_grad"),
    "--timing-log-level": (STEP, "timing_log_level"),
    "--no-barrier-with-level-1-timing": (STEP, "barrier_with_L1_time"),
    "--timing-log-option": (STEP, "timing_log_option"),
    "--tensorboard-log-interval": (INTERVAL_LOG, "tensorboard_log_interval"),
    "--tensorboard-queue-size": (LOGS, "tensorboard_queue_size"),
    "--log-timers-to-tensorboard": (STEP, "log_timers_to_tensorboard"),
    "--log-batch-size-to-tensorboard": (LOGS, "log_batch_size_to_tensorboard"),
    "--no-log-learnig-rate-to-tensorboard": (LOGS, "log_learning_rate_to_tensorboard"),
    "--no-log-loss-scale-to-tensorboard": (LOGS, "log_loss_scale_to_tensorboard"),
    "--log-validation-ppl-to-tensorboard": (LOGS, "log_validation_ppl_to_tensorboard"),
    "--log-memory-to-tensorboard": (STEP, "log_memory_to_tensorboard"),
    "--log-world-size-to-tensorboard": (LOGS, "log_world_size_to_tensorboard"),
    # our extensions
    "--config": ("megatron/arguments.py", "load_yaml_config"),
    "--dry-run": ("pretrain_gpt.py", "dry_run"),
    "--mock-data": (DATA, "mock_data"),
    "--compile": (LAYERS, "compile_layers"),
    "--no-compile": (LAYERS, "compile_layers"),
    "--compile-mode": (LAYERS, "compile_mode"),
    "--attention-backend": (LAYERS, "attention_backend"),
    "--compile-scope": (LAYERS, "compile_scope"),
    "--adam-kernel": ("megatron/core/optimizer/optimizer.py", "adam_kernel"),
    "--cuda-graph-step": ("megatron/step_graph.py", "cuda_graph_step"),
    "--cublas-workspace": ("pretrain_gpt.py", "cublas_workspace"),
    "--cross-entropy-kernel": ("megatron/core/models/gpt/gpt_model.py", "cross_entropy_kernel"),
    "--gelu-kernel": ("megatron/core/models/gpt/transformer.py", "gelu_kernel"),
    "--gemm-algorithms": ("megatron/gemm_choice.py", "gemm_algorithms"),
    "--normalization": (NORMS, "normalization"),
    "--group-query-attention": (VALIDATE, "group_query_attention"),  # -> num_query_groups
    "--num-query-groups": (LAYERS, "num_query_groups"),
    # -> ModelConfig's add_position_embedding and use_rotary_position_embeddings
    "--position-embedding-type": (GPT, "use_rotary_position_embeddings"),
    "--rotary-base": (GPT, "rotary_base"),
    "--overlap-grad-reduce": (DDP, "overlap_grad_reduce"),
    "--no-overlap-grad-reduce": (DDP, "overlap_grad_reduce"),
    "--ddp-bucket-size": (DDP, "ddp_bucket_size"),
    "--overlap-param-gather": (DDP, "overlap_param_gather"),
    "--async-tensor-model-parallel-allreduce": (LAYERS, "async_tensor_model_parallel_allreduce"),
    "--gradient-accumulation-fusion": (LAYERS, "gradient_accumulation_fusion"),
    "--gpu-memory-gb": ("megatron/arguments_report.py", "gpu_memory_gb"),
    "--nan-loss-policy": (TRAIN, "nan_loss_policy"),
    "--async-save": (CKPT, "async_save"),
    "--profile": (PROF, "profile"),
    "--profile-step-start": (PROF, "profile_step_start"),
    "--profile-step-end": (PROF, "profile_step_end"),
    "--profile-ranks": (PROF, "profile_ranks"),
    "--record-memory-history": ("megatron/memory_history.py", "record_memory_history"),
    "--memory-snapshot-path": ("megatron/memory_history.py", "memory_snapshot_path"),
}

# Definitions are not consumers.
_NOT_CONSUMERS = {"megatron/config.py", "megatron/core/config.py", "megatron/arguments_table.py",
                  "megatron/arguments_common.py"}


def _refused(spec) -> bool:
    if spec.flag in NOT_SUPPORTED:
        return True
    return spec.group in NOT_SUPPORTED_GROUPS and spec.flag not in ALLOWED_IN_REJECTED_GROUPS


def _accepted():
    return {flag for flag, spec in FLAG_SPECS.items() if not _refused(spec)}


def test_every_accepted_flag_is_implemented_or_declared_without_effect():
    accepted = _accepted()
    missing = sorted(accepted - set(IMPLEMENTED_BY) - set(NO_EFFECT))
    assert not missing, f"accepted flags with no implementing module listed: {missing}"
    both = sorted(set(IMPLEMENTED_BY) & set(NO_EFFECT))
    assert not both, f"listed as implemented and as without effect: {both}"
    stale = sorted(set(IMPLEMENTED_BY) - accepted)
    assert not stale, f"listed but refused or unknown to the parser: {stale}"
    refused_no_effect = sorted(set(NO_EFFECT) - accepted)
    assert not refused_no_effect, f"NO_EFFECT flags that are refused: {refused_no_effect}"
    assert all(len(reason) > 20 for reason in NO_EFFECT.values())


@pytest.mark.parametrize("flag", sorted(IMPLEMENTED_BY))
def test_implementing_module_reads_the_flag(flag):
    module, name = IMPLEMENTED_BY[flag]
    assert module not in _NOT_CONSUMERS, f"{flag}: {module} only defines it"
    path = ROOT / module
    assert path.is_file(), f"{flag}: {module} does not exist"
    pattern = r"(?<![\w])" + re.escape(name) + r"(?![\w])"
    assert re.search(pattern, path.read_text()), f"{flag}: {module} never mentions {name!r}"


def test_no_effect_flags_are_not_read_by_the_model():
    """A NO_EFFECT flag whose dest the model code reads would be lying."""
    model_code = "".join((ROOT / m).read_text() for m in (GPT, LAYERS, NORMS, STEP, TRAIN))
    for flag in NO_EFFECT:
        dest = FLAG_SPECS[flag].dest
        assert not re.search(r"\." + re.escape(dest) + r"\b", model_code), flag


# --------------------------------------------------------------------- behaviours
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "100", "--num-workers", "0"]


def test_logging_flags_from_the_cli(tmp_path, capsys):
    import pretrain_gpt
    from megatron.logging_utils import read_scalars

    tb = tmp_path / "tb"
    assert pretrain_gpt.main(TINY + [
        "--train-iters", "6", "--log-interval", "3", "--eval-iters", "0",
        "--tensorboard-dir", str(tb), "--tensorboard-log-interval", "2",
        "--timing-log-level", "2", "--timing-log-option", "max", "--log-timers-to-tensorboard",
        "--log-params-norm", "--log-num-zeros-in-grad", "--log-batch-size-to-tensorboard",
        "--log-world-size-to-tensorboard", "--no-log-learnig-rate-to-tensorboard",
        "--empty-unused-memory-level", "2"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith(" iteration ")]
    assert len(lines) == 2 and all(" num zeros: " in x and " params norm: " in x for x in lines)
    # the setup block (level-0 timers), then one block per iteration line
    assert out.count("(min, max) time across ranks (ms):") == 3  # Megatron's header for max too
    assert not re.search(r"    forward-backward \.+: \(", out)  # the max only
    for timer in ("forward-backward", "batch-generator", "grads-all-reduce", "optimizer"):
        assert f"    {timer} " in out
    scalars = read_scalars(str(tb))
    assert [s for s, _ in scalars["batch-size"]] == [2, 4, 6]  # every 2nd iteration
    assert [s for s, _ in scalars["num-zeros"]] == [2, 4, 6]
    assert [s for s, _ in scalars["params-norm"]] == [2, 4, 6]  # as every other scalar
    assert scalars["world-size"][0][1] == 1.0 and "learning-rate" not in scalars
    assert {"forward-backward-time", "optimizer-time", "iteration-time"} <= set(scalars)


def test_timing_level_0_creates_no_timers(tmp_path):
    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel.random import RNGStatesTracker
    from megatron.initialize import Runtime, set_random_seed
    from megatron.train_step import step_log
    from megatron.training import build_trainer, data_iterator, train_step
    from tests.gpt_helpers import tiny_config

    cfg = tiny_config(iters=2)
    cfg.data.num_workers = 0
    rt = Runtime(ParallelState.build(1, 0), __import__("torch").device("cpu"),
                 RNGStatesTracker(), "gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    train_step(tr, data_iterator(cfg, rt, "train", 0))
    assert step_log(tr).timers.names() == []  # level 0: every timer is a no-op


def test_skip_train_and_eval_interval_zero(capsys):
    import pretrain_gpt

    assert pretrain_gpt.main(TINY + ["--skip-train", "--eval-iters", "2"]) == 0
    out = capsys.readouterr().out
    assert not [x for x in out.splitlines() if x.startswith(" iteration ")]
    assert "validation loss at iteration 0 on 8-sample draw from validation set" in out
    assert pretrain_gpt.main(TINY + ["--train-iters", "2", "--eval-iters", "1",
                                     "--eval-interval", "0", "--log-interval", "1"]) == 0
    out = capsys.readouterr().out
    assert len([x for x in out.splitlines() if x.startswith(" iteration ")]) == 2
    assert "validation loss" not in out
