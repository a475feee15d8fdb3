"""Which samples each data-parallel rank reads, in Megatron's `single` order.

Global batch k covers samples [c, c + global_batch) where c is the number of samples
consumed before it. It is read as micro-batches of `micro_batch_size * dp_size`
consecutive samples; data-parallel rank r takes the slice [r*mbs, (r+1)*mbs) of each.
Resuming from `consumed_samples` continues at exactly the next sample.
"""
from __future__ import annotations

from typing import Iterator, List

import numpy as np
import torch


class PretrainingSampler:
    """Yields lists of sample indices (one micro-batch of this DP rank) until the
    `total_samples` run out; an incomplete last global micro-batch is dropped (Megatron's
    `single` loader)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if micro_batch_size <= 0:
            raise ValueError(f"micro batch size must be positive, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} outside [0, {dp_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += step


def _stack(values: list) -> torch.Tensor:
    if isinstance(values[0], np.ndarray):  # GPTDataset's 'text'
        return torch.from_numpy(np.stack(values))
    if torch.is_tensor(values[0]):  # MockGPTDataset's 'text'
        return torch.stack(values)
    return torch.tensor(values)  # BlendedDataset's 'dataset_idx' (ints)


def collate(samples: List[dict]) -> dict:
    """One tensor per key, stacked along a new first dimension: numpy arrays (GPTDataset),
    tensors (MockGPTDataset) and Python numbers (a blend's 'dataset_idx')."""
    return {k: _stack([s[k] for s in samples]) for k in samples[0]}


def micro_batches(dataset, sampler: PretrainingSampler) -> Iterator[dict]:
    """Yield collated micro-batches {'text': [mbs, s+1]} (and a blend's 'dataset_idx':
    [mbs]) in the sampler's order."""
    for indices in sampler:
        yield collate([dataset[i] for i in indices])
