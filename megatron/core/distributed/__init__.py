"""Data-parallel gradient reduction: contiguous grad buffers, bucketed (optionally
overlapped) all-reduce, and the tensor-parallel / embedding grad all-reduces that run
before the optimizer step. See `ddp.py` for the layout and the collectives."""
from megatron.core.distributed.ddp import (
    Bucket,
    DistributedDataParallel,
    GradBuffer,
    allreduce_embedding_grads,
    allreduce_grads_coalesced,
    allreduce_sequence_parallel_grads,
)

__all__ = [
    "Bucket",
    "DistributedDataParallel",
    "GradBuffer",
    "allreduce_embedding_grads",
    "allreduce_grads_coalesced",
    "allreduce_sequence_parallel_grads",
]
