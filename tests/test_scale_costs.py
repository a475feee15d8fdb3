"""Costs that grow with the world size, counted on a few gloo processes.

A job of thousands of GPUs multiplies every per-rank cost by the world size N: what each
rank does O(N) times adds up to O(N^2) in all. These tests count calls
(tests/op_counts.py) at two or three small world sizes and pin that they do not grow where
they must not: process-group creation, the rendezvous store's traffic at start-up, the
per-step exit checks, and the checkpoint agreements.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch.distributed as dist

from megatron.core.parallel_state import ParallelState
from megatron.watchdog import CollectiveWatchdog
from tests.dist_utils import run_distributed
from tests.op_counts import CountingStore, OpCounter


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
    requests = total(stores[0].counts)
    # rank 0 holds the store: it must not exit while another rank still uses it (a lazy
    # gloo connection's address look-up: 'Broken pipe' or 'Failed to recv' on that rank,
    # seen under load, also after a barrier that rank 0 had left). Every other rank
    # counts itself done on the store after its last collective; rank 0 waits for them.
    dist.barrier()
    _wait_for_all_done(stores[0].inner, rank, world_size)
    return requests


def _wait_for_all_done(store, rank: int, world_size: int) -> None:
    if rank != 0:
        store.add("test-ranks-done", 1)
        return
    deadline = time.monotonic() + 120
    while store.add("test-ranks-done", 0) < world_size - 1:
        assert time.monotonic() < deadline, "the other ranks never finished"
        time.sleep(0.05)


def test_start_up_store_requests_do_not_grow_with_the_world_size():
    """A gloo group used to connect every pair of its ranks when made: each rank asked the
    rendezvous store for the address of each other rank (about 2N requests per rank and
    world-wide gloo group: the CPU default group, a data-parallel group of the whole
    world, and a GPU run's control group), 2N^2 in all on one server. The entry point now
    exports TORCH_GLOO_LAZY_INIT=1: the same few requests per rank at any world size."""
    from tests.dist_utils import free_port

    per_world = {n: run_distributed(_start_up_worker, n, free_port()) for n in (2, 4)}
    # 3 requests per rank at either size on a quiet machine; torch's store-based barrier
    # polls the store while it waits, so a loaded machine adds a few: a bound, not an
    # equality (the full mesh made 28 per rank at N = 2 and 36 at N = 4)
    assert max(per_world[2] + per_world[4]) <= 12, per_world


def test_lazy_gloo_keeps_a_users_choice():
    from megatron.initialize import gloo_lazy_init_env

    assert gloo_lazy_init_env({}) == {"TORCH_GLOO_LAZY_INIT": "1"}
    assert gloo_lazy_init_env({"TORCH_GLOO_LAZY_INIT": "0"}) == {}


# --------------------------------------------------------- tree reduction over the world
def _max_worker(rank, world_size):
    from megatron.agreed_exit import max_over_ranks

    sub = dist.new_group([1, 3, 4])
    counter = OpCounter.collectives_only()
    try:
        world = max_over_ranks([rank, -rank, rank % 2, 7.5])
        mine = counter.report()["collectives"]
        part = max_over_ranks([10 - rank], sub) if rank in (1, 3, 4) else None
    finally:
        counter.uninstall()
    return world, mine, part


def test_max_over_ranks_reduces_over_a_tree():
    """Element-wise MAX on every rank (5 ranks: a tree that is not full; a group whose
    ranks are not 0..n-1), with at most ceil(log2 5) = 3 point-to-point messages and one
    broadcast per rank: no ring all-reduce."""
    results = run_distributed(_max_worker, 5)
    for rank, (world, calls, part) in enumerate(results):
        assert world == [4.0, 0.0, 1.0, 7.5], rank
        p2p = sum(n for (name, _), n in calls.items() if name in ("send", "recv"))
        assert 1 <= p2p <= 3 and calls[("broadcast", 5)] == 1, (rank, calls)
        assert set(name for name, _ in calls) <= {"send", "recv", "broadcast"}, calls
        assert part == ([9.0] if rank in (1, 3, 4) else None)


# ------------------------------------------------- the training loop's world collectives
RING = ("all_reduce", "all_gather_object")  # a ring on gloo: 2(N-1) messages in a row


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    """Counts of whole pretrain_gpt.py runs on 4 ranks, tp 2 (the data-parallel and
    tensor-parallel groups have 2 ranks, so a collective over 4 is one over the world),
    with --exit-signal-handler and --exit-duration-in-mins: 2 and 4 steps, 4 steps with
    2 saves, and a load of the last one; file system calls under the checkpoint root."""
    from tests.dist_utils import free_port
    from tests.op_counts import count_pretrain_runs

    root = tmp_path_factory.mktemp("scale")
    save = str(root / "ck")
    flags = ["--tensor-model-parallel-size", "2", "--global-batch-size", "2",
             "--exit-signal-handler", "--exit-duration-in-mins", "1000"]
    runs = {"two steps": flags + ["--train-iters", "2"],
            "four steps": flags + ["--train-iters", "4"],
            "two saves": flags + ["--train-iters", "4", "--save", save, "--save-interval", "2"],
            "load": flags + ["--train-iters", "6", "--load", save]}
    return run_distributed(count_pretrain_runs, 4, free_port(), runs, save)


def test_steps_saves_and_loads_make_no_ring_collective_over_the_world(four_rank_runs):
    """With --exit-signal-handler and --exit-duration-in-mins each iteration made two
    all-reduces over the world (gloo's are rings: 2(N-1) messages one after another, a
    second or so per iteration at thousands of GPUs), and each agreement of the saves and
    the load an all_gather_object (a ring too). Now one tree reduction per iteration
    (`max_over_ranks`) and per agreement."""
    from tests.op_counts import difference

    for rank, counts in enumerate(four_rank_runs):
        calls = {name: c["collectives"] for name, c in counts.items()}
        per_two_steps = difference(calls["four steps"], calls["two steps"])
        saves = difference(calls["two saves"], calls["four steps"])
        for what, got in (("two steps", per_two_steps), ("two saves", saves),
                          ("load", calls["load"])):
            rings = {k: n for k, n in got.items() if k[0] in RING and k[1] == 4}
            assert not rings, (rank, what, got)
        assert per_two_steps[("broadcast", 4)] == 2, per_two_steps  # one exit check a step


def test_only_rank_0_inspects_the_checkpoint_it_loads(four_rank_runs):
    """The load's check of the first rank's file (its layout, arguments, states) ran on
    every rank: each listed the iteration directory twice, stat-ed two files per
    (tp, pp) directory twice and read the same file -- at thousands of ranks, a storm of
    requests on one directory of the shared file system. Now rank 0 checks and tells the
    others: they look at their own file only."""
    files = [counts["load"]["files"] for counts in four_rank_runs]
    assert files[0].get("listdir", 0) >= 1, files[0]
    for rank in (1, 2, 3):
        assert files[rank].get("listdir", 0) == 0, (rank, files[rank])
        assert files[rank].get("stat", 0) < files[0]["stat"], files


# ----------------------------------------------------------- the shared file system
def test_rank_0_looks_for_the_writers_markers_less_often_as_a_save_goes_on(tmp_path):
    """--async-save: global rank 0 waits for a marker of each writer (tensor x pipeline of
    them) in the checkpoint directory. It looked every 20 ms for as long as the writers
    took -- minutes at scale, thousands of metadata requests a second on the shared
    file system; now the pauses grow to MAX_POLL_S: about ten looks in the first second."""
    import threading

    from megatron.async_save import mark_done, wait_for_markers
    from tests.op_counts import FsCounter

    writers = [f"mp_rank_{t:02d}_{p:03d}" for t in range(4) for p in range(2)]
    done = threading.Timer(1.0, lambda: [mark_done(str(tmp_path), d) for d in writers])
    files = FsCounter(str(tmp_path))
    done.start()
    try:
        wait_for_markers(str(tmp_path), writers, timeout_s=30)
    finally:
        files.uninstall()
        done.join()
    looks = files.counts["stat"] / len(writers)  # one stat per writer and look, at most
    assert 1 <= looks <= 15, files.counts


READS = ("check", "get", "multi_get", "add", "wait")


def _overrun_store_reads(world: int) -> int:
    """Every rank but the last waits in a block over the whole world that the last never
    reaches, all with the same timeout (their deadlines pass together, as in a collective
    they entered together); the store reads all their watchdogs make until each has
    reported."""
    fired, reads = _overrun(world, range(world - 1), {})
    assert len(fired) == world - 1, fired
    assert all(f"ranks that did not arrive: [{world - 1}]" in m.splitlines()[0] for m in fired)
    return reads


def _overrun(world, ranks, progress):
    """The watchdogs of `ranks` (of `world`) inside 'all-reduce of gradients' (over the
    world, `progress[r]`: rank r's collective count, if any) past their 0.3-s timeout:
    (their reports, the store reads they made)."""
    store = CountingStore(dist.HashStore())
    fired = []
    wds = {r: CollectiveWatchdog(store, r, world, 0.3, poll_s=10.0, on_timeout=fired.append)
           for r in ranks}
    with contextlib.ExitStack() as blocks:
        for r, wd in wds.items():
            blocks.enter_context(wd.watch("all-reduce of gradients", progress=progress.get(r)))
        time.sleep(1.5)
    for wd in wds.values():
        wd.close()
    return fired, sum(n for (op, _), n in store.counts.items() if op in READS)


def test_an_overrun_over_the_world_reads_the_store_o_n_times():
    """A hang in a collective over the whole world: every waiting rank read every rank's
    check-ins, N^2 store requests in all (at 8,000 ranks the report came after the
    backend's own timeout). Now one rank per overrun reads them and the others wait for
    its verdict: a few requests per rank."""
    for world in (4, 8):
        reads = _overrun_store_reads(world)
        assert reads <= 10 * world, (world, reads)


def test_a_rank_behind_in_a_block_over_the_world_is_found_in_o_n_store_reads():
    """Every rank entered the block; the last issued one collective fewer. Every member
    read every other's collective count, N^2 requests in all; now the reporting member
    alone does."""
    for world in (4, 8):
        counts = {r: (lambda r=r: 41 if r == world - 1 else 42) for r in range(world)}
        fired, reads = _overrun(world, range(world), counts)
        assert len(fired) == world, fired
        assert all(f"ranks that did not arrive: [{world - 1}]" in m.splitlines()[0] for m in fired)
        assert reads <= 12 * world, (world, reads)


def _staggered_overrun(world: int, late_s: float):
    """Rank 0 enters 'optimizer step' (over the world, progress: 42 collectives) at once,
    ranks 1.. of `world` `late_s` later (the last with 41: behind), all with a 1-s timeout;
    rank 0's deadline passes first: it reads the others' check-ins and waits for their
    counts, which come once their own deadlines pass. Returns (the reports, each rank's
    store requests by operation)."""
    inner = dist.HashStore()
    stores = [CountingStore(inner) for _ in range(world)]
    fired = []
    wds = [CollectiveWatchdog(stores[r], r, world, 1.0, poll_s=10.0, on_timeout=fired.append)
           for r in range(world)]
    with contextlib.ExitStack() as blocks:
        for r, wd in enumerate(wds):
            if r == 1:
                time.sleep(late_s)
            issued = 41 if r == world - 1 else 42
            blocks.enter_context(wd.watch("optimizer step", progress=lambda n=issued: n))
        time.sleep(2.5)
    for wd in wds:
        wd.close()
    return fired, [s.requests for s in stores]


def test_the_reporting_rank_polls_the_late_counts_with_one_request_per_look():
    """While the reporting member waited for the other members' collective counts, it
    looked for each missing one's key, one request per key, every 0.05 s, and it read
    each member's check-ins with two requests: with 7 members half a second late, 93
    requests from one rank to the job's one store server (at thousands of ranks,
    thousands per look). Now one `check` of all the missing keys per look, looks less and
    less often, and one `multi_get` once they are all there; the check-ins likewise."""
    world = 8
    fired, requests = _staggered_overrun(world, late_s=0.5)
    assert len(fired) == world, fired
    assert all(f"ranks that did not arrive: [{world - 1}]" in m.splitlines()[0] for m in fired)
    # rank 0, whose deadline passed half a second before the others', reported
    reads = [sum(n for op, n in requests[r].items() if op in READS) for r in range(world)]
    assert max(reads) <= 15, requests
