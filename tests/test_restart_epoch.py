"""megatron/restart_epoch.py: the processes of one start of a job agree on a namespace in
torchrun's agent store whatever earlier starts left in it (threads stand for processes)."""
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from megatron import restart_epoch
from megatron.restart_epoch import ROOT, agree_on_epoch, epoch_prefix


def _server(seconds=10):
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                         timeout=datetime.timedelta(seconds=seconds))


def _client(server, seconds=10):
    return dist.TCPStore("127.0.0.1", server.port, 1, is_master=False,
                         timeout=datetime.timedelta(seconds=seconds))


def _start(server, ranks, world_size, seconds=10, delay=None):
    """agree_on_epoch on each of `ranks` in its own thread with its own client; rank r
    starts after delay[r] seconds. {rank: epoch or the exception raised}."""
    out = {}
    delay = delay or {}

    def run(rank):
        time.sleep(delay.get(rank, 0))
        try:
            out[rank] = agree_on_epoch(_client(server, seconds), rank, world_size,
                                       datetime.timedelta(seconds=seconds))
        except Exception as exc:  # noqa: BLE001 -- the test looks at it
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds * 3)
    return out


def test_every_start_agrees_on_a_new_epoch():
    server = _server()
    first = _start(server, range(4), 4)
    assert len(set(first.values())) == 1 and isinstance(first[0], int), first
    second = _start(server, range(4), 4, delay={0: 0.3})  # rank 0 last this time
    assert len(set(second.values())) == 1 and isinstance(second[0], int), second
    assert second[0] != first[0]
    # a start leaves one key of its agreement (formed/<epoch>) besides the start counters
    store = _client(server)
    assert not store.check([f"{ROOT}acked/{second[0]}"])
    assert not any(store.check([f"{ROOT}answer/{r}/2"]) for r in range(1, 4))
    assert store.check([f"{ROOT}formed/{second[0]}"])
    # what the first start wrote under its namespace is not under the second's
    dist.PrefixStore(epoch_prefix(first[0]), _client(server)).set("default_pg/0", "old")
    assert not dist.PrefixStore(epoch_prefix(second[0]), _client(server)).check(["default_pg/0"])


def test_a_start_agrees_whatever_the_previous_one_left():
    """The previous start ended in the middle of its agreement: rank 2 died before it
    counted its start (its counter is behind the others'), rank 1 counted and was answered
    but never acknowledged, rank 3 is still waiting for an answer from a rank 0 that died.
    Restart counts are not involved: every process of the new start agrees on one epoch,
    a new one."""
    server = _server()
    old = _start(server, range(4), 4)[0]
    store = _client(server)
    for rank in (0, 1, 3):
        store.add(f"{ROOT}incarnation/{rank}", 1)
    stale = store.add(f"{ROOT}epoch", 1)
    store.set(f"{ROOT}answer/1/{store.add(f'{ROOT}incarnation/1', 0)}", str(stale))
    new = _start(server, range(4), 4, delay={2: 0.2})
    assert len(set(new.values())) == 1 and isinstance(new[0], int), new
    assert new[0] not in (old, stale)


def test_rank_0_names_the_ranks_that_never_join(monkeypatch):
    monkeypatch.setattr(restart_epoch, "ACK_S", 0.5)  # rank 1's wait after rank 0's
    monkeypatch.setattr(restart_epoch, "FORMED_S", 0.5)
    server = _server()
    began = time.monotonic()
    out = _start(server, [0, 1], 4, seconds=2)
    assert isinstance(out[0], RuntimeError), out
    assert "2 of the 4 ranks" in str(out[0]) and "ranks 2, 3" in str(out[0])
    assert time.monotonic() - began < 12


def test_a_rank_whose_rank_0_never_comes_says_so():
    server = _server()
    out = _start(server, [1], 2, seconds=1)
    assert isinstance(out[1], RuntimeError) and "rank 1 waited" in str(out[1]), out
    assert "rank 0's process did not start" in str(out[1])


@pytest.mark.parametrize("world_size", [2, 16])
def test_many_ranks_in_any_order(world_size):
    server = _server()
    delay = {r: (r * 7 % 5) / 20 for r in range(world_size)}
    out = _start(server, range(world_size), world_size, delay=delay)
    assert len(out) == world_size and len(set(out.values())) == 1, out


def test_a_rank_that_came_before_a_late_rank_is_not_the_one_to_fail():
    """Rank 1 comes first, rank 0 0.6 s later, rank 2 0.2 s after rank 1's own wait
    (3 s) would have run out, but within rank 0's: every rank joins. Rank 0 answered only
    once every rank had counted its start, and rank 1 left when its wait ran out, blaming
    rank 0 ("did not start"): the launcher then ended the job on that message."""
    server = _server()
    out = _start(server, range(3), 3, seconds=3, delay={0: 0.6, 2: 3.2})
    assert len(set(out.values())) == 1 and isinstance(out[0], int), out


def test_a_rank_0_that_waits_for_a_missing_rank_fails_first_and_names_it(monkeypatch):
    """Rank 2 never comes: rank 0 names it when its wait runs out, while rank 1, which
    came before rank 0 and was answered, still waits for rank 0 to see every rank join
    (the launcher ends it on rank 0's error); its own message, later, says it joined."""
    server = _server()
    ended = {}
    out = {}

    def timed(rank, delay):
        time.sleep(delay)
        try:
            out[rank] = agree_on_epoch(_client(server, 2), rank, 3, datetime.timedelta(seconds=2))
        except RuntimeError as exc:
            out[rank] = exc
        ended[rank] = time.monotonic()

    monkeypatch.setattr(restart_epoch, "ACK_S", 0.5)
    monkeypatch.setattr(restart_epoch, "FORMED_S", 1.0)
    threads = [threading.Thread(target=timed, args=(r, d)) for r, d in ((1, 0.0), (0, 0.6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert "(ranks 2)" in str(out[0]), out
    assert ended[0] < ended[1], (ended, out)
    assert "rank 1 joined this start" in str(out[1]) and "did not start" not in str(out[1])


def test_rank_0_waits_for_the_acknowledgement_of_a_rank_it_answered_at_its_deadline():
    """Rank 1 counts its start just before rank 0's wait runs out; rank 0 answers it,
    and its acknowledgement comes after the deadline (thousands of ranks append theirs
    to one key): rank 0 takes it, where it reported rank 1 as never having joined. An
    answered rank whose acknowledgement never comes is reported ACK_S later."""
    for acks in (True, False):
        store = dist.HashStore()
        store.add(f"{ROOT}incarnation/1", 1)  # rank 1 came, and waits for its answer
        now = [0.0]

        def sleep(seconds, store=store, now=now, acks=acks):
            now[0] += 11.0  # the first sleep outlasts the 10-s deadline
            epoch = store.add(f"{ROOT}epoch", 0)
            if acks and now[0] > 20 and store.check([f"{ROOT}answer/1/1"]):
                store.append(f"{ROOT}acked/{epoch}", "1 ")

        run = lambda: restart_epoch._rank_0(  # noqa: E731
            store, 2, datetime.timedelta(seconds=10), clock=lambda: now[0], sleep=sleep)
        if acks:
            assert run() == 1
        else:
            with pytest.raises(RuntimeError, match=r"\(ranks 1\)"):
                run()
            assert now[0] > restart_epoch.ACK_S
