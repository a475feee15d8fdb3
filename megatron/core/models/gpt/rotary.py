"""Rotary position embeddings (`--use-rotary-position-embeddings`, `--rotary-percent`):
the angles and their cos/sin table. The first `rotary_dim = d * rotary_percent` channels
of each head are rotated in two halves ("rotate half" convention), the rest pass through
unchanged; the rotation itself is megatron/core/fused_rotary.py.
"""
from __future__ import annotations

import torch


def rotary_frequencies(seq_length: int, rotary_dim: int, base: float = 10000.0,
                       device=None) -> torch.Tensor:
    """Angles [s, 1, 1, rotary_dim] (fp32) for positions 0..seq_length-1."""
    if rotary_dim % 2 != 0:
        raise ValueError(f"rotary dimension must be even, got {rotary_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    pos = torch.arange(seq_length, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # [s, rotary_dim/2]
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def rotary_table(seq_length: int, rotary_dim: int, base: float = 10000.0,
                 device=None) -> torch.Tensor:
    """cos and sin of the angles, [2, s, 1, 1, rotary_dim] fp32: what the rotation reads.
    Computed once per model, so the kernels read two small tables instead of evaluating
    cos and sin for every element (benchmarks/rope_probe.py)."""
    freqs = rotary_frequencies(seq_length, rotary_dim, base, device)
    return torch.stack((freqs.cos(), freqs.sin()))
