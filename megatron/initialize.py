"""Process-group set-up, device choice and seeds for one training process.

The entry point reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) and passes
the values in; nothing below reads os.environ.
"""
from __future__ import annotations

import datetime
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.config import ParallelConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed


@dataclass
class Runtime:
    """What initialisation produced: the grid, the device and the RNG tracker."""

    ps: ParallelState
    device: torch.device
    rng_tracker: RNGStatesTracker
    backend: str
    control_group: object = None  # CPU (gloo) group over the world for host-side flags


def choose_backend() -> str:
    """nccl when CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize_distributed(parallel: ParallelConfig, rank: int, world_size: int,
                           local_rank: int) -> Runtime:
    """Init torch.distributed (when world_size > 1), pick the device, build ParallelState."""
    backend = choose_backend()
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    # One minute more than --distributed-timeout-minutes: the training watchdog names the
    # missing ranks before the backend's own timeout error.
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes, seconds=60)
    if world_size > 1 and not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    ps = ParallelState.build(
        world_size=world_size, rank=rank, tp_size=parallel.tp_size, pp_size=parallel.pp_size,
        ep_size=parallel.ep_size, virtual_pp_size=parallel.virtual_pp_size,
        sequence_parallel=parallel.sequence_parallel, timeout=timeout,
    )
    control_group = None
    if world_size > 1 and backend != "gloo":
        control_group = dist.new_group(backend="gloo", timeout=timeout)
    return Runtime(ps=ps, device=device, rng_tracker=RNGStatesTracker(device), backend=backend,
                   control_group=control_group)


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
