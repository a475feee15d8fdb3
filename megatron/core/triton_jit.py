"""Triton for the project's kernels: imported once here, and jitted on first use.

Triton is optional: where it is missing, or installed but failing to import (a driver or
version mismatch raising RuntimeError, which ended every run, CPU runs included), each
kernel module keeps torch's ops. A broken install is made to look absent
(sys.modules["triton"] = None: every later `import triton`, torch's lazy ones under
torch.compile included, is an ImportError) and the warning an entry point prints is kept
(`broken_triton_warning`).

Triton decides when `triton.jit` is called whether a kernel runs compiled or in its
interpreter (TRITON_INTERPRET), and the CPU tests switch a module's INTERPRET_ON_CPU
between runs; so each kernel is jitted once per setting, here.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Tuple

_CACHE: Dict[Tuple[Callable, bool], object] = {}
_BROKEN: List[str] = []  # the warning of the broken install hidden in this process


def import_triton():
    """(triton, triton.language), or (None, None) where Triton is not installed or its
    install is broken (then hidden, and its warning kept: `broken_triton_warning`)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None, None
    except Exception as exc:  # a broken install, not a missing one
        sys.modules["triton"] = None
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        _BROKEN[:] = [
            f"WARNING: Triton is installed but fails to import ({type(exc).__name__}: "
            f"{first}); running without its kernels (torch's instead): fix or reinstall "
            "Triton to use them"]
        return None, None
    return triton, tl


def broken_triton_warning() -> Optional[str]:
    """The warning for the broken Triton install `import_triton` hid in this process;
    None when Triton imports, is not installed, or was not imported yet."""
    return _BROKEN[0] if _BROKEN else None


def jitted(source: Callable, interpret: bool):
    """`triton.jit(source)`, built once per (source, interpret setting)."""
    key = (source, bool(interpret))
    if key not in _CACHE:
        triton, _ = import_triton()
        _CACHE[key] = triton.jit(source)
    return _CACHE[key]


def runs_on(device, interpret: bool) -> bool:
    """Whether a kernel can run on `device`: CUDA with Triton installed, or the CPU
    interpreter when the calling module's INTERPRET_ON_CPU is set (tests)."""
    if import_triton()[0] is None:
        return False
    return device.type == "cuda" or bool(interpret)
