"""Main grads that the next write must overwrite, not add to.

A step starts by zeroing the grad buffer, so that every micro-batch can add into it. For
the weights of the fused linear layers (every gradient of such a weight comes from the
weight-grad product in `accumulate_weight_grad`), the first product of the step can
write its result instead (cuBLAS beta 0): the buffer is then not filled with zeros only
to be read back by the product. `GradBuffer.zero()` leaves those ranges as they are and
lists their tensors here; whoever writes such a tensor first asks `take(t)`, which says
whether `t` still holds the previous step's values (overwrite) and unlists it. Tensors
still listed when the gradients are reduced got no gradient this step; `settle()` zeroes
them then.

Tensors are listed by address and size: the compiled backward hands the weight-grad
operator its own view of the buffer, a different Python object over the same memory. The
list holds them weakly: a grad buffer dropped mid-step (an exception, a test) leaves no
entry behind, and its memory, reused by another tensor, cannot be mistaken for it.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Tuple

import torch

_STALE: "weakref.WeakValueDictionary[Tuple[int, int], torch.Tensor]" = (
    weakref.WeakValueDictionary())


def _key(t: torch.Tensor) -> Tuple[int, int]:
    return t.data_ptr(), t.numel()


def mark(tensors: Iterable[torch.Tensor]) -> None:
    """List `tensors`: their contents are stale until written."""
    for t in tensors:
        _STALE[_key(t)] = t


def take(t: torch.Tensor) -> bool:
    """True (and unlisted) when `t` is listed: the caller must overwrite it."""
    return _STALE.pop(_key(t), None) is not None


def pending(t: torch.Tensor) -> bool:
    """True while `t` is listed (no write has claimed it since it was marked)."""
    return _key(t) in _STALE


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Zero and unlist those of `tensors` still listed (they received no gradient)."""
    left = [t for t in tensors if _STALE.pop(_key(t), None) is not None]
    if left:
        torch._foreach_zero_(left)
