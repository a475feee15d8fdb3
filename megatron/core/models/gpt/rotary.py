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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t_sbnd: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first freqs.shape[-1] channels of t [s, b, n, d]; compute in fp32."""
    rot = freqs.shape[-1]
    t_rot, t_pass = t_sbnd[..., :rot], t_sbnd[..., rot:]
    cos, sin = freqs.cos(), freqs.sin()
    out = (t_rot.float() * cos + _rotate_half(t_rot.float()) * sin).to(t_sbnd.dtype)
    return torch.cat((out, t_pass), dim=-1) if t_pass.shape[-1] else out
