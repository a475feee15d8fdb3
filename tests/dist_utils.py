"""Run a function on N gloo processes and collect what each rank returns.

Usage (the function must be importable at module level, i.e. defined at the top of a
test module):

    def _worker(rank, world_size, x):
        ...               # torch.distributed is initialised (gloo) when this runs
        return {"out": tensor}

    results = run_distributed(_worker, 4, x)   # list indexed by rank

Each rank's return value is saved with torch.save and read back, so tensors and plain
containers come back. An exception on any rank fails the call with that rank's traceback.

Tests that start processes themselves (torchrun, pretrain_gpt.py, a tool that starts
ranks) give them `cpu_env()` as their environment.
"""
from __future__ import annotations

import datetime
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Mapping, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# Ports handed out in the last RESERVED_S seconds, by any test process on this machine (a
# file per port): a port is released between free_port() and the listener's bind, and
# tests running side by side (pytest -n) must not pick the same one in that window.
PORT_DIR = Path(tempfile.gettempdir()) / "megatron-test-ports"
RESERVED_S = 120.0


def _reserve(port: int) -> bool:
    """Claim `port` for this caller unless another claimed it within RESERVED_S."""
    PORT_DIR.mkdir(exist_ok=True)
    path = PORT_DIR / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < RESERVED_S:
                return False
            os.utime(path)  # an old claim: take it over
            return True
        except FileNotFoundError:
            return False
    except OSError:  # an unwritable temporary directory: no claims
        return True


def free_port() -> int:
    """A free port for a test's listener (a rendezvous store, an HTTP server), picked
    below the kernel's ephemeral range: a port from bind(0) is released before the
    listener binds it, and in between the sockets of other processes (gloo's pairs, any
    client) may be handed the same ephemeral port ('Address already in use', seen in CI).
    Ports below the range are only taken by explicit binds -- and by other tests, which
    the claim (`_reserve`) keeps apart. bind(0) if none is free."""
    top = _ephemeral_start()
    rng = random.Random()  # not the global generator: tests seed that
    for _ in range(64):
        port = rng.randrange(max(1024, top - 12000), top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _reserve(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[1]


def cpu_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict:
    """The environment of a process a CPU test starts: `base` (default os.environ) with
    CUDA hidden, so that its ranks run on the CPU with gloo also on a machine with a GPU
    (there two ranks would pick NCCL and need a GPU each, and one rank would leave the
    CPU numerics the test checks), one OpenMP thread per process (the ranks share a few
    cores) and the repository on PYTHONPATH (for wrapper scripts outside it); then
    `extra`. A test of the GPU path (marked cuda) builds its own."""
    env = dict(os.environ if base is None else base)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def _entry(rank, world_size, port, outdir, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # These are CPU (gloo) runs, also on a machine with a GPU: a forked child cannot use a
    # CUDA context its parent may have made, and the code under test picks CUDA when visible.
    torch.cuda.is_available = lambda: False
    torch.set_num_threads(1)
    # Compile kernels in this process: a forked child inherits the parent's inductor
    # compile thread pool without its threads, and would wait on it forever. Set where
    # inductor is already imported, else through the variable its config reads when first
    # imported: importing it here (it imports torch._dynamo) cost each rank ~2 s of CPU.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].compile_threads = 1
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        open(os.path.join(outdir, f"rank{rank}.joined"), "w").close()
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report every failure, including SystemExit
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# A rank stuck in a collective fails after this long instead of hanging the suite, and a
# whole run is killed (with a message naming it) after RUN_TIMEOUT_S.
COLLECTIVE_TIMEOUT_S = 300
RUN_TIMEOUT_S = 600


def _join_all(ctx, deadline: float, name: str) -> None:
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(f"{name} did not finish within {RUN_TIMEOUT_S} s; "
                               "its processes were killed")


# torch's own check, kept before any test patches torch.cuda.is_available (a test that
# keeps its one-process runs on the CPU still runs in a process that may hold CUDA state).
_CUDA_IS_AVAILABLE = torch.cuda.is_available


def _start_method() -> str:
    """fork (fast) on machines without CUDA; spawn where CUDA is visible: a forked child
    can use neither the parent's CUDA context nor, once the parent has run a backward
    pass, autograd (whose engine then holds per-device threads)."""
    return "spawn" if _CUDA_IS_AVAILABLE() else "fork"


def _failure_report(ctx, outdir: str, world_size: int) -> str:
    """Each failed rank's traceback; a rank that left none says how it ended."""
    parts = []
    for r in range(world_size):
        path = os.path.join(outdir, f"rank{r}.pt")
        if os.path.exists(path):
            rec = torch.load(path, weights_only=False)
            if not rec["ok"]:
                parts.append(f"--- rank {r} ---\n{rec['error']}")
            continue
        code = ctx.processes[r].exitcode
        if code is not None and code < 0:
            try:
                how = f"was ended by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was ended by signal {-code}"
        elif code:
            how = f"exited with status {code}"
        else:
            how = "was stopped when another rank failed"
        parts.append(f"--- rank {r} --- {how}, leaving no report")
    return "\n".join(parts)


def _all_joined(outdir: str, world_size: int) -> bool:
    return all(os.path.exists(os.path.join(outdir, f"rank{r}.joined"))
               for r in range(world_size))


# A run whose ranks failed before all of them had joined the gloo group (in the harness,
# before the function under test ran) is started again this many times: forking from a
# pytest worker, which has threads, now and then leaves a child that dies or cannot
# connect in gloo's set-up ("Connection closed by peer" in connectFullMesh, seen in CI).
START_RETRIES = 1


def _run_once(fn, world_size: int, args, outdir: str):
    from megatron.data_iterators import frozen_for_fork

    port = free_port()
    with frozen_for_fork():  # a rank must not collect this process's garbage (a TCPStore)
        ctx = mp.start_processes(
            _entry, args=(world_size, port, outdir, fn, args), nprocs=world_size,
            join=False, start_method=_start_method(),
        )
    try:
        _join_all(ctx, time.monotonic() + RUN_TIMEOUT_S,
                  f"run_distributed({getattr(fn, '__name__', fn)}, {world_size})")
    except Exception as exc:
        for p in ctx.processes:  # the join ends the others; make sure before reading
            p.join(5)
        return None, exc, _failure_report(ctx, outdir, world_size)
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)["result"]
            for r in range(world_size)], None, ""


def run_distributed(fn, world_size: int, *args):
    """Spawn `world_size` gloo processes running `fn(rank, world_size, *args)`."""
    for attempt in range(START_RETRIES + 1):
        with tempfile.TemporaryDirectory() as outdir:
            out, exc, report = _run_once(fn, world_size, args, outdir)
            if exc is None:
                return out
            if _all_joined(outdir, world_size) or attempt == START_RETRIES:
                raise RuntimeError("distributed run failed\n" + report) from exc
        print(f"run_distributed: the ranks failed in the gloo set-up, before "
              f"{getattr(fn, '__name__', fn)} ran; starting them again\n{report}",
              file=sys.stderr, flush=True)
    raise AssertionError("unreachable")
