"""The project's Triton kernels are plain functions jitted on first use.

Triton decides when `triton.jit` is called whether a kernel runs compiled or in its
interpreter (TRITON_INTERPRET), and the CPU tests switch a module's INTERPRET_ON_CPU
between runs; so each kernel is jitted once per setting, here.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

_CACHE: Dict[Tuple[Callable, bool], object] = {}


def jitted(source: Callable, interpret: bool):
    """`triton.jit(source)`, built once per (source, interpret setting)."""
    key = (source, bool(interpret))
    if key not in _CACHE:
        import triton

        _CACHE[key] = triton.jit(source)
    return _CACHE[key]


def runs_on(device, interpret: bool) -> bool:
    """Whether a kernel can run on `device`: CUDA with Triton installed, or the CPU
    interpreter when the calling module's INTERPRET_ON_CPU is set (tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or bool(interpret)
