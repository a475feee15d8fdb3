"""Rotary position embeddings (`--use-rotary-position-embeddings`, `--rotary-percent`).

The first `rotary_dim = d * rotary_percent` channels of each head are rotated in two
halves ("rotate half" convention); the rest pass through unchanged.
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
    """cos and sin of the angles, [2, s, 1, 1, rotary_dim] fp32: what `apply_rotary`
    reads. Computed once per model (the kernels that rotate q and k then read two small
    tables instead of evaluating cos and sin for every element: measured 0.94 -> 0.66 ms
    per llama-1b layer, forward + backward, benchmarks/rope_probe.py)."""
    freqs = rotary_frequencies(seq_length, rotary_dim, base, device)
    return torch.stack((freqs.cos(), freqs.sin()))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t_sbnd: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the first table.shape[-1] channels of t [s, b, n, d] by the angles whose
    cos and sin `table` holds (`rotary_table`, first s positions); compute in fp32."""
    rot = table.shape[-1]
    t_rot, t_pass = t_sbnd[..., :rot], t_sbnd[..., rot:]
    cos, sin = table[0], table[1]
    out = (t_rot.float() * cos + _rotate_half(t_rot.float()) * sin).to(t_sbnd.dtype)
    return torch.cat((out, t_pass), dim=-1) if t_pass.shape[-1] else out
