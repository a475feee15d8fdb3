"""Start-up reads of shared files, counted per rank on a few gloo processes.

At thousands of ranks on a shared file system (Lustre, GPFS), a read that every rank
repeats is a read the whole job makes N times. Rank 0 samples each `.bin` for its token
ids (up to 1 MiB) and the others get the id ranges in one broadcast; each rank builds the
run's tokenizer (vocab + merges, a sentencepiece model) once, not once for the argument
checks and again for the data; with --use-checkpoint-args rank 0 reads the checkpoint's
arguments (tracker, iteration directory, model file) and the others get them, or its
error, through the rendezvous store.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tests.dist_utils import free_port, run_distributed
from tests.gpt_helpers import tiny_config


def _write(prefix: str, vocab: int, docs: int = 12, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(docs):
        builder.add_item(rng.integers(0, vocab, 40))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _counting(cls, name: str, counts: dict, key: str) -> None:
    """Wrap `cls.name` (in this process) to count its calls in `counts[key]`."""
    real = getattr(cls, name)

    def counted(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return real(*args, **kwargs)

    setattr(cls, name, counted)


def _build_worker(rank, world_size, data_path, cache):
    """build_datasets over `data_path`: (token_id_range calls on this rank, what it raised)."""
    import torch.distributed as dist

    from megatron.core.datasets.indexed_dataset import MMapIndexedDataset
    from megatron.data_loading import build_datasets

    counts: dict = {}
    _counting(MMapIndexedDataset, "token_id_range", counts, "scans")
    config = tiny_config(world_size=world_size, mbs=1, gbs=world_size)  # padded vocab 128
    data = dataclasses.replace(config.data, mock_data=False, data_path=data_path, split="1",
                               data_cache_path=cache)
    config = dataclasses.replace(config, data=data)
    group = dist.new_group(backend="gloo")
    try:
        build_datasets(config, rank, 128, group)
    except SystemExit as e:
        return {"scans": counts.get("scans", 0), "code": e.code,
                "report": getattr(e, "report", None)}
    return {"scans": counts.get("scans", 0), "code": None, "report": None}


def test_each_bin_is_sampled_once_per_run_not_once_per_rank(tmp_path):
    """Three datasets on four ranks: 3 scans on rank 0, none elsewhere (it was 3 on every
    rank: 100 datasets x 4096 ranks read 400 GiB of samples)."""
    prefixes = [_write(str(tmp_path / f"d{i}"), vocab=128, seed=i) for i in range(3)]
    blend = [x for p in prefixes for x in ("1", p)]
    results = run_distributed(_build_worker, 4, blend, str(tmp_path / "cache"))
    assert [r["code"] for r in results] == [None] * 4, results
    assert [r["scans"] for r in results] == [3, 0, 0, 0], results


def test_an_id_past_the_vocabulary_stops_every_rank_with_one_report(tmp_path):
    """The verdict comes from rank 0's sample on every rank: the same error on each (no
    rank list), printed once (by rank 0), with the file, the id and the fix."""
    good = _write(str(tmp_path / "good"), vocab=128)
    bad = _write(str(tmp_path / "bad"), vocab=1000, seed=1)
    results = run_distributed(_build_worker, 2, ["1", good, "1", bad], str(tmp_path / "cache"))
    report = results[0]["report"]
    assert results[0]["code"] == report and results[1]["code"] == 1, results
    assert results[1]["report"] == report
    assert report.startswith(f"error: could not build the datasets: {bad}.bin: token id "), report
    assert "is outside the padded vocabulary of 128 ids" in report and "--vocab-size" in report
    assert report.count("error:") == 1, report
    assert [r["scans"] for r in results] == [2, 0], results


RUN = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
       "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0",
       "--num-workers", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
       "--split", "1", "--use-cpu-initialization"]


def _main_worker(rank, world_size, port, data_path, cache, flags=()):
    """pretrain_gpt.main on this rank: (its status, tokenizer builds, .bin samples,
    datasets opened, checkpoint arguments read)."""
    import torch.distributed as dist

    import megatron.tokenizer
    import pretrain_gpt
    from megatron import arguments_checkpoint
    from megatron.core.datasets.indexed_dataset import MMapIndexedDataset

    dist.destroy_process_group()  # run_distributed's: start as the entry point does
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_PORT=str(port))
    counts: dict = {}
    _counting(megatron.tokenizer, "build_tokenizer", counts, "tokenizers")
    _counting(MMapIndexedDataset, "token_id_range", counts, "scans")
    _counting(MMapIndexedDataset, "__init__", counts, "opens")
    _counting(arguments_checkpoint, "read_checkpoint_args", counts, "checkpoint_args")
    status = pretrain_gpt.main(RUN + ["--data-path", data_path, "--data-cache-path", cache,
                                      *flags])
    return {"status": status, **{k: counts.get(k, 0) for k in ("tokenizers", "scans", "opens",
                                                               "checkpoint_args")}}


def test_pretrain_start_up_builds_the_tokenizer_once_and_samples_once(tmp_path):
    """pretrain_gpt.py on two ranks: one tokenizer build per rank (it was two: the argument
    checks' and the data's), one `.bin` sample in the run (it was one per rank)."""
    prefix = _write(str(tmp_path / "corpus"), vocab=100)
    results = run_distributed(_main_worker, 2, free_port(), prefix, str(tmp_path / "cache"))
    assert [r["status"] for r in results] == [0, 0], results
    assert [r["tokenizers"] for r in results] == [1, 1], results
    assert [r["scans"] for r in results] == [1, 0], results
    assert [r["opens"] for r in results] == [1, 1], results


def test_the_no_validation_warning_opens_the_datasets_on_rank_0_only(tmp_path):
    """--eval-iters with a --split that gives validation no document: the warning's fix
    names the smallest dataset's document count, which rank 0 (the one that prints it)
    reads; every rank used to open every dataset again for a line it did not print."""
    prefix = _write(str(tmp_path / "corpus"), vocab=100)
    results = run_distributed(_main_worker, 2, free_port(), prefix, str(tmp_path / "cache"),
                              ["--eval-iters", "1", "--eval-interval", "1"])
    assert [r["status"] for r in results] == [0, 0], results
    assert [r["opens"] for r in results] == [2, 1], results


def test_pretrain_resumed_with_checkpoint_args_reads_them_on_rank_0(tmp_path):
    """pretrain_gpt.py on two ranks saves, then resumes with --use-checkpoint-args: rank 0
    reads the checkpoint's arguments, rank 1 gets them through the rendezvous store, and
    the process group is made through that same store (rank 0 hosts one, not two)."""
    prefix = _write(str(tmp_path / "corpus"), vocab=100)
    ckpt, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    saved = run_distributed(_main_worker, 2, free_port(), prefix, cache,
                            ["--save", ckpt, "--save-interval", "1"])
    assert [r["status"] for r in saved] == [0, 0], saved
    resumed = run_distributed(_main_worker, 2, free_port(), prefix, cache,
                              ["--load", ckpt, "--use-checkpoint-args"])
    assert [r["status"] for r in resumed] == [0, 0], resumed
    assert [r["checkpoint_args"] for r in resumed] == [1, 0], resumed


def test_zero_shot_evaluation_builds_the_tokenizer_once(tmp_path, monkeypatch):
    """tasks/main.py builds the tokenizer for the argument checks and used to build it again
    for the data (per rank: a single process shows the count)."""
    import megatron.tokenizer
    from tasks.zeroshot_gpt import evaluate
    from tests.test_zeroshot import NULL

    counts: dict = {}
    real = megatron.tokenizer.build_tokenizer

    def counted(*args, **kwargs):
        counts["tokenizers"] = counts.get("tokenizers", 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(megatron.tokenizer, "build_tokenizer", counted)
    (tmp_path / "l.jsonl").write_text('{"text": "1 2 3"}\n')
    res = evaluate.main(["--task", "LAMBADA", "--valid-data", str(tmp_path / "l.jsonl")] + NULL)
    assert res["num_examples"] == 1
    assert counts == {"tokenizers": 1}


# --use-checkpoint-args reads the checkpoint before any process group exists: its tracker,
# a listing of the iteration directory, rank 0's model file. Rank 0 reads them and the
# others get the arguments (or the error) through the rendezvous store.

SAVED_ARGS = {"num_layers": 3, "hidden_size": 48, "num_attention_heads": 6,
              "ffn_hidden_size": 96, "seq_length": 16, "max_position_embeddings": 16,
              "tokenizer_type": "NullTokenizer", "vocab_size": 100, "swiglu": True,
              "add_bias_linear": False, "normalization": "RMSNorm",
              "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
CKPT_RUN = ["--micro-batch-size", "1", "--global-batch-size", "12", "--lr", "1e-3",
            "--train-iters", "1", "--mock-data", "--use-checkpoint-args"]


def _checkpoint(root, payload) -> str:
    """A checkpoint directory at iteration 10 whose rank-0 file holds `payload` (bytes: a
    damaged file)."""
    import torch

    rank_dir = root / "iter_0000010" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    if isinstance(payload, bytes):
        (rank_dir / "model_optim_rng.pt").write_bytes(payload)
    else:
        torch.save(payload, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return str(root)


def _count_reads_under(root: str, counts: dict) -> None:
    """Count, in this process, the files opened and the directories listed under `root`
    (Python's audit events: torch.load's open included)."""
    import sys

    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and \
                isinstance(args[0], str) and args[0].startswith(root):
            key = "opens" if event == "open" else "listings"
            counts[key] = counts.get(key, 0) + 1

    sys.addaudithook(hook)


def _parse_worker(rank, world_size, port, load, delay_s=0.0):
    """parse_and_validate --use-checkpoint-args on this rank before any process group, as
    pretrain_gpt.py does, then the process group through the same store: (the model
    config, the checkpoint reads, the error raised and what this rank printed)."""
    import contextlib
    import io
    import time

    import torch
    import torch.distributed as dist

    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed
    from megatron.startup_store import JobStore

    dist.destroy_process_group()  # run_distributed's: start as the entry point does
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    counts: dict = {}
    _count_reads_under(load, counts)
    job, stderr = JobStore(env, rank, world_size), io.StringIO()
    time.sleep(delay_s if rank else 0.0)
    try:
        with contextlib.redirect_stderr(stderr):
            config = parse_and_validate(CKPT_RUN + ["--load", load], world_size=world_size,
                                        env=env, cuda_available=False, job_store=job)
    except SystemExit as e:
        return {"error": getattr(e, "message", e.code), "status": e.code,
                "printed": stderr.getvalue(), **counts}
    initialize_distributed(config.parallel, rank, world_size, 0, store=job.store)
    total = torch.ones(1)
    dist.all_reduce(total)  # the group made through the store works
    dist.destroy_process_group()
    return {"model": config.model, "error": None, "total": int(total), **counts}


def test_checkpoint_args_are_read_by_rank_0_only(tmp_path):
    """Three ranks: rank 0 opens the tracker and the model file and lists the iteration
    directory, the others read nothing under --load (each read all of it), and every
    rank's model configuration is the one a single process parses."""
    from megatron.arguments import parse_and_validate

    load = _checkpoint(tmp_path / "ckpt", {"args": SAVED_ARGS, "iteration": 10})
    alone = parse_and_validate(CKPT_RUN + ["--load", load], env={}, cuda_available=False)
    assert (alone.model.num_layers, alone.model.hidden_size) == (3, 48)  # the checkpoint's
    results = run_distributed(_parse_worker, 3, free_port(), load)
    assert [r["error"] for r in results] == [None] * 3, results
    assert [r["model"] for r in results] == [alone.model] * 3
    assert [r["total"] for r in results] == [3] * 3
    assert results[0]["opens"] >= 2 and results[0]["listings"] >= 1, results
    assert [(r.get("opens", 0), r.get("listings", 0)) for r in results[1:]] == [(0, 0)] * 2


@pytest.mark.parametrize("payload, message", [
    (b"not a checkpoint", "model_optim_rng.pt"),  # damaged
    ({"iteration": 10}, "holds no arguments"),
])
def test_a_bad_checkpoint_stops_every_rank_with_one_message(tmp_path, payload, message):
    """Rank 0 cannot read the checkpoint: every rank exits (status 2) with rank 0's error,
    which rank 0 alone prints -- no rank waits for an answer that never comes."""
    load = _checkpoint(tmp_path / "ckpt", payload)
    results = run_distributed(_parse_worker, 2, free_port(), load)
    assert [r["status"] for r in results] == [2, 2], results
    assert results[0]["error"] == results[1]["error"] and message in results[0]["error"]
    assert results[0]["printed"].count("error:") == 1, results
    assert results[0]["error"] in results[0]["printed"] and results[1]["printed"] == ""
    assert results[1].get("opens", 0) == 0, results


def test_rank_0_that_hosts_the_store_waits_until_every_rank_has_its_answer(tmp_path):
    """An env:// launch: the store lives in rank 0's process, which exits right after its
    error. A rank that comes to read later still gets the error (it got 'the answer did
    not come', printed by every such rank)."""
    load = _checkpoint(tmp_path / "ckpt", {"iteration": 10})
    results = run_distributed(_parse_worker, 2, free_port(), load, 2.0)
    assert [r["status"] for r in results] == [2, 2], results
    assert results[1]["error"] == results[0]["error"] and results[1]["printed"] == ""


def test_an_unreadable_checkpoint_ends_every_rank_alike(tmp_path, monkeypatch, capsys):
    """The iteration directory cannot be listed (PermissionError: another user's files):
    rank 0 and the rank that takes its answer through the store both end as an argument
    error does -- status 2, one line naming the directory and the fix, printed by rank 0
    alone (rank 0 raised the PermissionError: a traceback, status 1, while the others
    exited 2). In process: two JobStores sharing one HashStore stand for the launch."""
    import torch.distributed as dist

    from megatron.arguments import parse_and_validate
    from megatron.startup_store import JobStore

    load = _checkpoint(tmp_path / "ckpt", {"args": SAVED_ARGS, "iteration": 10})
    listdir = os.listdir

    def denied(path="."):
        if str(path).startswith(os.path.join(load, "iter_")):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", denied)
    store, ended = dist.HashStore(), []
    for rank in (0, 1):
        job = JobStore({}, rank, 2)
        job.store = store
        with pytest.raises(SystemExit) as exc:
            parse_and_validate(CKPT_RUN + ["--load", load], world_size=2,
                               env={"RANK": str(rank)}, cuda_available=False, job_store=job)
        ended.append((exc.type.__name__, exc.value.code, str(exc.value)))
    assert [e[:2] for e in ended] == [("ArgumentsError", 2)] * 2, ended
    assert ended[0][2] == ended[1][2] and "\n" not in ended[0][2], ended
    assert "Permission denied" in ended[0][2] and "iter_0000010" in ended[0][2], ended
    assert "--use-checkpoint-args" in ended[0][2], ended
    assert capsys.readouterr().err.count("error:") == 1


def _dry_run_worker(rank, world_size, ports, root, load, data_prefix, valid):
    """pretrain_gpt.main, then tasks/main.py's evaluation, with --dry-run on this rank of
    one node (LOCAL_RANK = RANK), no process group: per entry point (its exit status, what
    it printed, its file reads under `root`). Each entry point has its own MASTER_PORT
    (`ports`, by name), as two launches would: on one port, rank 1 could reach the store
    of rank 0's first run before rank 0 closed it (a busy machine), mark itself joined
    there, and rank 0's second store waited its whole timeout for it."""
    import contextlib
    import io

    import torch.distributed as dist

    import pretrain_gpt
    from tasks.zeroshot_gpt import evaluate
    from tests.test_zeroshot import NULL

    dist.destroy_process_group()  # run_distributed's: start as the entry point does
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    os.environ.update(env)
    runs = {"pretrain": lambda: pretrain_gpt.main(
                RUN + ["--data-path", data_prefix, "--load", load, "--dry-run"]),
            "evaluate": lambda: evaluate.main(
                ["--task", "LAMBADA", "--valid-data", valid, "--load", load, "--dry-run"]
                + NULL, rank, world_size, rank, {**os.environ})}
    results = {}
    for name, run in runs.items():
        counts, out = {}, io.StringIO()
        os.environ["MASTER_PORT"] = str(ports[name])
        _count_reads_under(root, counts)  # hooks stay: count from here on
        try:
            with contextlib.redirect_stdout(out):
                status = run()
        except SystemExit as e:
            status = e.code
        results[name] = {"status": status or 0, "printed": out.getvalue(), **counts}
    return results


def test_dry_run_reads_once_per_node(tmp_path):
    """--dry-run on two ranks of one node: the first makes the checks (the checkpoint's
    tracker and rank 0 file, the data's index and sample, the --valid-data file) and
    prints the report; the second reads none of it (it read them all in silence) and
    exits with the report's status (1: the model file is damaged), for pretrain_gpt.py
    and for tasks/main.py."""
    root = tmp_path / "shared"
    load = _checkpoint(root / "ckpt", b"not a checkpoint")
    prefix = _write(str(root / "corpus"), vocab=100)
    valid = root / "lambada.jsonl"
    valid.write_text('{"text": "1 2 3"}\n')
    ports = {"pretrain": free_port(), "evaluate": free_port()}
    results = run_distributed(_dry_run_worker, 2, ports, str(root), load, prefix, str(valid))
    for name in ("pretrain", "evaluate"):
        first, other = results[0][name], results[1][name]
        assert (first["status"], other["status"]) == (1, 1), (name, results)
        assert "model_optim_rng.pt" in first["printed"] and other["printed"] == "", results
        assert first.get("opens", 0) >= 3, (name, first)
        assert (other.get("opens", 0), other.get("listings", 0)) == (0, 0), (name, other)


def test_one_process_checking_a_layout_for_several_ranks_hosts_no_store():
    """`WORLD_SIZE=2 pretrain_gpt.py --dry-run` checks a layout in one process (RANK
    unset); with MASTER_ADDR / MASTER_PORT in its environment (a batch script exports
    them) it hosted the store and waited --distributed-timeout-minutes + 1 min for a rank
    1 that never comes (the dry run's per-node answer, --use-checkpoint-args). Without
    the launcher's RANK there is no store: the process reads for itself."""
    import datetime

    from megatron.startup_store import JobStore

    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    job = JobStore(env, 0, 2)
    assert job.connect(datetime.timedelta(seconds=3)) is None
    assert (job.store, job.hosts) == (None, False)


def test_node_first_read_follows_host_names_not_consecutive_ranks():
    """Four processes on two nodes dealt round-robin (`srun --distribution=cyclic`:
    node0 holds ranks 0 and 2, node1 ranks 1 and 3; LOCAL_RANK 0 is rank 0 and rank 1):
    each node's LOCAL_RANK 0 reads once, the node's other process gets that node's
    answer. Keyed by `rank - local_rank`, rank 3 waited for a rank 2 that never reads."""
    import datetime
    import threading

    import torch.distributed as dist

    from megatron.startup_store import JobStore, from_node_first

    port, timeout = free_port(), datetime.timedelta(seconds=20)
    host = dist.TCPStore("127.0.0.1", port, 4, is_master=True, timeout=timeout,
                         wait_for_workers=False)
    layout = {0: ("node0", 0), 1: ("node1", 0), 2: ("node0", 1), 3: ("node1", 1)}
    results, reads = {}, []

    def run(rank: int) -> None:
        node, local_rank = layout[rank]
        job = JobStore({}, rank, 4)
        job.store = host if rank == 0 else dist.TCPStore(
            "127.0.0.1", port, 4, is_master=False, timeout=timeout)

        def read():
            reads.append(rank)
            return f"checked on {node} by rank {rank}"
        try:
            results[rank] = from_node_first(job, local_rank, "check", read, timeout,
                                            "the checks", node=node)
        except BaseException as exc:  # noqa: BLE001 -- the test reports it
            results[rank] = repr(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(reads) == [0, 1], reads
    assert results == {0: "checked on node0 by rank 0", 2: "checked on node0 by rank 0",
                       1: "checked on node1 by rank 1", 3: "checked on node1 by rank 1"}


def test_a_node_first_read_that_fails_names_that_nodes_process(tmp_path):
    """The node's other processes raise the first process's error, naming its node."""
    import datetime

    import torch.distributed as dist

    from megatron.startup_store import JobStore, from_node_first

    port, timeout = free_port(), datetime.timedelta(seconds=5)
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    first, other = JobStore({}, 0, 2), JobStore({}, 1, 2)
    first.store = other.store = store

    def broken():
        raise ValueError("disk on fire")
    with pytest.raises(ValueError):
        from_node_first(first, 0, "check", broken, timeout, "the checks", node="gpu07")
    with pytest.raises(SystemExit, match="first process .LOCAL_RANK 0. of node gpu07 "
                                         "failed reading .*disk on fire"):
        from_node_first(other, 1, "check", lambda: 1, timeout, "the checks", node="gpu07")


def _check_arguments_in_threads(ranks_args: list) -> list:
    """check_same_arguments on each rank (a thread) of one job sharing one store: the
    SystemExit message of each rank, or None."""
    import datetime
    import threading

    import torch.distributed as dist

    from megatron.startup_store import JobStore, check_same_arguments

    store, out = dist.HashStore(), [None] * len(ranks_args)

    def rank_main(rank):
        job = JobStore({}, rank, len(ranks_args))
        job.store = store
        try:
            check_same_arguments(job, ranks_args[rank], datetime.timedelta(seconds=20))
        except SystemExit as e:
            out[rank] = str(e.code)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(ranks_args))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def test_a_node_started_with_another_command_line_stops_every_rank_with_the_settings():
    """A second node started with another --train-iters: its ranks name the settings that
    differ from rank 0's, rank 0's node says how many ranks differ; before, the nodes
    trained until a collective mismatched (gloo's 'Received data size doesn't match
    expected size', an abort)."""
    same = {"train_iters": 6, "lr": 1e-3, "rank": 0, "local_rank": 0}
    assert _check_arguments_in_threads(
        [dict(same, rank=r, local_rank=r % 2) for r in range(3)]) == [None] * 3
    other = dict(same, train_iters=8, local_rank=0)
    out = _check_arguments_in_threads([same, dict(same, rank=1, local_rank=1),
                                       dict(other, rank=2), dict(other, rank=3, local_rank=1)])
    assert out[0] == out[1] and out[0].startswith("error: 2 rank(s) were started with settings "
                                                  "other than rank 0's, the first to count: "
                                                  "rank ")
    assert "--train-iters: 8 here, 6 on rank 0; every node" in out[0]
    assert out[2].startswith("error: rank 2 was started with settings other than rank 0's: "
                             "--train-iters: 8 here, 6 on rank 0; every node")
    assert out[3].startswith("error: rank 3 ")


def _connect_alone(env: dict, rank: int, world_size: int, seconds: float):
    """JobStore(env, rank, world_size).connect with no other rank started: (the
    SystemExit's message, seconds it took)."""
    import datetime
    import time

    from megatron.startup_store import JobStore

    started = time.monotonic()
    with pytest.raises(SystemExit) as info:
        JobStore(env, rank, world_size).connect(datetime.timedelta(seconds=seconds))
    return str(info.value.code), time.monotonic() - started


def test_rank_0_whose_other_ranks_never_connect_names_them(monkeypatch):
    """An env:// launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: an srun wrapper) whose
    other node never comes up: rank 0 stopped after the wait with the store's traceback
    `Timed out after 121 seconds waiting for clients. 1/2 clients joined`, naming no rank,
    no address and no fix. It names the ranks that never joined and the flag of the wait."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    message, took = _connect_alone(env, 0, 4, 2)
    assert message.startswith("error: rank 0 hosts the rendezvous store on MASTER_ADDR:")
    assert f"(127.0.0.1:{env['MASTER_PORT']})" in message
    assert "3 of 4 never connected (rank(s) 1-3)" in message
    assert "--distributed-timeout-minutes" in message
    assert took < 30


def test_a_rank_whose_rank_0_never_comes_up_says_where_it_looked():
    """Rank 1 of an env:// launch whose rank 0 is not running: a DistNetworkError
    traceback (`The client socket has timed out ...`) before; one line naming the rank,
    MASTER_ADDR / MASTER_PORT, the likely causes and the flag of the wait."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    message, took = _connect_alone(env, 1, 2, 2)
    assert message.startswith("error: rank 1 of 2 could not connect to rank 0's rendezvous "
                              f"store at MASTER_ADDR=127.0.0.1 MASTER_PORT={env['MASTER_PORT']}")
    assert "--distributed-timeout-minutes" in message
    assert took < 30


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unresolvable_master_addr_stops_at_once(rank):
    """MASTER_ADDR that names no host (a typo, a node list not expanded: `node[01-02]`):
    the store retried the name for the whole timeout (twice, on a client: 22 min at the
    default) and then said it timed out connecting. Now at once, naming the value."""
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "node[01-02]",
           "MASTER_PORT": str(free_port())}
    message, took = _connect_alone(env, rank, 2, 20)
    assert message.startswith(f"error: rank {rank} cannot resolve MASTER_ADDR='node[01-02]'")
    assert "scontrol show hostnames" in message
    assert took < 10


_CONNECT_THEN_REPORT = """
import datetime, sys
import torch.distributed  # before "connecting": its import takes seconds
from megatron.startup_store import JobStore
env = {"RANK": sys.argv[1], "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": sys.argv[2]}
print("connecting", flush=True)
try:
    JobStore(env, int(sys.argv[1]), 2).connect(datetime.timedelta(seconds=120))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_while_waiting_for_a_late_rank_ends_the_wait(tmp_path, rank):
    """Ctrl-C on a rank of an env:// launch whose peer was not started yet: rank 0 (which
    hosts the store, waiting for rank 1 to join) and rank 1 (connecting to a rank 0 not
    up) both sat in the store's C++ wait, which retries through the signal, until the
    --distributed-timeout-minutes wait ran out (11 min by default). Now rank 0 raises
    KeyboardInterrupt (the run's interrupt line, status 130) and rank 1 ends by SIGINT
    (status 130 to a shell), within seconds."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "connect.py"
    script.write_text(_CONNECT_THEN_REPORT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, str(script), str(rank), str(free_port())],
                            cwd=repo, env={**os.environ, "PYTHONPATH": repo},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline() == "connecting\n"
        time.sleep(2.0)  # into the store's wait (rank 0) or its connect retries (rank 1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rank == 0:
        assert (proc.returncode, out) == (130, "interrupted\n")
    else:
        assert proc.returncode == -signal.SIGINT
