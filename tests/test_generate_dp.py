"""Data-parallel replicas in text generation (world size = tp x pp x dp). generate.py
splits a --prompt-file's prompts over the replicas in contiguous blocks and rank 0
prints the one-process answers in the file's order: greedy and seeded sampled ids equal
(line i draws from --seed + i whichever replica runs it), with and without the cache,
for 5 prompts over 2 replicas (3 + 2) and for fewer prompts than replicas; at tp 1 x dp 2
and tp 2 x dp 2. The server at dp 2 answers a request that comes while replica 0 is busy
from replica 1, as one process would, and every rank exits 0 when rank 0 stops."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from tests.dist_utils import run_distributed
from tests.test_generate_pp import _cli
from tests.test_generate_tp import ckpt_tp1, two_rank_server  # noqa: F401
from tools import generate
from tools import run_text_generation_server as server_mod
from tools import text_generation_ranks as ranks_mod
from tools.generate_tp import check_generation_layout, replica_block


def test_replica_blocks_cover_the_prompts_in_order():
    assert [list(replica_block(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(replica_block(1, r, 3)) for r in range(3)] == [[0], [], []]
    assert [list(replica_block(7, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert list(replica_block(4, 0, 1)) == [0, 1, 2, 3]


def test_world_must_be_a_multiple_of_the_model():
    check_generation_layout("x", 4, 2, 1)  # 2 replicas
    check_generation_layout("x", 8, 2, 2)
    with pytest.raises(SystemExit, match="world size 6 with --tensor-model-parallel-size 2 x "
                                         "--pipeline-model-parallel-size 2 = 4: the world "
                                         "size must be a multiple of 4.*--nproc-per-node 4"):
        check_generation_layout("x", 6, 2, 2)


def _runs(tmp_path):
    five, one = tmp_path / "five.txt", tmp_path / "one.txt"
    five.write_text("5 6 7\n9\n1 2 3 4 5 6\n8 8\n3 1 4 1 5\n")
    one.write_text("2 7 1 8\n")
    tail = ("--max-new-tokens", "6", "--no-stop-at-eod")
    sampled = ("--temperature", "1.5", "--seed", "3", *tail)
    return [("--prompt-file", str(five), "--greedy", *tail),
            ("--prompt-file", str(five), *sampled),
            ("--prompt-file", str(five), "--no-kv-cache", *sampled),
            ("--prompt-file", str(one), *sampled),
            ("--prompt", "5 6 7", *sampled)]


def _dp_worker(rank, world_size, ckpt, tp, runs):
    """Each run's printout on this rank, and the batch sizes this rank decoded."""
    rows, batch = [], generate.generate_batch

    def counted(model, prompts, *args, **kwargs):
        rows.append(len(prompts))
        return batch(model, prompts, *args, **kwargs)

    generate.generate_batch = counted
    flags = ("--tensor-model-parallel-size", str(tp))
    return {"out": [_cli(rank, world_size, ckpt, (*flags, *f)) for f in runs], "rows": rows}


def _check(results, ckpt, runs):
    for flags, printed in zip(runs, results[0]["out"]):
        alone = [json.loads(line) for line in _cli(0, 1, ckpt, flags).splitlines()]
        assert [json.loads(line) for line in printed.splitlines()] == alone, flags
    assert all(r["out"] == [""] * len(runs) for r in results[1:])  # rank 0 prints
    tp = len(results) // 2
    # 5 prompts: 3 on replica 0, 2 on replica 1 (twice: greedy, sampled); 1 prompt: replica 0
    assert [r["rows"] for r in results] == [[3, 3, 1]] * tp + [[2, 2]] * tp


def test_tp1_dp2_generates_as_one_process(ckpt_tp1, tmp_path):  # noqa: F811
    runs = _runs(tmp_path)
    _check(run_distributed(_dp_worker, 2, ckpt_tp1, 1, runs), ckpt_tp1, runs)


@pytest.mark.slow
def test_tp2_dp2_generates_as_one_process(ckpt_tp1, tmp_path):  # noqa: F811
    runs = _runs(tmp_path)
    _check(run_distributed(_dp_worker, 4, ckpt_tp1, 2, runs), ckpt_tp1, runs)


def _slow_replica_worker(rank, world_size, ckpt, prompt_file):
    """generate.py at dp 2 in a process group whose timeout (3 s, from the first batch on:
    loading the model is not the part under test, and on a loaded machine its collectives
    may wait longer) is shorter than replica 1's block takes (6 s more than replica 0's):
    rank 0 waits for it."""
    import datetime
    import time

    import torch.distributed as dist

    batch = generate.generate_batch

    def slow(model, prompts, *args, **kwargs):
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=3))
        if rank == 1:
            time.sleep(6)
        return batch(model, prompts, *args, **kwargs)

    generate.generate_batch = slow
    return _cli(rank, world_size, ckpt, ("--prompt-file", prompt_file, "--greedy",
                                         "--max-new-tokens", "4"))


def test_a_replica_waits_for_a_slower_one_past_the_group_timeout(ckpt_tp1, tmp_path):  # noqa: F811
    """The answers are gathered in a group of their own (tools/generate_tp.py
    ANSWERS_WAIT): over the process group, whose timeout is --distributed-timeout-minutes,
    a replica that finished its block first failed once another replica's block took
    longer than that."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 6 7\n9\n1 2 3\n")
    out = run_distributed(_slow_replica_worker, 2, ckpt_tp1, str(prompts))
    alone = _cli(0, 1, ckpt_tp1, ("--prompt-file", str(prompts), "--greedy",
                                  "--max-new-tokens", "4"))
    assert out == [alone, ""] and len(alone.splitlines()) == 3


# -------------------------------------------------------------------------- server
_SLOW = "9 8 7 6 5"  # a prompt the replicas take 4 s longer to answer


def _serve_dp2_worker(rank, world_size, ckpt, port, pid_dir):
    """A server rank at tp (world size / 2) x dp 2 (as tests/test_generate_tp.py's
    _serve_worker); its
    stdout goes to pid_dir/log<R>, the first prompt of each request it ran, one a line, to
    pid_dir/ran<R> (before it runs it)."""
    import time

    from tools.text_generation_api import run_request

    def counted(engine, req):
        with open(os.path.join(pid_dir, f"ran{rank}"), "a") as f:
            f.write(req.prompts[0] + "\n")
        if req.prompts[0] == _SLOW:
            time.sleep(4)
        return run_request(engine, req)

    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    ranks_mod.run_request, ranks_mod.HEARTBEAT_S = counted, 0.2
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    with open(os.path.join(pid_dir, f"log{rank}"), "w") as log:
        with contextlib.redirect_stdout(log):
            return server_mod.main(["--load", ckpt, "--port", str(port),
                                    "--tensor-model-parallel-size", str(world_size // 2)],
                                   environ=env)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_server_at_dp2_answers_side_by_side(ckpt_tp1, tmp_path, tp):  # noqa: F811
    """A request arriving while replica 0 runs a slow one is run by replica 1 and answered
    first; both answers (the second unseeded: its base seed is the server's third draw,
    after the readiness probe's and the first's) are a one-process server's for the same
    requests in the same order. A request that fails its checks is answered 400 by rank 0
    and run by no replica. Then Ctrl-C on rank 0 ends both ranks with 0."""
    import threading
    import time

    from tools.text_generation_api import parse_request, run_request
    from tools.text_generation_cli import put

    slow = {"prompts": [_SLOW, "5 6 7"], "tokens_to_generate": 8, "temperature": 1.5}
    quick = {"prompts": ["3 1 4"], "tokens_to_generate": 6}
    answers, order = {}, []

    def ask(name, body):
        answers[name] = put(url, body, timeout=60)
        order.append(name)

    with two_rank_server(_serve_dp2_worker, ckpt_tp1, tmp_path, world_size=2 * tp) as url:
        first = threading.Thread(target=ask, args=("slow", slow))
        first.start()
        ran0 = tmp_path / "ran0"
        while _SLOW not in ran0.read_text():  # replica 0 has taken it
            time.sleep(0.05)
        ask("quick", quick)
        first.join(60)
        bad = put(url, {"prompts": ["5 999"]}, timeout=60)  # refused on rank 0: not sent
    assert bad[0] == 400 and "outside the vocabulary" in bad[1], bad
    assert order == ["quick", "slow"]
    for rank in range(2 * tp):  # replica 0: the probe, the slow one; replica 1: the other
        want = f"1\n{_SLOW}\n" if rank < tp else "3 1 4\n"
        assert (tmp_path / f"ran{rank}").read_text() == want, rank
    a, ns, explicit = server_mod.parse_args(["--load", ckpt_tp1])
    engine, _ = server_mod.build_engine(a, ns, explicit, environ={})
    want = [run_request(engine, parse_request(body))
            for body in ({"prompts": ["1"], "tokens_to_generate": 1}, slow, quick)]
    for name, w in zip(("slow", "quick"), want[1:]):
        status, text = answers[name]
        assert status == 200, text
        assert json.loads(text)["text"] == w["text"], name
    log = (tmp_path / "log0").read_text()
    assert "2 data-parallel replicas" in log and "up to 2 requests run at once" in log


def _serve_dp2_short_timeout_worker(rank, world_size, ckpt, port, pid_dir):
    """`_serve_dp2_worker` in a process group whose timeout (3 s once the model is loaded:
    on a loaded machine the loading collectives may wait longer) is shorter than the
    two-prompt request takes on rank 0 (5 s more)."""
    import datetime
    import time

    import torch.distributed as dist

    build = server_mod.build_engine

    def build_then_shorten(*args, **kwargs):
        # the group's timeout shortened in place (a new group on the same port may meet
        # the other rank still on the old one's store)
        built = build(*args, **kwargs)
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=3))
        return built

    server_mod.build_engine = build_then_shorten
    from tools import text_generation_api

    run = text_generation_api.run_request

    def slow(engine, req):
        if len(req.prompts) == 2:
            time.sleep(5)
        return run(engine, req)

    text_generation_api.run_request = slow  # what _serve_dp2_worker's count calls
    return _serve_dp2_worker(rank, world_size, ckpt, port, pid_dir)


def test_an_idle_replica_outlasts_a_request_longer_than_the_group_timeout(
        ckpt_tp1, tmp_path):  # noqa: F811
    """Replica 1 waits for rank 0's next message while replica 0 runs a request; over the
    process group (timeout --distributed-timeout-minutes) that wait failed once a request
    took longer, and the idle rank's failure ended the server."""
    from tools.text_generation_cli import put

    body = {"prompts": ["5 6 7", "9 8 7 6 5"], "tokens_to_generate": 4, "top_k": 1}
    with two_rank_server(_serve_dp2_short_timeout_worker, ckpt_tp1, tmp_path) as url:
        status, text = put(url, body, timeout=60)
        assert status == 200, text
        status, text = put(url, {"prompts": ["5 6 7"], "tokens_to_generate": 2}, timeout=60)
        assert status == 200, text
    assert not (tmp_path / "ran1").exists()


def _replica_1_dies_worker(rank, world_size, ckpt, port, out_dir):
    """A tp 1 x dp 2 server whose replica 1 (rank 1) dies once it leads its replica (os._exit:
    gone at once, as a killed process, without the harness stopping rank 0 for it); rank 0
    writes how its server ended to out_dir/rank0 (Ctrl-C after 60 s if it still serves)."""
    import signal
    import threading
    import time

    # gloo connecting each pair at its first message, as under torchrun (the entry points
    # export it; the harness made the process group without)
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    if rank == 1:
        server_mod.lead_replica = lambda engine, groups: os._exit(0)
    ranks_mod.HEARTBEAT_S = 0.2
    timer = threading.Timer(60, os.kill, (os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    start, env = time.monotonic(), {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            status = server_mod.main(["--load", ckpt, "--port", str(port)], environ=env)
        ended = f"returned {status}"
    except SystemExit as exc:
        ended = f"SystemExit {exc.code}"
    except BaseException as exc:  # noqa: B036 -- reported to the test
        ended = f"{type(exc).__name__}: {exc}"
    timer.cancel()
    with open(os.path.join(out_dir, "rank0"), "w") as f:
        f.write(f"{ended}\nafter {time.monotonic() - start:.0f} s")
    return 0


def test_server_at_dp2_ends_when_another_replicas_rank_dies(ckpt_tp1, tmp_path):  # noqa: F811
    """Rank 0 sends each idle replica its heartbeat too: a replica whose rank dies while no
    request runs ends the server (one line naming the rank) instead of leaving rank 0
    serving with a replica it would dispatch the next request to."""
    from tests.dist_utils import free_port

    with pytest.raises(Exception):  # noqa: B017 -- rank 1 left no result
        run_distributed(_replica_1_dies_worker, 2, ckpt_tp1, free_port(), str(tmp_path))
    ended, after = (tmp_path / "rank0").read_text().splitlines()
    # under torchrun process_group_closed turns this into one line naming rank 1 (here the
    # test made the process group: megatron/rank_failure.py leaves its failure as it is)
    assert ended.startswith("RuntimeError") and "Connection closed by peer" in ended, ended
    assert int(after.split()[1]) < 30
