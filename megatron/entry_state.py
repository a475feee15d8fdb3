"""What an entry point's start-up changes in the process, undone when its run ends, for
in-process use (a notebook calling `pretrain_gpt.main` more than once; README "In-process
use"). Imports neither torch nor numpy: `pretrain_gpt.py --help` and argument errors
answer without them (tests/test_startup_imports.py)."""
from __future__ import annotations

import contextlib
import sys
import warnings
from typing import MutableMapping

CUBLASLT_WORKSPACE_WARNING = "Requested unified CUBLASLT workspace size"
# the environment variables initialize_entry_point may set (see entry_point_changes_undone)
ENTRY_POINT_ENV = ("CUBLAS_WORKSPACE_CONFIG", "TORCH_GLOO_LAZY_INIT")


def cublas_workspaces_resized() -> None:
    """Call after CUBLAS_WORKSPACE_CONFIG changed in this process. torch keeps the cuBLAS
    workspace it allocated for each handle and stream at their first product, but tells
    cuBLAS the size the variable names at every product: after a change to a larger size
    (e.g. ":0:0" while CUDA started, then the variable restored) cuBLAS writes past the
    buffer and the process's CUDA context dies (illegal memory access). Where CUDA has
    started, wait for the GPU and free those workspaces; torch allocates new ones at the
    size named now. Without CUDA, or a torch without the call, nothing."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()
        clear()


@contextlib.contextmanager
def entry_point_changes_undone(environ: MutableMapping[str, str]):
    """`with` block around an entry point's run, for in-process use (a notebook calling
    `pretrain_gpt.main` more than once): on leaving, the caller's values of ENTRY_POINT_ENV
    in `environ` (absent ones removed again; cuBLAS's workspaces resized to match,
    `cublas_workspaces_resized`), `warnings.formatwarning` and
    `warnings.showwarning` come back, and the warnings filter `initialize_entry_point`
    added is dropped. (A filter torch adds while loading its modules stays.) A
    SIGTERM/SIGUSR1 noted (megatron.signals) is forgotten as the run starts and ends."""
    from megatron.signals import forget_noted

    env = {name: environ.get(name) for name in ENTRY_POINT_ENV}
    hooks = (warnings.formatwarning, warnings.showwarning)
    filters = list(warnings.filters)
    forget_noted()
    try:
        yield
    finally:
        forget_noted()
        workspace = environ.get("CUBLAS_WORKSPACE_CONFIG")
        for name, value in env.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        if environ.get("CUBLAS_WORKSPACE_CONFIG") != workspace:
            cublas_workspaces_resized()
        warnings.formatwarning, warnings.showwarning = hooks
        added = [f for f in warnings.filters if f not in filters and f[1] is not None
                 and f[1].pattern == CUBLASLT_WORKSPACE_WARNING]
        if added:
            warnings.filters[:] = [f for f in warnings.filters if f not in added]
            getattr(warnings, "_filters_mutated", lambda: None)()

