"""Cross-flag validation and derived values (Megatron-LM 23.05 `validate_args` and friends),
then the config dataclasses.

`validate_args(ns, world_size)` runs once, before any process group exists. Each rule's
message names the values involved and the fix. Where Megatron silently rewrote a value we
either keep Megatron's rewrite and warn, or keep the user's value and warn (--ffn-hidden-size
with --swiglu): never silently.

Parts live beside it: single-value ranges (arguments_ranges.py), run length and lr
schedule (arguments_schedule.py), data-path/split syntax and tokenizer files
(arguments_inputs.py), the parallel layout and recomputation (arguments_parallel.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Mapping, Optional, Set

from megatron.arguments_common import ALIASES, ArgumentsError, machine_checks, note, spelled, warn
from megatron.arguments_inputs import (
    absent_tokenizer_files,
    assumed_vocab_size,
    check_data_inputs,
    check_output_paths,
    check_tokenizer_files,
    check_tokenizer_type,
    default_vocab_size,
    warn_unread_tokenizer_flags,
)
from megatron.arguments_parallel import (
    nearby_multiples,
    resolve_parallel,
    resolve_recompute,
    resolve_virtual_pipeline,
)
from megatron.arguments_ranges import (
    check_rotary_width,
    check_value_ranges,
    warn_unread_checkpoint_flags,
    warn_unread_evaluation_flags,
    warn_unread_tensorboard_flags,
    warn_unread_tuning_flags,
)
from megatron.arguments_schedule import (
    check_run_length,
    resolve_iterations,
    schedule_steps,
    warn_unfinished_warmup,
)
from megatron.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)
from megatron.core.config import position_embedding_type_for

if TYPE_CHECKING:  # imported where used: `--help` and a mistyped flag need no torch
    import torch

# Attributes Megatron deletes after mapping them; they never reach Config.args.
_DELETED = ("batch_size", "warmup", "model_parallel_size", "checkpoint_activations",
            "recompute_activations")


def pad_vocab_size(orig_vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Smallest multiple of `divisible_by * tp_size` that is >= `orig_vocab_size`
    (50257 -> 50304 at tp 1, 50432 at tp 2, 50688 at tp 4, 51200 at tp 8 with 128)."""
    if divisible_by < 1 or tp_size < 1:
        raise ArgumentsError(f"--make-vocab-size-divisible-by {divisible_by} and tensor-parallel "
                             f"size {tp_size} must both be >= 1")
    multiple = divisible_by * tp_size
    return -(-orig_vocab_size // multiple) * multiple


def _check_required(ns, origins: Dict[str, str]) -> None:
    """Megatron's required flags, all missing ones in one message; mirrors num_layers /
    encoder_num_layers and seq_length / encoder_seq_length (`origins`: an alias given)."""
    for main, mirror in (("num_layers", "encoder_num_layers"), ("seq_length", "encoder_seq_length")):
        a, b = getattr(ns, main), getattr(ns, mirror)
        if a is not None and b is not None:
            raise ArgumentsError(f"--{main.replace('_', '-')} {a} and --{mirror.replace('_', '-')} "
                                 f"{b} name the same thing; pass only --{main.replace('_', '-')}")
        origins.update({main: ALIASES[main]} if a is None and b is not None else {})
        setattr(ns, main, a if a is not None else b)
        setattr(ns, mirror, getattr(ns, main))
    names = ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "max_position_embeddings", "micro_batch_size", "lr"]
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(ns, n) is None]
    if ns.train_iters is None and ns.train_samples is None and not ns.skip_train:
        missing.append("--train-iters or --train-samples (or --skip-train)")
    if missing:
        raise ArgumentsError("missing required flags: " + ", ".join(missing))
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "max_position_embeddings", "micro_batch_size"):
        if getattr(ns, name) <= 0:
            raise ArgumentsError(f"{spelled(ns, name, origins)} must be > 0")
    if ns.seed <= 0:
        raise ArgumentsError(f"--seed {ns.seed} must be > 0 (Megatron-LM seeds rank r with "
                             "seed + 100 * pp_rank)")


def _check_experts(ns) -> None:
    """--num-experts (the switch MLP) with sequence parallelism is refused, as Megatron-LM
    23.05 cannot run it either: each tensor-parallel rank would route its own slice of the
    sequence through experts whose weights are split over those same ranks."""
    if ns.num_experts is not None and ns.sequence_parallel:
        raise ArgumentsError(
            f"--sequence-parallel cannot be used with --num-experts {ns.num_experts}: the "
            "switch MLP routes whole sequences on every tensor-parallel rank (its experts "
            "are split over those ranks), as in Megatron-LM 23.05; drop --sequence-parallel")


def _resolve_batch(ns) -> None:
    """Global batch default and divisibility, micro-batches per step."""
    mbs, dp = ns.micro_batch_size, ns.data_parallel_size
    if ns.global_batch_size is None:
        ns.global_batch_size = mbs * dp
        note(f"setting global batch size to {ns.global_batch_size} (--micro-batch-size {mbs} "
             f"x data-parallel size {dp})")
    gbs = ns.global_batch_size
    if gbs <= 0 or gbs % (mbs * dp):
        raise ArgumentsError(
            f"--global-batch-size {gbs} is not a positive multiple of --micro-batch-size {mbs} "
            f"x data-parallel size {dp} = {mbs * dp}; use a multiple of {mbs * dp}")
    ns.num_micro_batches = gbs // (mbs * dp)
    if ns.rampup_batch_size is None:  # else the ramp-up is announced (resolve_iterations)
        note(f"setting number of micro-batches to constant {ns.num_micro_batches}")


def _resolve_model_shape(ns, origins: Optional[Mapping[str, str]] = None) -> None:
    """ffn size (SwiGLU rule), kv channels, GQA groups, lengths, activation, positions."""
    h, heads = ns.hidden_size, ns.num_attention_heads
    _resolve_ffn(ns)
    kv_given = ns.kv_channels is not None
    if ns.kv_channels is None:
        if h % heads:
            raise ArgumentsError(f"--hidden-size {h} is not divisible by --num-attention-heads "
                                 f"{heads}; change one or pass --kv-channels")
        ns.kv_channels = h // heads
    _resolve_query_groups(ns)
    if ns.seq_length > ns.max_position_embeddings:
        raise ArgumentsError(f"{spelled(ns, 'seq_length', origins)} is larger than "
                             f"--max-position-embeddings {ns.max_position_embeddings}; raise "
                             f"--max-position-embeddings to at least {ns.seq_length}")
    _check_activation_switches(ns)
    if ns.apply_layernorm_1p and ns.normalization == "RMSNorm":
        raise ArgumentsError("--apply-layernorm-1p applies to LayerNorm; drop it or use "
                             "--normalization LayerNorm")
    if not ns.add_bias_linear:
        ns.bias_gelu_fusion = False  # as Megatron-LM: nothing to fuse
    ns.activation = activation_of(ns)
    if ns.gelu_kernel == "epilogue" and ns.activation not in ("gelu", "openai_gelu"):
        raise ArgumentsError(
            f"--gelu-kernel epilogue puts the MLP's GeLU into fc1's product: this run's "
            f"activation is {ns.activation}; drop the flag or use a GeLU activation")
    _resolve_position_embedding(ns)
    check_rotary_width(ns, kv_given)


def _check_activation_switches(ns) -> None:
    """Several activation switches: Megatron-LM 23.05's MLP takes the first of --openai-gelu,
    --swiglu, --squared-relu (warned). --swiglu still doubles fc1's width there, so with
    --openai-gelu its first forward pass fails on the shapes: refused here."""
    if ns.swiglu and ns.openai_gelu:
        raise ArgumentsError("--swiglu and --openai-gelu are exclusive: Megatron-LM 23.05 "
                             "builds the SwiGLU's double-width fc1 but applies the tanh GeLU, "
                             "and fails at the first forward pass; pass one")
    chosen = [f for f, on in (("--openai-gelu", ns.openai_gelu), ("--swiglu", ns.swiglu),
                              ("--squared-relu", ns.squared_relu)) if on]
    if len(chosen) > 1:
        warn(f"{' and '.join(chosen)} given; {chosen[0]} wins, {chosen[1]} is ignored "
             "(Megatron-LM's precedence)")


def activation_of(ns) -> str:
    """The MLP activation Megatron-LM 23.05 runs for these switches (first of --openai-gelu,
    --swiglu, --squared-relu, the order of its MLP; else GeLU). Its MLP with biases (its
    default) adds fc1's bias and applies the GeLU in one fused kernel, and that kernel
    computes the tanh form ("openai_gelu"); without biases or with --no-bias-gelu-fusion it
    is torch's erf GeLU. Same here. Reads attributes only (a validated namespace, or a
    checkpoint's args)."""
    for flag, name in (("openai_gelu", "openai_gelu"), ("swiglu", "swiglu"),
                       ("squared_relu", "squared_relu")):
        if getattr(ns, flag, False):
            return name
    fused = getattr(ns, "add_bias_linear", True) and getattr(ns, "bias_gelu_fusion", True)
    return "openai_gelu" if fused else "gelu"


def _resolve_query_groups(ns) -> None:
    tp, heads = ns.tensor_model_parallel_size, ns.num_attention_heads
    if not ns.group_query_attention:
        if ns.num_query_groups is not None:
            raise ArgumentsError(f"--num-query-groups {ns.num_query_groups} needs "
                                 "--group-query-attention")
        return
    default = ns.num_query_groups is None  # one group: a message says it was not typed
    groups = ns.num_query_groups = 1 if default else ns.num_query_groups
    if groups < 1 or heads % groups:
        raise ArgumentsError(f"--num-attention-heads {heads} is not divisible by "
                             f"--num-query-groups {groups}; use a group count that divides {heads}")
    if groups % tp:
        fits = [g for g in range(tp, heads + 1, tp) if heads % g == 0]  # heads % tp == 0
        named = " (the default with --group-query-attention)" if default else ""
        raise ArgumentsError(f"--num-query-groups {groups}{named} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; every tensor-parallel rank needs "
                             f"whole key/value groups: use --num-query-groups {fits[0]} (a "
                             f"multiple of {tp} that divides --num-attention-heads {heads})")


SWIGLU_WIDTH_KEPT = "--swiglu with --ffn-hidden-size"  # the warning's start (from-hf drops it)


def _resolve_ffn(ns) -> None:
    """The MLP width: --ffn-hidden-size, else --swiglu's rule or 4 x hidden. Its (each
    expert's) fc1 columns and fc2 rows are split over the tensor-parallel ranks, so it must
    divide by tp (else the model build fails on every rank). A derived width is named as
    such: the user typed no --ffn-hidden-size, and passing one is the fix."""
    h, tp, derived = ns.hidden_size, ns.tensor_model_parallel_size, None
    if ns.swiglu:
        rule = int((4 * h * 2 / 3) / 64) * 64
        if ns.ffn_hidden_size is None:
            ns.ffn_hidden_size = rule
            derived = f"--swiglu's int(4 x --hidden-size {h} x 2/3 / 64) x 64"
        elif ns.ffn_hidden_size != rule:
            warn(f"{SWIGLU_WIDTH_KEPT} {ns.ffn_hidden_size}: the MLP width is this value; "
                 f"Megatron-LM 23.05 ignores the flag under --swiglu and uses {rule} (int(4 x "
                 f"--hidden-size {h} x 2/3 / 64) x 64), so its runs and checkpoints differ "
                 "from this model. Nothing to do unless you mean to match a 23.05 run: then "
                 "leave --ffn-hidden-size out")
    elif ns.ffn_hidden_size is None:
        ns.ffn_hidden_size = 4 * h
        derived = f"4 x --hidden-size {h}"
    ffn = ns.ffn_hidden_size
    if ffn < 1:  # only the --swiglu rule gives 0 (a given width is range-checked)
        raise ArgumentsError(f"the MLP width 0 ({derived}; no --ffn-hidden-size given) leaves "
                             f"the MLP empty: the rule needs --hidden-size 24 or more; pass "
                             f"--ffn-hidden-size (e.g. {max(tp, 4 * h * 2 // 3 // tp * tp)}) "
                             "or a larger --hidden-size")
    if ffn % tp == 0:
        return
    sizes = nearby_multiples(ffn, tp)
    if derived is None:
        raise ArgumentsError(f"--ffn-hidden-size {ffn} is not divisible by "
                             f"--tensor-model-parallel-size {tp}: each tensor-parallel rank "
                             f"holds ffn/tp columns of the MLP; use an ffn size that is a "
                             f"multiple of {tp} ({sizes}) or another tp size")
    raise ArgumentsError(f"the MLP width {ffn} ({derived}; no --ffn-hidden-size given) is not "
                         f"divisible by --tensor-model-parallel-size {tp}: each tensor-parallel "
                         f"rank holds ffn/tp columns of the MLP; pass --ffn-hidden-size with a "
                         f"multiple of {tp} ({sizes}) or use another tp size")


def _resolve_position_embedding(ns) -> None:
    """--position-embedding-type from Megatron-LM 23.05's two switches when not given:
    --use-rotary-position-embeddings alone gives rope+learned (both, as Megatron builds),
    with --no-position-embedding rope. A type given explicitly must agree with the switches
    the user set; rope (later Megatron's meaning: rotary only) also takes
    --use-rotary-position-embeddings, and --no-position-embedding (later Megatron-LM
    scripts pass `--position-embedding-type rope --no-position-embedding`)."""
    rotary, learned = ns.use_rotary_position_embeddings, ns.add_position_embedding
    legacy = position_embedding_type_for(rotary, learned)
    kind = ns.position_embedding_type
    if kind is None:
        ns.position_embedding_type = legacy
    elif kind != legacy and (rotary or not learned) and kind != "rope":
        raise ArgumentsError(f"--position-embedding-type {kind} contradicts the legacy flags "
                             f"(which give {legacy}); pass one")
    ns.use_rotary_position_embeddings = ns.position_embedding_type in ("rope", "rope+learned")
    ns.add_position_embedding = ns.position_embedding_type in ("learned_absolute",
                                                               "rope+learned")


def _resolve_precision(ns, explicit: Set[str]) -> None:
    if ns.fp16 and ns.bf16:
        raise ArgumentsError("--fp16 and --bf16 are exclusive; pass one")
    import torch

    ns.params_dtype = torch.float16 if ns.fp16 else torch.bfloat16 if ns.bf16 else torch.float32
    if ns.bf16 and not ns.accumulate_allreduce_grads_in_fp32:
        note("accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
        ns.accumulate_allreduce_grads_in_fp32 = True
    note(f"using {ns.params_dtype} for parameters ...")  # Megatron-LM's line, log parsers read it
    if ns.fp16_lm_cross_entropy and not ns.fp16:
        raise ArgumentsError("--fp16-lm-cross-entropy needs --fp16")
    if ns.fp32_residual_connection and not (ns.fp16 or ns.bf16):
        raise ArgumentsError("--fp32-residual-connection needs --fp16 or --bf16")
    if ns.sequence_parallel and ns.async_tensor_model_parallel_allreduce:
        if "async_tensor_model_parallel_allreduce" in explicit:
            warn("--async-tensor-model-parallel-allreduce is turned off by --sequence-parallel")
        ns.async_tensor_model_parallel_allreduce = False


def _check_grad_buffers(ns) -> None:
    """Megatron's rule: fp32 gradient accumulation (which --bf16 turns on) and the
    distributed optimizer need --DDP-impl local with contiguous gradient buffers. The local
    DDP here always keeps contiguous buffers, so --no-contiguous-buffers-in-local-ddp is
    either refused (where Megatron asserts) or without effect (warned)."""
    users = []
    if ns.accumulate_allreduce_grads_in_fp32:
        users.append("--bf16 (gradients accumulated and all-reduced in fp32)" if ns.bf16
                     else "--accumulate-allreduce-grads-in-fp32")
    if ns.use_distributed_optimizer:
        users.append("--use-distributed-optimizer")
    what = " and ".join(users)
    if users and ns.DDP_impl != "local":
        raise ArgumentsError(f"{what} needs --DDP-impl local (got {ns.DDP_impl}); drop "
                             f"--DDP-impl {ns.DDP_impl}")
    if ns.use_contiguous_buffers_in_local_ddp:
        return
    if users:
        raise ArgumentsError(f"--no-contiguous-buffers-in-local-ddp cannot be used with {what}, "
                             f"which {'need' if len(users) > 1 else 'needs'} contiguous gradient "
                             "buffers (Megatron-LM asserts the same); drop "
                             "--no-contiguous-buffers-in-local-ddp")
    warn("--no-contiguous-buffers-in-local-ddp has no effect here: the local DDP always keeps "
         "gradients in contiguous buffers")


def _resolve_data_parallel(ns) -> None:
    """Megatron's --DDP-impl rules: fp32 gradient accumulation and the distributed optimizer
    (_check_grad_buffers) and pipeline parallelism need the local DDP;
    --overlap-param-gather needs the distributed optimizer."""
    _check_grad_buffers(ns)
    if ns.DDP_impl == "torch":  # as Megatron-LM (its arguments dump shows it): no local DDP
        ns.use_contiguous_buffers_in_local_ddp = False
    if ns.DDP_impl == "torch" and ns.pipeline_model_parallel_size > 1:
        raise ArgumentsError(
            f"--pipeline-model-parallel-size {ns.pipeline_model_parallel_size} needs "
            "--DDP-impl local (got torch), as in Megatron-LM; drop --DDP-impl torch")
    if ns.overlap_param_gather and not ns.use_distributed_optimizer:
        raise ArgumentsError("--overlap-param-gather needs --use-distributed-optimizer")
    if ns.overlap_param_gather and ns.compile_layers:
        raise ArgumentsError("--overlap-param-gather waits for parameters in module forward "
                             "hooks, which torch.compile cannot trace; drop --compile")
    if ns.overlap_param_gather and ns.compile_layers is None:
        note("--overlap-param-gather: transformer layers are not compiled (as with --no-compile)")
        ns.compile_layers = False


def _resolve_optimizer(ns, explicit: Set[str]) -> None:
    warn_unread_tuning_flags(ns, explicit)
    if ns.override_opt_param_scheduler and ns.use_checkpoint_opt_param_scheduler:
        raise ArgumentsError("--override-opt_param-scheduler (take the schedule from the command "
                             "line) and --use-checkpoint-opt_param-scheduler (take it from the "
                             "checkpoint) contradict each other; pass at most one")
    if ns.lr < 0 or ns.min_lr < 0 or ns.min_lr > ns.lr:
        raise ArgumentsError(f"--min-lr {ns.min_lr} must be >= 0 and <= --lr {ns.lr}")
    style, start, end = ns.weight_decay_incr_style, ns.start_weight_decay, ns.end_weight_decay
    if style == "constant":
        if start is not None or end is not None:
            raise ArgumentsError("--start-weight-decay/--end-weight-decay need "
                                 "--weight-decay-incr-style linear or cosine; with the constant "
                                 "style use --weight-decay")
        ns.start_weight_decay = ns.end_weight_decay = ns.weight_decay
    elif start is None or end is None:
        raise ArgumentsError(f"--weight-decay-incr-style {style} needs both --start-weight-decay "
                             f"and --end-weight-decay (got {start} and {end})")
    elif not 0 <= ns.start_weight_decay <= ns.end_weight_decay:
        raise ArgumentsError(f"--start-weight-decay {start} must be >= 0 and <= "
                             f"--end-weight-decay {end}")


def _resolve_runtime(ns, explicit: Set[str], cuda_available: bool) -> None:
    """Checkpoint/loader defaults, backend and compile choices, tokenizer default."""
    if ns.save is not None and ns.save_interval is None:
        raise ArgumentsError(f"--save {ns.save} needs --save-interval N (iterations between saves)")
    if ns.nan_loss_policy == "rollback" and ns.save is None:
        # Found out at the first NaN otherwise, maybe hours in, with nothing to reload.
        raise ArgumentsError("--nan-loss-policy rollback reloads the last checkpoint that --save "
                             "wrote, and there is no --save; add --save DIR --save-interval N, "
                             "or use --nan-loss-policy skip")
    if ns.mock_data and (ns.data_path or ns.train_data_path):
        raise ArgumentsError("--mock-data and --data-path/--train-data-path are exclusive")
    if ns.mock_data and (ns.valid_data_path or ns.test_data_path):
        # Mock data replaces every split: the files would be silently left unread.
        given = "/".join(f for f, v in (("--valid-data-path", ns.valid_data_path),
                                        ("--test-data-path", ns.test_data_path)) if v)
        raise ArgumentsError(f"--mock-data and {given} are exclusive: --mock-data gives every "
                             "split (train, validation, test) random tokens; drop "
                             f"{given}, or drop --mock-data and pass --train-data-path")
    if ns.mock_data and "split" in explicit:
        warn(f"--split {ns.split} has no effect: --mock-data gives each split (train, "
             "validation, test) random tokens of its own, whatever the shares")
    if ns.dataloader_type is None:
        ns.dataloader_type = "single"
    if not ns.data_sharding and ns.dataloader_type != "cyclic":
        warn("--no-data-sharding has no effect without --dataloader-type cyclic (the single "
             "loader reads consecutive samples)")
    if not ns.perform_initialization and ns.load is None:
        warn("--no-initialization without --load: the weights start as uninitialised memory")
    warn_unread_tensorboard_flags(ns, explicit)
    warn_unread_checkpoint_flags(ns, explicit)
    warn_unread_evaluation_flags(ns, explicit)
    if ns.log_memory_to_tensorboard and ns.tensorboard_dir is not None and not cuda_available:
        warn("--log-memory-to-tensorboard has no effect without CUDA (no allocator statistics)")
    # (not for a --dry-run without CUDA: a GPU job planned on a login node)
    if ns.empty_unused_memory_level and not cuda_available and not ns.dry_run:
        warn(f"--empty-unused-memory-level {ns.empty_unused_memory_level} has no effect without "
             "CUDA (it returns the CUDA caching allocator's unused memory to the driver)")
    backend = "nccl" if cuda_available else "gloo"
    if "distributed_backend" in explicit and ns.distributed_backend != backend:
        warn(f"--distributed-backend {ns.distributed_backend} ignored: using {backend} "
             f"(CUDA {'available' if cuda_available else 'not available'})")
    ns.distributed_backend = backend
    if ns.compile_layers is None:
        ns.compile_layers = cuda_available
    if ns.compile_scope == "auto":
        # Per-layer graphs that end with the next norm: as fast as one graph for the stack
        # (benchmarks/RESULTS.md), a third of its cold compile time, and fit for overlapped
        # DP reduction and full recompute alike.
        ns.compile_scope = "layer"
    if ns.compile_scope == "block" and ns.recompute_granularity == "full":
        raise ArgumentsError("--compile-scope block compiles the layer stack as one graph, which "
                             "full activation recompute splits per layer; use --compile-scope "
                             "layer with --recompute-granularity full")
    with machine_checks(), _planned_elsewhere(ns, cuda_available):  # CUDA may differ by node
        _check_cuda_features(ns, cuda_available)
    if ns.attention_backend in ("flash", "cudnn") and ns.reset_attention_mask:
        raise ArgumentsError(f"--attention-backend {ns.attention_backend} has no kernel for the "
                             "per-document mask of --reset-attention-mask; use auto or "
                             f"{'efficient' if cuda_available else 'math'}")
    if ns.tokenizer_type is None:
        ns.tokenizer_type = "GPT2BPETokenizer"


@contextlib.contextmanager
def _planned_elsewhere(ns, cuda_available: bool) -> Iterator[None]:
    """A --dry-run on a machine without CUDA (a GPU job planned on a login node) notes the
    refusal of a CUDA-only choice (--record-memory-history, --cuda-graph-step on, a CUDA
    kernel or attention backend, --gemm-algorithms FILE) instead of failing on it: the run
    checks it again on its GPUs."""
    try:
        yield
    except ArgumentsError as err:
        if cuda_available or not ns.dry_run:
            raise
        warn(f"not checked on this machine, which has no CUDA (the run checks it on its "
             f"GPUs): {err.message}")


def _check_cuda_features(ns, cuda_available: bool) -> None:
    """`--cuda-graph-step on` and the CUDA-only attention backends, against the device."""
    if ns.cuda_graph_step == "on":
        from megatron.step_graph import settings_reason

        reason = settings_reason(
            device_type="cuda" if cuda_available else "cpu", world_size=ns.world_size,
            hidden_dropout=ns.hidden_dropout, attention_dropout=ns.attention_dropout,
            nan_loss_policy=ns.nan_loss_policy, timing_log_level=ns.timing_log_level,
            rampup_batch_size=ns.rampup_batch_size,
            empty_unused_memory_level=ns.empty_unused_memory_level,
            compile_mode=ns.compile_mode, adam_kernel=ns.adam_kernel, optimizer=ns.optimizer,
            # the grouped expert dispatch is host-free only in bf16 (checked again on the
            # built model at the first step)
            num_experts=ns.num_experts, experts_sync_free=bool(ns.bf16))
        if reason is not None:
            raise ArgumentsError(f"--cuda-graph-step on, but {reason}; use --cuda-graph-step "
                                 "auto (captures when it can) or off")
    if ns.record_memory_history and not cuda_available:
        raise ArgumentsError("--record-memory-history records the CUDA caching allocator's "
                             "history, and CUDA is not available here; drop the flag")
    if not ns.record_memory_history and ns.memory_snapshot_path != "snapshot.pickle":
        warn(f"--memory-snapshot-path {ns.memory_snapshot_path} has no effect without "
             "--record-memory-history")
    if ns.attention_backend in ("cudnn", "efficient") and not cuda_available:
        raise ArgumentsError(f"--attention-backend {ns.attention_backend} needs CUDA; use auto, "
                             "flash or math on the CPU")
    if not ns.skip_train:
        import torch

        _check_kernel_choices(ns, torch.device("cuda" if cuda_available else "cpu"))


def _check_kernel_choices(ns, device: torch.device) -> None:
    """The kernels a training run insists on (--attention-backend flash, --adam-kernel
    triton, --cross-entropy-kernel triton) where it cannot use them: refused here, with the
    fix, instead of a traceback from every rank at the first training step."""
    if ns.attention_backend == "flash" and device.type == "cpu" and ns.attention_dropout > 0:
        raise ArgumentsError(
            f"--attention-backend flash: the CPU's flash kernel has no dropout, and "
            f"--attention-dropout is {ns.attention_dropout}; use --attention-dropout 0, or "
            "--attention-backend auto or math")
    if ns.adam_kernel == "triton":
        from megatron.core.optimizer.multi_tensor_adam import triton_available

        reason = (f"it steps AdamW, not --optimizer {ns.optimizer}" if ns.optimizer != "adam"
                  else None if triton_available(device)
                  else "Triton cannot run here (it needs CUDA and the triton package)")
        if reason:
            raise ArgumentsError(f"--adam-kernel triton cannot be used: {reason}; use "
                                 "--adam-kernel auto or torch")
    if ns.cross_entropy_kernel == "triton":
        from megatron.core.fused_cross_entropy import use_fused

        reason = use_fused("triton", device, ns.fp16_lm_cross_entropy)
        if reason:
            raise ArgumentsError(f"--cross-entropy-kernel triton cannot be used: {reason}; "
                                 "use --cross-entropy-kernel auto or torch")


def _check_gemm_algorithms(ns, cuda_available: bool) -> None:
    """`--gemm-algorithms auto|none|FILE`: a FILE needs CUDA and must exist (its contents
    are checked against the GPU when the model is built)."""
    path = ns.gemm_algorithms
    if path in (None, "auto", "none"):
        return
    if not cuda_available:
        raise ArgumentsError(f"--gemm-algorithms {path} chooses cuBLASLt algorithms, which "
                             "need CUDA; run without it on the CPU")
    if not os.path.isfile(path):
        raise ArgumentsError(f"--gemm-algorithms {path}: no such file; write one with "
                             "python tools/tune_gemms.py --out FILE -- <your training flags>, "
                             "or give auto (the shipped tables) or none")


def validate_args(
    ns: argparse.Namespace,
    world_size: int,
    *,
    explicit: Optional[Set[str]] = None,
    cuda_available: bool = False,
    vocab_size_fn: Optional[Callable[[argparse.Namespace], int]] = None,
    origins: Optional[Mapping[str, str]] = None,
) -> argparse.Namespace:
    """Check every cross-flag rule and fill the derived values in `ns` (in place, returned):
    data_parallel_size, global_batch_size, num_micro_batches, ffn_hidden_size, kv_channels,
    params_dtype, activation, position_embedding_type, padded_vocab_size, ...

    `explicit` is the set of dests the user set (command line or YAML); `origins` maps a
    dest to the deprecated flag that set it (`arguments.apply_deprecated`), for messages.
    Raises `ArgumentsError` naming the values and the fix."""
    explicit = explicit or set()
    origins = dict(origins or {})
    check_tokenizer_type(ns)  # before the layout lines print: one line, nothing built
    _check_required(ns, origins)
    check_value_ranges(ns)
    resolve_parallel(ns, world_size, origins)
    _check_profile_ranks(ns, world_size)
    _check_experts(ns)
    gbs_defaulted = ns.global_batch_size is None
    _resolve_batch(ns)
    check_run_length(ns, origins)
    resolve_virtual_pipeline(ns, gbs_defaulted)
    resolve_iterations(ns)
    _resolve_model_shape(ns, origins)
    _resolve_precision(ns, explicit)
    _resolve_data_parallel(ns)
    _resolve_optimizer(ns, explicit)
    resolve_recompute(ns, explicit)
    _resolve_runtime(ns, explicit, cuda_available)
    with machine_checks(), _planned_elsewhere(ns, cuda_available):  # CUDA may differ by node
        _check_gemm_algorithms(ns, cuda_available)
    check_data_inputs(ns, explicit)
    check_output_paths(ns)
    with machine_checks():  # files read: may differ between nodes
        check_tokenizer_files(ns, files=not ns.dry_run)
        assumed = ns.dry_run and absent_tokenizer_files(vars(ns))  # listed in the report
        orig = assumed_vocab_size(vars(ns)) if assumed else (vocab_size_fn or default_vocab_size)(ns)
    warn_unread_tokenizer_flags(ns, explicit)
    ns.padded_vocab_size = pad_vocab_size(orig, ns.make_vocab_size_divisible_by,
                                          ns.tensor_model_parallel_size)
    note(f" > padded vocab (size: {orig}{', assumed: tokenizer files missing' if assumed else ''})"
         f" with {ns.padded_vocab_size - orig} dummy tokens (new size: {ns.padded_vocab_size})")
    warn_unfinished_warmup(ns, schedule_steps(ns)["lr_warmup_steps"])  # checks warmup < decay
    # Megatron's counters, 0 at the start (a checkpoint stores the live values), and its
    # fixed-sequence-length switch: in the namespace, so the arguments dump shows them.
    ns.consumed_train_samples = ns.consumed_valid_samples = 0
    ns.variable_seq_lengths = False
    return ns


def _check_profile_ranks(ns: argparse.Namespace, world_size: int) -> None:
    """--profile-ranks outside 0 .. world size - 1: no rank would write those traces
    (a run with none of its ranks listed would profile nothing, without a word)."""
    if not ns.profile:
        return
    outside = [r for r in ns.profile_ranks if not 0 <= r < world_size]
    if outside:
        raise ArgumentsError(
            f"--profile-ranks {' '.join(map(str, ns.profile_ranks))}: rank(s) "
            f"{', '.join(map(str, outside))} not in this run of world size {world_size} "
            f"(global ranks 0 to {world_size - 1}), so no trace would be written for them; "
            f"pass ranks from 0 to {world_size - 1}, e.g. --profile-ranks 0")


# ------------------------------------------------------------------------ building


_RENAMES = {
    ParallelConfig: {"tp_size": "tensor_model_parallel_size",
                     "pp_size": "pipeline_model_parallel_size",
                     "dp_size": "data_parallel_size", "ep_size": "expert_model_parallel_size",
                     "virtual_pp_size": "virtual_pipeline_model_parallel_size",
                     "ddp_impl": "DDP_impl"},
    ModelConfig: {"init_seed": "seed"},
}


def _fill(cls, values: Dict[str, Any]):
    """Build dataclass `cls` from resolved values by field name (see _RENAMES)."""
    renames = _RENAMES.get(cls, {})
    kwargs = {}
    for f in fields(cls):
        key = renames.get(f.name, f.name)
        if key in values:
            value = values[key]
            if value is None and isinstance(f.default, bool):
                value = False  # Megatron's None-default switches (--no-save-optim ...)
            kwargs[f.name] = value
    return cls(**kwargs)


def _plain(value: Any, dtype: type) -> Any:
    """`value` as JSON-able data: a `dtype` (torch.dtype) as its name, a tuple as a list."""
    if isinstance(value, dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v, dtype) for v in value]
    return value


def build_config(ns: argparse.Namespace) -> Config:
    """The config dataclasses from a validated namespace; `Config.args` holds every resolved
    flag value as plain JSON-able data (params_dtype as 'torch.float32' etc.)."""
    values = dict(vars(ns))
    values.update(schedule_steps(ns))
    values["train_iters"] = ns.train_iters
    values["num_query_groups"] = ns.num_query_groups if ns.group_query_attention else None
    if ns.rampup_batch_size:  # (checked by resolve_iterations; the args keep the strings)
        values["rampup_batch_size"] = [int(v) for v in ns.rampup_batch_size]
        values["target_global_batch_size"] = ns.global_batch_size
    for name in _DELETED:
        values.pop(name, None)
    import torch

    args = {k: _plain(v, torch.dtype) for k, v in vars(ns).items() if k not in _DELETED}
    return Config(
        model=_fill(ModelConfig, values),
        parallel=_fill(ParallelConfig, values),
        optimizer=_fill(OptimizerConfig, values),
        data=_fill(DataConfig, values),
        training=_fill(TrainingConfig, values),
        checkpoint=_fill(CheckpointConfig, values),
        logging=_fill(LoggingConfig, values),
        args=args,
    )
