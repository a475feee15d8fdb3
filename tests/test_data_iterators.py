"""Batch iterators: the in-process reader thread and DataLoader workers yield the same
collated batches, stop when closed or dropped, survive a worker that never starts, and end
the run in one line when a worker dies or cannot start; get_batch's masks."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from megatron.core.datasets.samplers import PretrainingSampler
from megatron.data_iterators import PrefetchIterator, get_batch, make_iterator
from megatron.data_loading import CyclicSampler
from tests.gpt_helpers import tiny_config


class _Seq:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"text": np.arange(i, i + 9, dtype=np.int64)}


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_yields_collated_batches_in_order(workers):
    cfg = tiny_config(mbs=2, gbs=4)
    cfg.data = dataclasses.replace(cfg.data, num_workers=workers, seq_length=8)
    it = make_iterator(cfg, _Seq(), consumed=4, dp_rank=1, dp_size=2, pin=False)
    first, second = next(it), next(it)
    assert first["text"].dtype == torch.int64 and first["text"].shape == (2, 9)
    assert first["text"][:, 0].tolist() == [6, 7] and second["text"][:, 0].tolist() == [10, 11]


@pytest.mark.parametrize("mock", [False, True])
def test_worker_batches_cross_without_shared_memory_handles(mock):
    """A loader worker's micro-batch reaches the training process by value through its
    pipe: what the workers' collate function returns holds no tensor (each would cross
    as a shared-memory file descriptor, a connection to the worker's resource sharer for
    every micro-batch: a host cost of each step). The batches are those of the in-process
    reader, tensors of the same dtypes."""
    from megatron.core.datasets.mock import MockGPTDataset

    batches, collate_fns = {}, []
    real_loader = torch.utils.data.DataLoader

    def loader(*args, **kwargs):
        collate_fns.append(kwargs["collate_fn"])
        return real_loader(*args, **kwargs)

    for workers in (0, 2):
        cfg = tiny_config(mbs=2, gbs=4)
        cfg.data = dataclasses.replace(cfg.data, num_workers=workers, seq_length=8)
        dataset = MockGPTDataset(255, 8, 1) if mock else _Seq()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.utils.data, "DataLoader", loader)
            it = make_iterator(cfg, dataset, consumed=4, dp_rank=1, dp_size=2, pin=False)
        batches[workers] = [next(it) for _ in range(3)]
        it.close()
    sent = collate_fns[0]([dataset[0], dataset[1]])
    assert not any(torch.is_tensor(v) for v in vars(sent).get("values", {"": 0}).values())
    assert not torch.is_tensor(getattr(sent, "get", lambda k: None)("text"))
    for plain, got in zip(batches[0], batches[2]):
        assert got.keys() == plain.keys()
        for key, value in plain.items():
            assert torch.is_tensor(got[key]) and got[key].dtype == value.dtype
            assert torch.equal(got[key], value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_pinned_worker_batches_are_the_in_process_readers():
    """On CUDA the loader pins: the DataLoader's pin thread calls the worker batch's
    `pin_memory()`; what comes out is pinned tensors equal to the in-process reader's."""
    from megatron.core.datasets.mock import MockGPTDataset

    batches = {}
    for workers in (0, 2):
        cfg = tiny_config(mbs=2, gbs=4)
        cfg.data = dataclasses.replace(cfg.data, num_workers=workers, seq_length=8)
        it = make_iterator(cfg, MockGPTDataset(255, 8, 1), consumed=4, dp_rank=1, dp_size=2,
                           pin=True)
        batches[workers] = [next(it) for _ in range(6)]
        it.close()
    for plain, got in zip(batches[0], batches[2]):
        assert got.keys() == plain.keys()
        for key, value in plain.items():
            assert got[key].is_pinned() and value.is_pinned(), key
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("workers", [0, 2])
def test_dropped_iterator_stops_its_reader(workers):
    """An iterator dropped without close() (a library caller, a test) stops its worker
    processes or reader thread once collected. Before, the exit registrations held it:
    every dropped loader kept --num-workers processes until the interpreter exited (158 in
    one run of the test suite)."""
    children = set(multiprocessing.active_children())
    cfg = tiny_config(mbs=2, gbs=4)
    cfg.data = dataclasses.replace(cfg.data, num_workers=workers, seq_length=8)
    it = make_iterator(cfg, _Seq(), consumed=0, dp_rank=0, dp_size=1, pin=False)
    next(it)
    thread = getattr(it, "thread", None)
    assert (thread is not None) == (workers == 0)
    assert len(set(multiprocessing.active_children()) - children) == workers
    del it
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
            set(multiprocessing.active_children()) - children
            or (thread is not None and thread.is_alive())):
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) <= children
    assert thread is None or not thread.is_alive()


def _hang_first_worker_once(flag, started, worker_id):
    """A worker init that hangs for ever the first time worker 0 starts (`flag` absent)."""
    from megatron import data_iterators

    if worker_id == 0 and not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(3600)
    data_iterators._ignore_preemption_signals(worker_id)
    started[worker_id] = 1


def test_a_worker_that_never_starts_is_started_again(tmp_path, monkeypatch, capsys):
    """A loader worker hung in its fork (a CPython 3.11 lock taken by another thread at
    the fork) made the first batch wait for ever. After START_S the workers start again,
    and the batches are those of a loader that started at once."""
    import functools

    from megatron import data_iterators

    cfg = tiny_config(mbs=2, gbs=4)
    cfg.data = dataclasses.replace(cfg.data, num_workers=2, seq_length=8)
    plain = make_iterator(cfg, _Seq(), consumed=4, dp_rank=1, dp_size=2, pin=False)
    expected = [next(plain)["text"].tolist() for _ in range(6)]
    plain.close()
    monkeypatch.setattr(data_iterators._WorkerIterator, "START_S", 1.0)
    monkeypatch.setattr(data_iterators, "_worker_started", functools.partial(
        _hang_first_worker_once, str(tmp_path / "hung")))
    it = make_iterator(cfg, _Seq(), consumed=4, dp_rank=1, dp_size=2, pin=False)
    start = time.monotonic()
    assert [next(it)["text"].tolist() for _ in range(6)] == expected
    assert time.monotonic() - start < 30
    it.close()
    assert (tmp_path / "hung").exists()
    assert "did not start within 1 s (a fork that hung); starting the workers again" in \
        capsys.readouterr().err


def test_closed_worker_iterator_ends():
    cfg = tiny_config(mbs=2, gbs=4)
    cfg.data = dataclasses.replace(cfg.data, num_workers=1, seq_length=8)
    it = make_iterator(cfg, _Seq(), consumed=0, dp_rank=0, dp_size=1, pin=False)
    next(it)
    it.close()
    it.close()  # twice: nothing more to do
    with pytest.raises(StopIteration):
        next(it)


def test_get_batch_masks_follow_eod_flags():
    flags = dataclasses.make_dataclass("F", ["reset_position_ids", "reset_attention_mask",
                                             "eod_mask_loss"])
    text = torch.tensor([[5, 6, 0, 7, 8, 9]])
    plain = get_batch({"text": text}, torch.device("cpu"), 0, flags(False, False, False))
    assert plain["attention_mask"] is None and plain["loss_mask"].tolist() == [[1, 1, 1, 1, 1]]
    b = get_batch({"text": text}, torch.device("cpu"), 0, flags(True, True, True))
    assert b["tokens"].tolist() == [[5, 6, 0, 7, 8]] and b["labels"].tolist() == [[6, 0, 7, 8, 9]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1, 1]], "no loss on EOD tokens"
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert bool(b["attention_mask"][0, 0, 3, 1]), "the second document cannot see the first"


def test_process_with_loader_workers_exits_without_closing(tmp_path):
    """Workers ignore SIGTERM (preemption); the process must still exit promptly, even
    on an error path that never closes the iterator."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "run.py"
    script.write_text(
        "import dataclasses\n"
        "from tests.gpt_helpers import tiny_config\n"
        "from megatron.core.datasets.mock import MockGPTDataset\n"
        "import megatron.data_iterators as dl\n"
        "cfg = tiny_config()\n"
        "cfg.data = dataclasses.replace(cfg.data, num_workers=2)\n"
        "it = dl.make_iterator(cfg, MockGPTDataset(255, 16, 1), 0, 0, 1, False)\n"
        "next(it)\n"
        "raise SystemExit('error: stop')\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(root), "PATH": ""})
    assert proc.returncode == 1 and "error: stop" in proc.stderr


def test_prefetch_iterator_closes_with_a_full_queue_after_the_last_batch():
    """close() joins the reader thread: it must not stay blocked putting the end marker
    into a full queue (the data ran out while nobody was reading)."""
    data = [{"text": np.arange(5)} for _ in range(2)]  # one micro-batch, then the end
    it = PrefetchIterator(data, PretrainingSampler(2, 0, 2, 0, 1), pin=False, depth=1)
    deadline = time.monotonic() + 10
    while not it.q.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the reader is now waiting to put its next item
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    closer.join(timeout=5)
    assert not closer.is_alive() and not it.thread.is_alive()


def test_prefetch_iterator_stays_ended_after_its_data_or_an_error():
    """Once next() raised StopIteration (the sampler's samples ran out) it raises it again
    (Python's iterator protocol: a second loop over it, or next(it, default), ends), also
    after a sample read error: it used to wait for ever on the reader's empty queue."""
    class Failing:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 2:
                raise KeyError("bad sample")
            return {"text": np.arange(5)}

    for data, first in (([{"text": np.arange(5)}] * 4, 2), (Failing(), 1)):
        it = PrefetchIterator(data, PretrainingSampler(4, 0, 2, 0, 1), pin=False)
        got = []
        with contextlib.suppress(KeyError):
            got.extend(it)
        assert len(got) == first
        outcome = []
        reader = threading.Thread(target=lambda: outcome.extend(
            [next(it, "ended"), list(it), next(it, "ended")]), daemon=True)
        reader.start()
        reader.join(timeout=5)
        assert outcome == ["ended", [], "ended"], "next() after the end must not wait"
        it.close()


def test_prefetch_close_does_not_hang_on_a_stuck_read_and_ends_the_iterator(capsys):
    """close() runs on every exit path (a signal, an error): a sample read stuck on a
    stalled file system used to keep it waiting for ever. After close(), next() ends."""
    release = threading.Event()

    class Stuck:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i >= 2:
                release.wait(30)  # the stalled read
            return {"text": np.arange(5)}

    it = PrefetchIterator(Stuck(), PretrainingSampler(8, 0, 2, 0, 1), pin=False, depth=1)
    next(it)
    it.join_timeout_s = 0.3
    began = time.monotonic()
    it.close()
    assert time.monotonic() - began < 5
    assert "the data reader thread did not stop within 0.3 s" in capsys.readouterr().err
    with pytest.raises(StopIteration):
        next(it)
    release.set()
    it.thread.join(5)
    assert not it.thread.is_alive()


# ---------------------------------------------------------------- a loader worker that dies

def _killing_mock(kill_at: int):
    """A MockGPTDataset whose loader worker kills itself with SIGKILL (as the kernel's
    out-of-memory killer does) when it reads sample `kill_at`."""
    import signal

    from megatron.core.datasets.mock import MockGPTDataset

    class Killing(MockGPTDataset):
        def __getitem__(self, idx):
            if idx == kill_at and torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__getitem__(idx)

    return Killing


def test_a_killed_loader_worker_ends_the_run_in_one_line(tmp_path, monkeypatch):
    """A loader worker killed mid-run (SIGKILL: the out-of-memory killer) ended the run with
    torch's RuntimeError raised from its SIGCHLD handler wherever the training process was
    (a traceback through a gradient hook), naming no cause and no fix. Now one line: the
    worker, the signal, the iteration, the checkpoint to resume from and what to change."""
    import megatron.data_loading as data_loading
    import megatron.training as training
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed, set_random_seed

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
            "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
            "--use-cpu-initialization --num-workers 2 --eval-iters 0 --train-iters 200 "
            "--save-interval 3").split() + ["--save", str(tmp_path / "ckpt")]
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    monkeypatch.setattr(data_loading, "MockGPTDataset", _killing_mock(40))
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    with pytest.raises(SystemExit) as stop:
        training.pretrain(cfg, rt)
    message = str(stop.value.code)
    assert re.fullmatch(
        r"error: data loader worker process \d+ \(--num-workers 2\) was killed by signal "
        r"'Killed' at iteration \d+, so the run stops; the last checkpoint is "
        rf"{re.escape(str(tmp_path / 'ckpt'))}/iter_\d{{7}}: relaunch with --load .* "
        r"fewer --num-workers \(0 reads the data in the training process\) take less host "
        r"memory", message), message


def test_loader_worker_exit_reads_torchs_other_reports():
    from megatron.data_iterators import loader_worker_exit

    gone = RuntimeError("DataLoader worker (pid(s) 12, 13) exited unexpectedly")
    assert str(loader_worker_exit(gone, 4, 7, " (no --save)").code).startswith(
        "error: data loader worker process 12, 13 (--num-workers 4) exited unexpectedly at "
        "iteration 7, so the run stops (no --save). --num-workers 0 reads the data")
    bus = RuntimeError("DataLoader worker (pid 9) is killed by signal: Bus error. It is "
                       "possible that dataloader's workers are out of shared memory.")
    assert "signal 'Bus error'" in str(loader_worker_exit(bus, 1, 0, "").code)
    assert loader_worker_exit(RuntimeError("DataLoader worker is tired"), 1, 0, "") is None
    assert loader_worker_exit(ValueError(str(gone)), 1, 0, "") is None


def test_a_sampler_error_at_the_loader_start_leaves_no_workers(monkeypatch):
    """The DataLoader starts its workers before it asks the sampler for indices: an error
    there (the cyclic sampler of a set too large to permute) left the workers, which
    ignore SIGTERM, running with nothing to shut them down, and the process hung at exit
    after printing its error (multiprocessing's exit handler joins its children)."""
    children = set(multiprocessing.active_children())
    cfg = tiny_config(mbs=2, gbs=4)
    cfg.data = dataclasses.replace(cfg.data, num_workers=2, seq_length=8,
                                   dataloader_type="cyclic")

    def fails(self, epoch, done):
        raise MemoryError("cannot permute")

    monkeypatch.setattr(CyclicSampler, "_epoch_order", fails)
    kept = None
    try:
        make_iterator(cfg, _Seq(), consumed=0, dp_rank=0, dp_size=1, pin=False)
    except MemoryError as e:
        kept = e  # held, as the out-of-memory report holds it
    assert str(kept) == "cannot permute"
    assert set(multiprocessing.active_children()) <= children


def test_starting_workers_past_the_open_files_limit_names_it():
    """With `ulimit -n` too low for the workers' pipes, the run stopped with an OSError
    traceback from multiprocessing on each rank (or an AttributeError from shutting down a
    loader that had started nothing); now one line with the limit and the fix, wherever
    in the start the descriptors run out."""
    import resource

    cfg = tiny_config(mbs=2, gbs=4)
    cfg.data = dataclasses.replace(cfg.data, num_workers=2, seq_length=8)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reports = []
    for free in range(1, 12):  # descriptors left free: each start fails at a later point
        gc.collect()  # earlier loaders: their descriptors closed now, not during the call
        limit = len(os.listdir("/proc/self/fd")) + free  # the listing's own one is free too
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            it = make_iterator(cfg, _Seq(), consumed=0, dp_rank=0, dp_size=1, pin=False)
        except SystemExit as e:
            reports.append((limit, str(e.code)))
            continue
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        it.close()
        break
    assert len(reports) >= 3, reports
    for limit, text in reports:
        assert text.startswith("error: starting 2 data loader worker process(es) (--num-workers "
                               f"2) failed: too many open files (this process may open {limit})")
        assert "ulimit -n 65536" in text and "fewer --num-workers" in text
