"""Tensor parallelism: communication pairs, parallel layers, vocab-parallel loss, RNG.

Every function and layer takes its process group explicitly; `None` means one process.
Megatron-LM's names left without one (the parallel layers, `vocab_parallel_cross_entropy`,
`linear_with_grad_accumulation_and_async_allreduce`) use the tensor-parallel group of
`parallel_state.initialize_model_parallel`, as ported code expects.
See README.md in this folder for the layout conventions.
"""
from .cross_entropy import (
    mask_vocab_padding,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from .data import broadcast_data
from .layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    init_method_normal,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    scaled_init_method_normal,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_of_full_weight,
)
from .mappings import (
    copy_to_tensor_model_parallel_region,
    copy_to_tp,
    gather_from_sequence_parallel_region,
    gather_from_sp,
    gather_from_tensor_model_parallel_region,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tensor_model_parallel_region,
    reduce_from_tp,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_sp,
    scatter_to_sequence_parallel_region,
    scatter_to_sp,
    scatter_to_tensor_model_parallel_region,
    scatter_to_tp,
)
from .random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_seed,
    set_rng_tracker,
)
from .utils import (
    VocabUtility,
    assert_tensor_equal_across_parallel_ranks,
    divide,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
    vocab_range_from_global_vocab_size,
    vocab_range_from_per_partition_vocab_size,
)

__all__ = [
    # mappings
    "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp",
    "gather_from_sp", "reduce_scatter_to_sp", "group_size", "group_rank",
    # Megatron-LM 23.05's names (read the group set by initialize_model_parallel)
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "broadcast_data",
    "split_tensor_into_1d_equal_chunks", "gather_split_1d_tensor",
    # layers
    "VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "linear_with_grad_accumulation_and_async_allreduce",
    "set_tensor_model_parallel_attributes",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate",
    "init_method_normal", "scaled_init_method_normal", "shard_of_full_weight",
    # loss
    "vocab_parallel_cross_entropy", "vocab_parallel_argmax", "mask_vocab_padding",
    # random
    "RNGStatesTracker", "MODEL_PARALLEL_RNG", "model_parallel_seed",
    "model_parallel_cuda_manual_seed", "get_rng_tracker",
    "get_cuda_rng_tracker", "set_rng_tracker", "checkpoint",
    # utils
    "divide", "split_tensor_along_last_dim", "assert_tensor_equal_across_parallel_ranks",
    "VocabUtility", "vocab_range_from_global_vocab_size",
    "vocab_range_from_per_partition_vocab_size",
]
