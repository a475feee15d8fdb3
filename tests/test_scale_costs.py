"""Costs that grow with the world size, counted on a few gloo processes.

A job of thousands of GPUs multiplies every per-rank cost by the world size N: what each
rank does O(N) times adds up to O(N^2) in all. These tests count calls
(tests/op_counts.py) at two or three small world sizes and pin that they do not grow where
they must not: process-group creation, the rendezvous store's traffic at start-up, the
per-step exit checks, and the checkpoint agreements.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.op_counts import OpCounter


def _new_groups(counter: OpCounter) -> int:
    return sum(n for (name, _), n in counter.collectives.items() if name == "new_group")


def _groups_worker(rank, world_size, layouts):
    counter = OpCounter.collectives_only()
    out = {}
    try:
        for tp, pp in layouts:
            counter.reset()
            ParallelState.build(world_size, dist.get_rank(), tp, pp)
            out[tp, pp] = _new_groups(counter)
    finally:
        counter.uninstall()
    return out


def test_group_creation_does_not_grow_with_the_world_size():
    """Every rank calls new_group for every group (with NCCL on a device-bound default
    group, each call is a communicator split over the whole world). A data-parallel
    layout (tp = pp = 1) used to make 6 one-rank groups per rank of the world (tp, pp,
    mp, embedding, position embedding, expert) plus an expert-data-parallel copy of the
    data-parallel group: 6N + 2 calls per rank; now one, the data-parallel group. tp 2,
    pp 2 on 4 ranks: 2 tp + 2 pp + 1 mp + 2 embedding groups (it was 21 calls)."""
    dp_only = {n: run_distributed(_groups_worker, n, [(1, 1), (2, 2)] if n == 4 else [(1, 1)])
               for n in (2, 4)}
    for n, results in dp_only.items():
        assert [r[1, 1] for r in results] == [1] * n, (n, results)
    assert [r[2, 2] for r in dp_only[4]] == [7] * 4


def _start_up_worker(rank, world_size, port):
    """Store requests of pretrain_gpt.py's start-up on this rank: initialize_entry_point
    (the default group, the parallel groups) and the CPU control group a GPU run makes."""
    import datetime
    import os

    from megatron import initialize
    from megatron.core.config import ParallelConfig
    from tests.op_counts import CountingStore, total

    dist.destroy_process_group()  # run_distributed's: start as the entry point does
    stores = []
    real_init = dist.init_process_group

    def init_on_counting_store(backend, **kwargs):
        inner = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=120))
        stores.append(CountingStore(inner))
        real_init(backend, store=stores[0], **kwargs)

    dist.init_process_group = init_on_counting_store
    try:
        initialize.initialize_entry_point(ParallelConfig(), "torch", rank, world_size, rank,
                                          os.environ)
        initialize.build_control_group("nccl", world_size, datetime.timedelta(seconds=120))
    finally:
        dist.init_process_group = real_init
    return total(stores[0].counts)


def test_start_up_store_requests_do_not_grow_with_the_world_size():
    """A gloo group used to connect every pair of its ranks when made: each rank asked the
    rendezvous store for the address of each other rank (about 2N requests per rank and
    world-wide gloo group: the CPU default group, a data-parallel group of the whole
    world, and a GPU run's control group), 2N^2 in all on one server. The entry point now
    exports TORCH_GLOO_LAZY_INIT=1: the same few requests per rank at any world size."""
    from tests.dist_utils import free_port

    per_world = {n: run_distributed(_start_up_worker, n, free_port()) for n in (2, 4)}
    assert len(set(per_world[2] + per_world[4])) == 1, per_world


def test_lazy_gloo_keeps_a_users_choice():
    from megatron.initialize import gloo_lazy_init_env

    assert gloo_lazy_init_env({}) == {"TORCH_GLOO_LAZY_INIT": "1"}
    assert gloo_lazy_init_env({"TORCH_GLOO_LAZY_INIT": "0"}) == {}
