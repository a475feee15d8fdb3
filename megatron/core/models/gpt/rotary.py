"""Rotary position embeddings (`--use-rotary-position-embeddings`, `--rotary-percent`):
the angles and their cos/sin table. The first channels of each head (`rotary_dim`, see
there) are rotated in two halves ("rotate half" convention), the rest pass through
unchanged; the rotation itself is megatron/core/fused_rotary.py.
"""
from __future__ import annotations

import torch


def rotary_dim(kv_channels: int, rotary_percent: float) -> int:
    """Megatron-LM 23.05's rotary dimension: the whole head (`kv_channels`), or
    int(kv_channels * rotary_percent) when --rotary-percent is below 1 (a value above 1
    rotates whole heads, as there). The table of an odd dimension is one channel wider
    (`rotary_frequencies`)."""
    return kv_channels if rotary_percent >= 1.0 else int(kv_channels * rotary_percent)


def rotary_frequencies(seq_length: int, rotary_dim: int, base: float = 10000.0,
                       device=None) -> torch.Tensor:
    """Angles [s, 1, 1, 2 * ceil(rotary_dim / 2)] (fp32) for positions 0..seq_length-1:
    frequencies base^(-i / rotary_dim) for the even i < rotary_dim, each angle twice. An
    odd rotary_dim thus rotates rotary_dim + 1 channels, as Megatron-LM's
    RotaryEmbedding(rotary_dim) does."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    pos = torch.arange(seq_length, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # [s, ceil(rotary_dim/2)]
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def rotary_table(seq_length: int, rotary_dim: int, base: float = 10000.0,
                 device=None) -> torch.Tensor:
    """cos and sin of the angles, [2, s, 1, 1, 2 * ceil(rotary_dim / 2)] fp32: what the
    rotation reads. Computed once per model, so the kernels read two small tables instead
    of evaluating cos and sin for every element (benchmarks/rope_probe.py)."""
    freqs = rotary_frequencies(seq_length, rotary_dim, base, device)
    return torch.stack((freqs.cos(), freqs.sin()))
