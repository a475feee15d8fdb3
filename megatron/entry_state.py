"""What an entry point's start-up changes in the process, undone when its run ends, for
in-process use (a notebook calling `pretrain_gpt.main` more than once; README "In-process
use"). Imports neither torch nor numpy: `pretrain_gpt.py --help` and argument errors
answer without them (tests/test_startup_imports.py)."""
from __future__ import annotations

import contextlib
import os
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



_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def one_line_project_warnings() -> None:
    """The library's own warnings (`warnings.warn` in megatron/, e.g. a checkpoint's loss
    scaler that is not the run's) print as one `WARNING: <message>` line, as the flag
    warnings do, instead of Python's `<file>:<line>: UserWarning: <message>` followed by
    the source line of the call; other packages' warnings keep Python's format."""
    default = getattr(warnings.formatwarning, "project_default", warnings.formatwarning)

    def formatwarning(message, category, filename, lineno, line=None):
        if (issubclass(category, UserWarning)
                and os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)):
            return f"WARNING: {message}\n"
        return default(message, category, filename, lineno, line)

    formatwarning.project_default = default
    warnings.formatwarning = formatwarning


@contextlib.contextmanager
def project_warnings_in_one_line():
    """`one_line_project_warnings` for a `with` block: a file tool's run
    (tools/preprocess_data.py, merge_datasets.py, the checkpoint converters), called in
    a process more than once or from a notebook, gives the caller's format back."""
    saved = warnings.formatwarning
    one_line_project_warnings()
    try:
        yield
    finally:
        warnings.formatwarning = saved
