"""What an entry point's start-up changes in the process, undone when its run ends, for
in-process use (a notebook calling `pretrain_gpt.main` more than once; README "In-process
use"). Imports neither torch nor numpy: `pretrain_gpt.py --help` and argument errors
answer without them (tests/test_startup_imports.py)."""
from __future__ import annotations

import contextlib
import warnings
from typing import MutableMapping

CUBLASLT_WORKSPACE_WARNING = "Requested unified CUBLASLT workspace size"
# the environment variables initialize_entry_point may set (see entry_point_changes_undone)
ENTRY_POINT_ENV = ("CUBLAS_WORKSPACE_CONFIG", "TORCH_GLOO_LAZY_INIT")


@contextlib.contextmanager
def entry_point_changes_undone(environ: MutableMapping[str, str]):
    """`with` block around an entry point's run, for in-process use (a notebook calling
    `pretrain_gpt.main` more than once): on leaving, the caller's values of ENTRY_POINT_ENV
    in `environ` (absent ones removed again), `warnings.formatwarning` and
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
        for name, value in env.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        warnings.formatwarning, warnings.showwarning = hooks
        added = [f for f in warnings.filters if f not in filters and f[1] is not None
                 and f[1].pattern == CUBLASLT_WORKSPACE_WARNING]
        if added:
            warnings.filters[:] = [f for f in warnings.filters if f not in added]
            getattr(warnings, "_filters_mutated", lambda: None)()

