"""What an in-process call of an entry point must leave as it found it, as a JSON-ready
dict (tests/test_in_process*.py compare it before and after each call in a child process).
Importing this module imports neither torch nor megatron."""
import logging
import os
import signal
import sys
import threading
import warnings


def state() -> dict:
    """The process environment (less torch's own compile cache variable), the threads,
    the SIGINT/SIGTERM/SIGUSR1 handlers, the excepthook, the warnings hooks and the
    cuBLAS warnings filter, the root logger's handlers, torch's global settings, whether
    a process group exists, and the SIGTERM/SIGUSR1 megatron.signals noted (when loaded)."""
    import torch
    import torch.distributed as dist

    for t in threading.enumerate():
        # a closed DataLoader's worker queues end their feeder threads a moment after the
        # loader's shutdown (torch does not join them); a queue left open keeps its thread
        if t.name == "QueueFeederThread":
            t.join(timeout=5.0)
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # torch's own, set when it compiles
    signals = sys.modules.get("megatron.signals")
    return dict(
        env=env, threads=sorted(t.name for t in threading.enumerate()),
        signals=[repr(signal.getsignal(s)) for s in
                 (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)],
        excepthook=repr(sys.excepthook), formatwarning=repr(warnings.formatwarning),
        showwarning=repr(warnings.showwarning),
        our_filters=[repr(f) for f in warnings.filters
                     if f[1] is not None and "CUBLAS" in f[1].pattern],
        root_handlers=len(logging.root.handlers), dtype=str(torch.get_default_dtype()),
        num_threads=torch.get_num_threads(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        grad=torch.is_grad_enabled(), group=dist.is_initialized(),
        noted_signal=0 if signals is None else signals._last_noted)


def run_calls(script, timeout: float, **env) -> dict:
    """Run the child `script` (the entry-point calls) on the CPU without a launcher's
    variables or the ones an entry point sets, with `env` added; the JSON object its last
    line prints."""
    import json
    import subprocess

    from tests.dist_utils import ROOT, cpu_env

    child_env = cpu_env(**env)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCH_GLOO_LAZY_INIT", "CUBLAS_WORKSPACE_CONFIG"):
        child_env.pop(name, None)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=child_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
