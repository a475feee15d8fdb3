"""Small helpers kept under Megatron-LM's names for ported code: `divide`,
`ensure_divisibility`, `GlobalMemoryBuffer`, the viewless-tensor helpers and
`get_attr_wrapped_model` / `get_model_type`."""
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


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ValueError naming both values unless `denominator` divides `numerator`
    (Megatron-LM asserts)."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by {denominator}; choose sizes so that "
            f"{numerator} is a multiple of {denominator}"
        )


def divide(numerator: int, denominator: int) -> int:
    """`numerator // denominator`, raising ValueError when it does not divide exactly."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


# --- viewless tensors ---------------------------------------------------------------------
# A view keeps its base tensor alive (`._base`). Megatron-LM hands activations between
# pipeline stages and through checkpointed regions as tensors with no base, so that
# freeing the base's storage frees the memory; these helpers make and check such tensors.
def _viewless_alias(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data  # same storage, shape and strides; no `_base`
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """`_viewless_alias` inside the autograd graph: forward alias, backward identity."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        return _viewless_alias(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool):
    """`inp` itself when it is not a view; otherwise a tensor sharing its storage without
    a `_base`, connected to `inp`'s graph when `keep_graph` (else a new leaf)."""
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    return _viewless_alias(inp, requires_grad)


def assert_viewless_tensor(tensor, extra_msg=None):
    """Raise AssertionError when `tensor` (or any tensor of a list) is a view; return it."""
    if isinstance(tensor, list):
        for t in tensor:
            assert_viewless_tensor(t, extra_msg)
        return tensor
    if isinstance(tensor, torch.Tensor) and tensor._base is not None:
        raise AssertionError(
            f"expected a tensor without a _base (not a view), got a view of shape "
            f"{tuple(tensor.shape)} of a base of shape {tuple(tensor._base.shape)}; make it "
            f"with make_viewless_tensor(){'' if extra_msg is None else ': ' + str(extra_msg)}")
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor):
    """`tensor.data = new_data_tensor` after checking that `tensor` is not a view."""
    assert_viewless_tensor(tensor, extra_msg=f"new data shape {tuple(new_data_tensor.shape)}")
    tensor.data = new_data_tensor


# --- wrapped models -----------------------------------------------------------------------
def get_attr_wrapped_model(model, attr: str, allow_none: bool = True):
    """`attr` of `model`, looked up through wrappers (each holding the next in `.module`:
    DDP, Float16Module). With `allow_none=False` a wrapper whose `attr` is None is looked
    through too. A list of model chunks is refused: pass one chunk."""
    if isinstance(model, list):
        raise ValueError("get_attr_wrapped_model was given a list of model chunks; pass one "
                         "chunk (e.g. model[0])")
    def has(m) -> bool:
        return hasattr(m, attr) if allow_none else getattr(m, attr, None) is not None

    current = model
    while not has(current):
        if not hasattr(current, "module"):
            raise ValueError(f"no wrapper of {type(model).__name__} (followed through "
                             f".module) has the attribute {attr!r}")
        current = current.module
    return getattr(current, attr)


def get_model_type(model):
    """The `model_type` (a `megatron.core.enums.ModelType`) of a wrapped model."""
    return get_attr_wrapped_model(model, "model_type")
