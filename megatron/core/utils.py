"""Small helpers kept under Megatron-LM's names for ported code."""
from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import torch


class GlobalMemoryBuffer:
    """Scratch tensors reused across calls: `get_tensor(shape, dtype, name)` returns a view
    of one flat tensor per (name, dtype), grown when a larger shape is asked for. Two calls
    with the same name and dtype share memory (Megatron's contract); the contents are
    whatever was left there."""

    def __init__(self, device=None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.buffer: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape: Sequence[int], dtype: torch.dtype, name: str):
        numel = math.prod(tensor_shape)
        key = (name, dtype)
        flat = self.buffer.get(key)
        if flat is None or flat.numel() < numel:
            flat = torch.empty(numel, dtype=dtype, device=self.device, requires_grad=False)
            self.buffer[key] = flat
        return flat[:numel].view(*tensor_shape)
