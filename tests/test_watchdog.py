"""megatron/watchdog.py: a watched block that overruns names the ranks that never arrived;
2 real gloo processes where rank 1 sleeps past the timeout end with rank 1 named."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.watchdog import EXIT_CODE, CollectiveWatchdog, NullWatchdog, build_watchdog
from tests.dist_utils import free_port, run_distributed


def _watchdog(store, rank=0, world=3, timeout=0.3):
    fired = []
    return CollectiveWatchdog(store, rank, world, timeout, on_timeout=fired.append), fired


def test_overrun_names_the_ranks_that_did_not_arrive():
    store = dist.HashStore()
    store.set("collective-watchdog/all-reduce/rank1", "1")  # rank 1 arrived, rank 2 did not
    wd, fired = _watchdog(store)
    with wd.watch("all-reduce"):
        time.sleep(1.0)
    wd.close()
    assert len(fired) == 1
    assert ("[watchdog rank 0] collective all-reduce did not complete within 0.3 s; ranks that "
            "did not arrive: [2]") in fired[0]
    assert "rank 2 reached 'all-reduce' 0 times" in fired[0]


def test_counts_per_name_and_group_members():
    store = dist.HashStore()
    wd, fired = _watchdog(store, timeout=5)
    for _ in range(3):
        with wd.watch("grads", ranks=[0, 2]):
            pass
    store.set("collective-watchdog/grads/rank2", "2")
    assert wd.missing_ranks("grads", 3, [0, 2]) == [2]  # rank 2 is one call behind
    store.set("collective-watchdog/grads/rank2", "3")
    assert wd.missing_ranks("grads", 3, [0, 2]) == []
    msg = wd.timeout_message("grads", 3, [0, 2])
    assert "ranks that did not arrive: []" in msg and "every rank arrived" in msg
    wd.close()
    assert fired == []


def test_fast_blocks_never_fire():
    wd, fired = _watchdog(dist.HashStore(), timeout=0.5)
    for _ in range(20):
        with wd.watch("barrier"):
            time.sleep(0.05)
    time.sleep(0.7)  # past the deadline of every block, none active
    wd.close()
    assert fired == []


def test_single_process_gets_the_null_watchdog():
    assert not dist.is_initialized()
    wd = build_watchdog(1.0)
    assert isinstance(wd, NullWatchdog)
    with wd.watch("anything"):
        pass


def _all_reduces(rank, world_size):
    wd = build_watchdog(30.0)
    out = []
    for step in range(3):
        t = torch.tensor([float(rank + step)])
        with wd.watch("all-reduce (world)"):
            dist.all_reduce(t)
        out.append(t.item())
    wd.close()
    return type(wd).__name__, out


def test_real_collectives_on_the_default_store():
    for name, out in run_distributed(_all_reduces, 2):
        assert name == "CollectiveWatchdog" and out == [1.0, 3.0, 5.0]


def _hang_child(rank: int, port: int, log: str) -> None:
    """One rank of the hang test (a forked process, stdout/stderr into `log`): rank 1
    sleeps before the all-reduce for longer than the watchdog's 2-second timeout."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", closefd=False)  # pytest's capture objects are not fds 1 and 2
    sys.stderr = open(2, "w", closefd=False)
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    wd = build_watchdog(2.0)
    if rank == 1:
        time.sleep(60)
    t = torch.ones(4)
    with wd.watch("all-reduce of gradients (dp group)"):
        dist.all_reduce(t)
    print("finished", flush=True)
    os._exit(0)


def test_sleeping_rank_is_named_and_the_run_ends(tmp_path):
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    procs = [ctx.Process(target=_hang_child, args=(r, port, logs[r])) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=45)
    finally:
        procs[1].kill()
        procs[1].join()
        if procs[0].is_alive():
            procs[0].kill()
    out = Path(logs[0]).read_text()
    assert procs[0].exitcode == EXIT_CODE, out
    assert ("[watchdog rank 0] collective all-reduce of gradients (dp group) did not complete "
            "within 2 s; ranks that did not arrive: [1]") in out
    assert "finished" not in out
