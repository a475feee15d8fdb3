"""Driver-side configuration: one dataclass per concern, built once by `arguments.py`.

The library configs (model, parallel, optimizer) live in `megatron.core.config` so that
`megatron/core` never imports the driver; they are re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megatron.core.config import ModelConfig, OptimizerConfig, ParallelConfig


@dataclass
class DataConfig:
    """Where tokens come from and how samples are cut."""

    mock_data: bool = False
    data_path: Optional[List[str]] = None
    train_data_path: Optional[List[str]] = None
    valid_data_path: Optional[List[str]] = None
    test_data_path: Optional[List[str]] = None
    data_cache_path: Optional[str] = None
    split: str = "969, 30, 1"
    seq_length: int = 1024
    micro_batch_size: int = 1
    global_batch_size: int = 1
    num_micro_batches: int = 1
    # --rampup-batch-size START INCR SAMPLES; while set, global_batch_size and
    # num_micro_batches are the current values and target_global_batch_size the final one
    # (see megatron/microbatches.py).
    rampup_batch_size: Optional[List[int]] = None
    target_global_batch_size: Optional[int] = None
    seed: int = 1234
    num_workers: int = 2
    dataloader_type: str = "single"
    data_sharding: bool = True  # cyclic loader: per-rank buckets (False: --no-data-sharding)
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    tokenizer_model: Optional[str] = None
    vocab_extra_ids: int = 0
    make_vocab_size_divisible_by: int = 128
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    mmap_warmup: bool = False


@dataclass
class TrainingConfig:
    """Loop length, evaluation and exit conditions."""

    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    skip_train: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    nan_loss_policy: str = "stop"  # "stop" | "skip" | "rollback"
    seed: int = 1234
    data_parallel_random_init: bool = False
    empty_unused_memory_level: int = 0
    # --cuda-graph-step "auto" | "on" | "off"; the flag defaults to auto, a Config built in
    # code (tests, tools) to off.
    cuda_graph_step: str = "off"


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    use_checkpoint_args: bool = False
    exit_on_missing_checkpoint: bool = False
    async_save: bool = False  # --async-save: write the files in a background thread


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_batch_size_to_tensorboard: bool = False
    log_learning_rate_to_tensorboard: bool = True
    log_loss_scale_to_tensorboard: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    timing_log_level: int = 0
    timing_log_option: str = "minmax"


@dataclass
class Config:
    """Everything one run needs; `args` keeps the resolved flag values as plain data
    (stored in checkpoints and written to tensorboard as text)."""

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    args: Dict[str, Any] = field(default_factory=dict)


__all__ = [
    "Config",
    "ModelConfig",
    "ParallelConfig",
    "OptimizerConfig",
    "DataConfig",
    "TrainingConfig",
    "CheckpointConfig",
    "LoggingConfig",
]
