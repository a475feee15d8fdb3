"""Process-group set-up, device choice and seeds for one training process.

The entry point reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, and under
torchrun the agent's store) and passes the values in; nothing below reads
os.environ.

Under torchrun the workers share the agent's store for the whole job; each start of the job
keeps its keys under a namespace of its own (megatron/restart_epoch.py says why and how).
"""
from __future__ import annotations

import datetime
import os
import random
import socket
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import List, Mapping, MutableMapping

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.config import ParallelConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed
from megatron.core.triton_jit import broken_triton_warning, import_triton
from megatron.custom_script_api import module_getattr
from megatron.entry_state import (  # noqa: F401 (also used from here)
    CUBLASLT_WORKSPACE_WARNING,
    ENTRY_POINT_ENV,
    cublas_workspaces_resized,
    entry_point_changes_undone,
    one_line_project_warnings,
)
from megatron.launcher_watch import watch_launcher
from megatron.restart_epoch import agree_on_epoch, epoch_prefix
from megatron.srun_tasks import srun_tasks_without_launcher  # noqa: F401 (its old home)

# Megatron-LM's initialize_megatron: one clear ImportError
__getattr__ = module_getattr("megatron.initialize")


@dataclass
class Runtime:
    """What initialisation produced: the grid, the device and the RNG tracker."""

    ps: ParallelState
    device: torch.device
    rng_tracker: RNGStatesTracker
    backend: str
    control_group: object = None  # CPU (gloo) group over the world for host-side flags
    local_rank: int = 0  # the process's rank on its node (the launcher's LOCAL_RANK)

    @property
    def speaks_for_node(self) -> bool:
        """Whether this process prints what every process of a node would print alike
        (another rank's failure echoed, a stop): global rank 0 and each node's first
        process; at thousands of ranks the others' copies would bury the one line that
        matters."""
        return self.ps.rank == 0 or self.local_rank == 0


@dataclass(frozen=True)
class AgentStore:
    """torchrun's TCPStore server, shared by every start of one job (restarts included)."""

    host: str
    port: int


def agent_store_from_env(env: Mapping[str, str]) -> AgentStore | None:
    """The agent store torchrun tells its workers to share (TORCHELASTIC_USE_AGENT_STORE=True,
    the default static rendezvous and c10d's shared store), else None: a plain launch, srun,
    or a rendezvous that gives each attempt a store of its own."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return AgentStore(host=env["MASTER_ADDR"], port=int(env["MASTER_PORT"]))
    except (KeyError, ValueError) as e:
        raise ValueError(
            "TORCHELASTIC_USE_AGENT_STORE=True needs MASTER_ADDR and an integer MASTER_PORT "
            f"in the environment ({e!r}); launch with torchrun, "
            "or unset TORCHELASTIC_USE_AGENT_STORE") from None


def env_rendezvous_error(exc: BaseException, env: Mapping[str, str], rank: int,
                         world_size: int, waited_s: float | None = None) -> str | None:
    """The error to print instead of `exc`'s traceback when torch's env:// rendezvous (a
    launch that sets RANK and WORLD_SIZE itself, as an srun wrapper does) failed for want
    of MASTER_ADDR / MASTER_PORT, because rank 0 could not host its store on a port in
    use, or because a rank could not reach the store in time (`waited_s`: how long it
    tried); None for any other failure."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if isinstance(exc, ValueError) and missing:
        return (f"error: RANK={rank} and WORLD_SIZE={world_size} are set but "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: every "
                "rank needs MASTER_ADDR (the host of rank 0; under Slurm: $(scontrol show "
                "hostnames $SLURM_JOB_NODELIST | head -n 1)) and MASTER_PORT (a free port, "
                "the same on every rank) in its environment; or launch with torchrun, "
                "which sets them")
    if isinstance(exc, dist.DistNetworkError) and "EADDRINUSE" in str(exc):
        port, addr = env.get("MASTER_PORT", "?"), env.get("MASTER_ADDR", "?")
        return (f"error: rank {rank} cannot host the rendezvous store on MASTER_PORT={port} "
                f"(MASTER_ADDR={addr}): the port is in use on this host (another job, or "
                "an earlier run still ending); set MASTER_PORT to a free port, the same on "
                "every rank, and start every rank again")
    if isinstance(exc, dist.DistNetworkError) and "timed out" in str(exc):
        port, addr = env.get("MASTER_PORT", "?"), env.get("MASTER_ADDR", "?")
        waited = f" in {waited_s:.0f} s" if waited_s is not None else ""
        if rank == 0:  # it listens on every interface of its host, and cannot reach it
            return (f"error: rank 0 hosts the rendezvous store on this host "
                    f"({socket.gethostname()}) but cannot reach it at MASTER_ADDR={addr} "
                    f"MASTER_PORT={port}{waited}: set MASTER_ADDR to rank 0's host (under "
                    "Slurm: the first of $(scontrol show hostnames $SLURM_JOB_NODELIST)), "
                    "the same on every rank")
        return (f"error: rank {rank} of {world_size} could not connect to rank 0's "
                f"rendezvous store at MASTER_ADDR={addr} MASTER_PORT={port}{waited}: rank "
                "0's process is not running there (its node was not launched or is still "
                "starting, or it failed: its output says why), MASTER_ADDR / MASTER_PORT do "
                "not name rank 0's host and port, or a firewall blocks the port. The wait "
                "is --distributed-timeout-minutes (default 10) plus one minute")
    return None


# gloo connects the pairs of ranks a group's collectives use when they first talk (torch
# >= 2.8; an older torch ignores it), not every pair when the group is made: a group over
# N ranks otherwise costs each rank N - 1 sockets and about 2N rendezvous-store requests
# at start-up (2N^2 in all on one store server: minutes at thousands of GPUs), and gloo's
# collectives talk to 2 (ring) or log2(N) (broadcast, barrier) peers.
GLOO_LAZY_INIT = {"TORCH_GLOO_LAZY_INIT": "1"}


def gloo_lazy_init_env(env: Mapping[str, str]) -> dict:
    """What the entry point adds to its environment before any process group exists:
    GLOO_LAZY_INIT, unless `env` names TORCH_GLOO_LAZY_INIT itself (a user's choice)."""
    return {} if "TORCH_GLOO_LAZY_INIT" in env else dict(GLOO_LAZY_INIT)


CUBLAS_NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}
# a user who names any of these chose cuBLAS's workspace (or cuBLASLt, which needs one)
CUBLAS_USER_CHOICES = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                       "TORCH_BLAS_PREFER_CUBLASLT")


def cublas_workspace_env(choice: str, env: Mapping[str, str]) -> dict:
    """What the entry point adds to its environment, before CUDA starts, for
    `--cublas-workspace`. "none": cuBLAS gets no workspace (torch gives cuBLASLt the same
    one), so it picks GEMM kernels that need none: no split-K partial sums, no memset
    before each product (on an H200 +1.0-1.5% tokens/s for gpt2-124m, +0.3% gpt-1.3b and
    llama-1b) -- unless `env` names any of CUBLAS_USER_CHOICES: a user's value (e.g. the
    `:4096:8` that deterministic cuBLAS asks for) is kept, and cuBLASLt, preferred, fails
    without a workspace. "torch": nothing."""
    if choice not in ("none", "torch"):
        raise ValueError(f"--cublas-workspace {choice!r}: use none or torch")
    if choice == "torch" or any(env.get(name, "") not in ("", "0")
                                for name in CUBLAS_USER_CHOICES):
        return {}
    return dict(CUBLAS_NO_WORKSPACE)


def check_gemm_without_workspace(device: torch.device, mm=torch.mm) -> None:
    """One small product on `device` after cuBLAS was left without a workspace. If torch
    sends plain products to cuBLASLt (preferred in code, or torch's own default), they
    fail for want of one: stop at start-up with the fix rather than in the first step."""
    a = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
    try:
        mm(a, a)
    except RuntimeError as e:
        if "workspace" not in str(e):
            raise
        raise SystemExit(f"error: a GEMM failed without a cuBLAS workspace ({e}); torch is "
                         "using cuBLASLt, which needs one: run with --cublas-workspace "
                         "torch") from e


def attempt_store(agent: AgentStore, rank: int, world_size: int,
                  timeout: datetime.timedelta):
    """A client of the agent's TCPStore whose keys all live under the namespace that every
    process of this start of the job agrees on (collective), so nothing an earlier start
    wrote is ever read."""
    client = dist.TCPStore(agent.host, agent.port, world_size, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(epoch_prefix(agree_on_epoch(client, rank, world_size, timeout)),
                            client)


def choose_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_local_rank(local_rank: int, num_gpus: int) -> None:
    """SystemExit when a process's local rank has no GPU of its own (NCCL runs one process
    per GPU): more processes were started on this node than it has GPUs."""
    if local_rank >= num_gpus:
        raise SystemExit(
            f"error: local rank {local_rank} has no GPU: this node has {num_gpus} visible "
            f"GPU(s) and NCCL needs one per process. Start at most {num_gpus} process(es) "
            f"per node (torchrun --nproc-per-node {num_gpus}, with a layout whose "
            "tensor x pipeline x data sizes fit), or run on the CPU with gloo "
            "(CUDA_VISIBLE_DEVICES= torchrun ...)")


# The default process group an entry point's run made (`initialize_distributed`), weakly:
# a run that ends after an interrupt, another rank's failure or an out-of-memory error
# leaves it alive on purpose, and the next run in the process must not take it for one its
# caller made.
_RUN_GROUP = [lambda: None]


def _note_run_group() -> None:
    _RUN_GROUP[0] = weakref.ref(dist.distributed_c10d._get_default_group())


def left_by_earlier_run() -> bool:
    """Whether the default process group is one an earlier run of an entry point in this
    process made and left alive (after an interrupt, another rank's failure or an
    out-of-memory error), rather than one the caller made."""
    return (dist.is_initialized()
            and _RUN_GROUP[0]() is dist.distributed_c10d._get_default_group())


def end_leftover_group(rank: int, world_size: int) -> None:
    """Before a run: a process group an earlier run in this process left alive is destroyed
    when this run is one process alone (world size 1: no other process shares the
    decision); with several processes it is refused (SystemExit): its peers may be gone
    or may have ended theirs, so only a fresh start agrees on a group."""
    if not left_by_earlier_run():
        return
    have = (dist.get_rank(), dist.get_world_size())
    if world_size == 1:
        print(f"destroying the process group (rank {have[0]} of {have[1]}) that an earlier "
              "run in this process left after it stopped", flush=True)
        dist.destroy_process_group()
        return
    raise SystemExit(
        f"error: the process group (rank {have[0]} of {have[1]}) is one that an earlier run "
        "in this process left alive after it stopped (an interrupt, another rank's failure "
        f"or out of memory), and rank {rank} of {world_size} cannot reuse it: its peers may "
        "be gone. Start the job's processes afresh (relaunch torchrun), or destroy it "
        "(torch.distributed.destroy_process_group()) on every rank before the next call")


def check_caller_group(rank: int, world_size: int) -> None:
    """SystemExit when a process group the caller made before (in-process use) is not
    this run's: its rank or world size differs from the launcher's (RANK, WORLD_SIZE;
    0 and 1 without a launcher). One an earlier run left is never the caller's
    (`end_leftover_group`)."""
    end_leftover_group(rank, world_size)
    if not dist.is_initialized():
        return
    have = (dist.get_rank(), dist.get_world_size())
    if have != (rank, world_size):
        raise SystemExit(
            f"error: the process group made before this run is rank {have[0]} of "
            f"{have[1]}, but the launcher's environment says rank {rank} of {world_size} "
            "(RANK, WORLD_SIZE; 0 of 1 when unset): set RANK and WORLD_SIZE to the "
            "group's, or destroy the group (torch.distributed.destroy_process_group()) "
            "and let the run make its own")


def initialize_distributed(parallel: ParallelConfig, rank: int, world_size: int,
                           local_rank: int, agent_store: AgentStore | None = None,
                           store=None) -> Runtime:
    """Init torch.distributed (when world_size > 1), pick the device, build ParallelState.

    `store`: the job's rendezvous store, connected before (megatron/startup_store.py's
    JobStore, for reads rank 0 made for every rank), which the default group then uses.
    Else with `agent_store` (see agent_store_from_env) the default group rendezvouses
    through torchrun's store under the namespace of this start of the job; without it,
    torch's env:// init as usual. A process group the caller already made with gloo is
    kept, and the run stays on CPU.
    """
    check_caller_group(rank, world_size)
    backend = choose_backend()
    if dist.is_initialized() and dist.get_backend() == "gloo":
        backend = "gloo"  # a gloo group made by the caller: stay on the CPU with it
    device = torch.device("cpu")
    if backend == "nccl":
        check_local_rank(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    # One minute more than --distributed-timeout-minutes: the training watchdog names the
    # missing ranks before the backend's own timeout error.
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes, seconds=60)
    if world_size > 1 and not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        if store is not None:
            store.set_timeout(timeout)  # as env:// sets it
            kwargs["store"] = store
        elif agent_store is not None:
            kwargs["store"] = attempt_store(agent_store, rank, world_size, timeout)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        _note_run_group()
    ps = ParallelState.build(
        world_size=world_size, rank=rank, tp_size=parallel.tp_size, pp_size=parallel.pp_size,
        ep_size=parallel.ep_size, virtual_pp_size=parallel.virtual_pp_size,
        sequence_parallel=parallel.sequence_parallel, timeout=timeout,
    )
    return Runtime(ps=ps, device=device, rng_tracker=RNGStatesTracker(device), backend=backend,
                   control_group=build_control_group(backend, world_size, timeout),
                   local_rank=local_rank)


def build_control_group(backend: str, world_size: int, timeout: datetime.timedelta):
    """The CPU (gloo) group over the world for host-side flags and agreements when the
    default group is not gloo; None otherwise (the default group serves). Collective."""
    if world_size > 1 and backend != "gloo":
        return dist.new_group(backend="gloo", timeout=timeout)
    return None


def local_gpu(rank: int, local_rank: int, env: Mapping[str, str], num_gpus: int) -> int:
    """The GPU of this process: LOCAL_RANK where the launcher sets it (torchrun), else
    Megatron-LM 23.05's choice, rank % the visible GPUs -- for a launch that exports RANK /
    WORLD_SIZE itself (an srun wrapper setting RANK=$SLURM_PROCID): without LOCAL_RANK every
    rank of a node took GPU 0."""
    if env.get("LOCAL_RANK", "") != "" or num_gpus < 1:
        return local_rank
    return rank % num_gpus


_triton_announced: List[bool] = []  # whether this process printed the Triton warning


def announce_broken_triton(rank: int) -> None:
    """Import Triton now (megatron.core.triton_jit.import_triton: a broken install is
    hidden before torch's lazy imports meet it) and, on global rank `rank` 0, print the
    warning for a broken install to stderr, once per process. Called by
    `initialize_entry_point` and by the tools that start without it (tools/generate.py,
    the text generation server, the checkpoint converters)."""
    import_triton()
    warning = broken_triton_warning()
    if warning and rank == 0 and not _triton_announced:
        _triton_announced.append(True)
        print(warning, file=sys.stderr, flush=True)


def warnings_once_per_job(rank: int) -> None:
    """A warning every rank gives alike (a checkpoint's loss scaler that is not the run's,
    a library's deprecation notice that every rank's call triggers) is shown by the first
    rank to give it (`first_to_report`: a count in the job's store), not once per rank:
    at thousands of ranks each was thousands of lines. A warning whose text differs per
    rank shows on each; Python's filters still decide whether one shows at all. Only in
    this process: a forked one (a data-loader worker) shares the store's connection, and
    shows its warnings itself. Without a process group every warning shows."""
    from megatron.rank_failure import first_to_report

    show = getattr(warnings.showwarning, "process_default", warnings.showwarning)
    pid = os.getpid()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if os.getpid() != pid or first_to_report("warning\t" + text, rank) is None:
            show(message, category, filename, lineno, file, line)

    showwarning.process_default = show
    warnings.showwarning = showwarning


def initialize_entry_point(parallel: ParallelConfig, cublas_workspace: str, rank: int,
                           world_size: int, local_rank: int,
                           environ: MutableMapping[str, str], store=None) -> Runtime:
    """The entry points' start (pretrain_gpt.py, tools/benchmark.py): export what
    `--cublas-workspace` asks for into `environ` (the process environment, read by torch
    when it makes its first cuBLAS handle, so before anything runs on the GPU) and
    `gloo_lazy_init_env` (read when each gloo group is made), watch the launcher (a rank
    whose torchrun is killed stops, megatron/launcher_watch.py), initialise
    (under torchrun, each start of the job keeps out of the keys of earlier ones; `store`: the job's store when the entry point connected it already, see
    `initialize_distributed`; else connected here, `_job_store`), then check one GEMM on the GPU when cuBLAS was left without
    a workspace. With several processes, a warning every rank gives alike shows once from
    then on (`warnings_once_per_job`). Rank 0 prints the warning of a broken Triton
    install (`announce_broken_triton`)."""
    one_line_project_warnings()
    announce_broken_triton(rank)
    watch_launcher(environ, rank)
    environ.update(gloo_lazy_init_env(environ))
    no_workspace = cublas_workspace_env(cublas_workspace, environ)
    if no_workspace and environ.get("CUBLAS_WORKSPACE_CONFIG") != no_workspace[
            "CUBLAS_WORKSPACE_CONFIG"]:
        environ.update(no_workspace)
        cublas_workspaces_resized()  # CUDA may have run in this process already
    if no_workspace:
        # torch's cuBLASLt calls (addmm with a bias) then run without a workspace too, and
        # say so once per process in a warning that asks for a workspace: that is the choice.
        warnings.filterwarnings("ignore", message=CUBLASLT_WORKSPACE_WARNING)
    if torch.cuda.is_available():
        local_rank = local_gpu(rank, local_rank, environ, torch.cuda.device_count())
    if store is None and world_size > 1 and not dist.is_initialized():
        store = _job_store(parallel, rank, world_size, environ)
    try:
        rt = initialize_distributed(parallel, rank, world_size, local_rank,
                                    agent_store=agent_store_from_env(environ), store=store)
    except (ValueError, dist.DistNetworkError) as e:
        message = env_rendezvous_error(e, environ, rank, world_size)
        if message is None:
            raise
        raise SystemExit(message) from None
    if world_size > 1:
        warnings_once_per_job(rank)
    if no_workspace and rt.device.type == "cuda":
        check_gemm_without_workspace(rt.device)
    return rt


def _job_store(parallel: ParallelConfig, rank: int, world_size: int,
               environ: Mapping[str, str]):
    """The job's rendezvous store for an entry point that did not connect it before (a tool
    that read nothing for the other ranks): connected as pretrain_gpt.py's is, so that an
    env:// launch whose MASTER_ADDR does not resolve, or whose ranks never all connect,
    stops with one line naming the cause and the fix (megatron/startup_store.py), not
    after the whole timeout or with the store's traceback; None where there is none to
    connect to (env:// then reports what is missing)."""
    from megatron.startup_store import JobStore

    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes, seconds=60)
    return JobStore(environ, rank, world_size).connect(timeout)


def set_random_seed(seed: int, rt: Runtime, data_parallel_random_init: bool = False) -> None:
    """Megatron's seeding: seed + 100 * pp_rank (+ 10 * dp_rank with
    --data-parallel-random-init) for python, numpy and torch; the tensor-parallel RNG
    tracker gets its own stream per TP rank."""
    if seed <= 0:
        raise ValueError(f"--seed must be positive, got {seed}")
    seed = seed + 100 * rt.ps.pp_rank
    if data_parallel_random_init:
        seed = seed + 10 * rt.ps.dp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_seed(seed, rt.ps.tp_rank, rt.rng_tracker)
