"""Small helpers shared by the tensor-parallel layers."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import parallel_state
from ..utils import divide  # Megatron-LM keeps it under both modules
from .mappings import all_gather_dim0, group_rank, group_size


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Tuple[torch.Tensor, ...]:
    """Split `tensor` into `num_partitions` equal chunks along its last dimension.

    The chunks are views unless `contiguous_split_chunks` asks for contiguous copies.
    """
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def vocab_range_from_per_partition_vocab_size(
    per_partition_vocab_size: int, rank: int
) -> Tuple[int, int]:
    """[first, last) global vocabulary ids held by TP rank `rank`."""
    first = rank * per_partition_vocab_size
    return first, first + per_partition_vocab_size


def vocab_range_from_global_vocab_size(
    global_vocab_size: int, rank: int, world_size: int
) -> Tuple[int, int]:
    """[first, last) global vocabulary ids held by TP rank `rank` of `world_size`."""
    per_partition = divide(global_vocab_size, world_size)
    return vocab_range_from_per_partition_vocab_size(per_partition, rank)


class VocabUtility:
    """Megatron's name for the vocabulary-range helpers (for code being ported)."""

    vocab_range_from_per_partition_vocab_size = staticmethod(
        vocab_range_from_per_partition_vocab_size
    )
    vocab_range_from_global_vocab_size = staticmethod(vocab_range_from_global_vocab_size)


def _global_ranks(group) -> List[int]:
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b differ anywhere; NaN equals NaN (both ranks diverged alike)."""
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same = same | (a.isnan() & b.isnan())
    return not bool(same.all())


def assert_tensor_equal_across_parallel_ranks(tensor: torch.Tensor, group) -> None:
    """Check that every rank of `group` holds the same `tensor` (bit-exact, NaN == NaN).

    Collectives: one all_gather_object (shape/dtype) and one all-gather of the data.
    Must be called by every rank of the group. Raises AssertionError naming the global
    ranks whose tensor differs from the group's first rank. A `None` group (or a group
    of one) passes trivially.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    ranks = _global_ranks(group)
    metas: List[Sequence] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(metas, (tuple(tensor.shape), str(tensor.dtype)), group=group)
    mismatched = [r for r, m in zip(ranks, metas) if tuple(m) != tuple(metas[0])]
    if mismatched:
        raise AssertionError(
            f"tensor shape/dtype differs across ranks: ranks {mismatched} differ from rank "
            f"{ranks[0]} (shape/dtype per rank: {dict(zip(ranks, metas))})"
        )
    local = tensor.detach().contiguous()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    differing = [r for r, t in zip(ranks, gathered) if _differs(t, gathered[0])]
    if differing:
        raise AssertionError(
            f"tensor differs across parallel ranks: ranks {differing} differ from rank "
            f"{ranks[0]} (group ranks {ranks})"
        )


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False
                                      ) -> torch.Tensor:
    """Megatron's name, for ported code: this tensor-parallel rank's equal part of the
    flattened `tensor` (a view; a copy with `new_buffer`). Reads the group remembered by
    `parallel_state.initialize_model_parallel`."""
    group = parallel_state.get_tensor_model_parallel_group()
    world = group_size(group)
    if tensor.numel() % world:
        raise ValueError(f"split_tensor_into_1d_equal_chunks: {tensor.numel()} elements "
                         f"(shape {tuple(tensor.shape)}) do not split into {world} equal "
                         f"parts (tensor-parallel size); pad the tensor to a multiple of {world}")
    part = tensor.numel() // world
    start = part * group_rank(group)
    chunk = tensor.reshape(-1)[start:start + part]
    return chunk.clone() if new_buffer else chunk


def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Megatron's name, for ported code: the flat tensor whose parts
    `split_tensor_into_1d_equal_chunks` gave each tensor-parallel rank (all-gather)."""
    group = parallel_state.get_tensor_model_parallel_group()
    return all_gather_dim0(tensor.reshape(-1), group)
