"""Megatron-LM 23.05's `broadcast_data`, for ported code.

The first rank of each tensor-parallel group holds a batch (a dict of tensors); the other
ranks of the group get the same tensors. It reads the group remembered by
`parallel_state.initialize_model_parallel`.

Two broadcasts, as in Megatron: first a header of int64s (a status, then each key's number
of dimensions and sizes), then all tensors flattened into one of `datatype`. A bad batch
on the source rank (a missing key, another dtype, too many dimensions) is reported in the
header, so every rank of the group raises a ValueError instead of the others waiting.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .. import parallel_state
from .mappings import group_size

MAX_DATA_DIM = 8  # dimensions a broadcast tensor may have
_OK, _MISSING, _DTYPE, _DIMS = range(4)
_REASONS = {_MISSING: "missing from the data", _DTYPE: "of another dtype than the one given",
            _DIMS: f"of more than {MAX_DATA_DIM} dimensions"}


def _problem(keys: Sequence[str], data: Optional[Mapping], datatype) -> tuple:
    """(status, index of the key, message) for the source rank's batch."""
    for i, key in enumerate(keys):
        if data is None or key not in data:
            return _MISSING, i, f"broadcast_data: key {key!r} is not in the data"
        t = data[key]
        if t.dtype != datatype:
            return _DTYPE, i, (f"broadcast_data: data[{key!r}] has dtype {t.dtype}, expected "
                               f"{datatype}: convert it (.to({datatype})) or pass its dtype")
        if t.dim() > MAX_DATA_DIM:
            return _DIMS, i, (f"broadcast_data: data[{key!r}] has {t.dim()} dimensions, at "
                              f"most {MAX_DATA_DIM} are supported; reshape it")
    return _OK, 0, ""


def _header(keys: Sequence[str], data: Optional[Mapping], datatype, src: bool) -> list:
    width = 2 + len(keys) * (1 + MAX_DATA_DIM)
    header = [0] * width
    if not src:
        return header
    status, index, _ = _problem(keys, data, datatype)
    header[0], header[1] = status, index
    if status == _OK:
        for i, key in enumerate(keys):
            base = 2 + i * (1 + MAX_DATA_DIM)
            shape = tuple(data[key].shape)
            header[base] = len(shape)
            header[base + 1:base + 1 + len(shape)] = shape
    return header


def _shapes(keys: Sequence[str], header: list) -> Dict[str, tuple]:
    shapes = {}
    for i, key in enumerate(keys):
        base = 2 + i * (1 + MAX_DATA_DIM)
        shapes[key] = tuple(header[base + 1:base + 1 + header[base]])
    return shapes


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_data(keys: Sequence[str], data: Optional[Mapping[str, torch.Tensor]],
                   datatype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Megatron's name and arguments: `{key: tensor}` for every key, the source rank's
    tensors (all of `datatype`) on every rank of the tensor-parallel group. Only the source
    rank (`get_tensor_model_parallel_src_rank()`) reads `data`; the others may pass None.
    Results live on the current CUDA device under NCCL (at tensor-parallel size 1 too, as in
    Megatron), else on the CPU."""
    if not keys:
        return {}
    group = parallel_state.get_tensor_model_parallel_group()
    src_rank = parallel_state.get_tensor_model_parallel_src_rank()
    if group_size(group) == 1:
        status, _, message = _problem(keys, data, datatype)
        if status != _OK:
            raise ValueError(message)
        # as in Megatron, the batch moves to the GPU at tensor-parallel size 1 too
        device = _device(group) if dist.is_initialized() else torch.device("cpu")
        return {key: data[key].contiguous().to(device) for key in keys}
    device = _device(group)
    is_src = dist.get_rank() == src_rank
    header = torch.tensor(_header(keys, data, datatype, is_src), dtype=torch.int64, device=device)
    dist.broadcast(header, src_rank, group=group)
    header = header.tolist()
    if header[0] != _OK:
        if is_src:
            raise ValueError(_problem(keys, data, datatype)[2])
        raise ValueError(f"broadcast_data: on the tensor-parallel source rank {src_rank} "
                         f"data[{keys[header[1]]!r}] is {_REASONS[header[0]]} "
                         f"({datatype}); that rank's error names the value")
    shapes = _shapes(keys, header)
    numels = [int(torch.Size(shapes[key]).numel()) for key in keys]
    if is_src:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(device)
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src_rank, group=group)
    return {key: part.view(shapes[key])
            for key, part in zip(keys, torch.split(flat, numels))}
