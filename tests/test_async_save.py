"""--async-save: only the CPU copy blocks; the files, the rename and the tracker come later
from a background thread, the tracker last and only once every rank's files are complete;
the checkpoints written this way resume bit-exactly."""
from __future__ import annotations

import collections
import os
import re
import threading
import time

import pytest
import torch

from megatron import checkpointing
from megatron.async_save import AsyncSaver, marker_path, snapshot_to_cpu, wait_for_markers
from megatron.checkpointing import (
    checkpoint_name,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    save_checkpoint_async,
)
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.test_exact_resume import N, run_pretrain


def _state(iteration, value=0.0):
    weight = torch.full((4, 3), value)
    return {"iteration": iteration, "model": collections.OrderedDict(w=weight, tied=weight),
            "optimizer": {"state": {0: {"exp_avg": torch.arange(3.0)}}, "lr": [1e-3, (2, 3)]},
            "rng_state": [{"torch_rng_state": torch.get_rng_state()}]}


def _ps1():
    return ParallelState.build(1, 0)


# --------------------------------------------------------------------------- pieces
def test_snapshot_is_a_frozen_copy_that_keeps_structure_and_sharing():
    state = _state(3, 1.0)
    state["model"]._metadata = {"": {"version": 1}}
    snap = snapshot_to_cpu(state)
    state["model"]["w"].add_(5.0)  # the next training steps change the live tensors
    state["optimizer"]["state"][0]["exp_avg"].zero_()
    assert torch.equal(snap["model"]["w"], torch.full((4, 3), 1.0))
    assert torch.equal(snap["optimizer"]["state"][0]["exp_avg"], torch.arange(3.0))
    assert snap["model"]["w"] is snap["model"]["tied"], "a tensor reached twice stays shared"
    assert type(snap["model"]) is collections.OrderedDict
    assert snap["model"]._metadata == {"": {"version": 1}}
    assert snap["optimizer"]["lr"] == [1e-3, (2, 3)] and snap["iteration"] == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory)")
def test_snapshot_of_cuda_tensors_lands_in_pinned_memory():
    t = torch.randn(8, device="cuda")
    saver = AsyncSaver()
    snap = saver.snapshot({"t": t})
    assert snap["t"].device.type == "cpu" and snap["t"].is_pinned()
    assert torch.equal(snap["t"], t.cpu())
    again = saver.snapshot({"t": t * 2})
    assert again["t"].data_ptr() == snap["t"].data_ptr(), "the pinned buffer is reused"


def test_background_failure_is_raised_by_wait():
    saver = AsyncSaver()

    def fail():
        raise OSError("disk full")

    saver.submit(fail, "the checkpoint at iteration 9")
    with pytest.raises(RuntimeError, match="iteration 9 failed: disk full"):
        saver.wait()
    assert not saver.pending
    saver.wait()  # nothing in flight: returns at once


def test_marker_wait_names_the_missing_writers(tmp_path):
    open(marker_path(str(tmp_path), "mp_rank_00"), "w").close()
    wait_for_markers(str(tmp_path), ["mp_rank_00"], timeout_s=1.0)
    with pytest.raises(TimeoutError, match="mp_rank_01") as err:
        wait_for_markers(str(tmp_path), ["mp_rank_00", "mp_rank_01"], timeout_s=0.1)
    assert "mp_rank_00" not in str(err.value)


# --------------------------------------------------------------------------- one process
def test_async_save_writes_what_a_sync_save_writes(tmp_path, capsys):
    sync_root, async_root = str(tmp_path / "sync"), str(tmp_path / "async")
    save_checkpoint(sync_root, 5, _state(5, 2.0), _ps1())
    saver = AsyncSaver()
    blocking = save_checkpoint_async(async_root, 5, _state(5, 2.0), _ps1(), saver)
    saver.wait()
    assert 0.0 <= blocking < 5.0
    out = capsys.readouterr().out
    assert re.search(r"\n  successfully saved checkpoint at iteration       5 to \S+\n"
                     r"  checkpoint save time \(blocking \d+\.\d\d s, writing \d+\.\d\d s in "
                     r"the background\)", out)
    assert sorted(os.listdir(async_root)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert os.listdir(os.path.join(async_root, "iter_0000005")) == ["mp_rank_00"], "no markers"
    a = torch.load(checkpoint_name(async_root, 5, 0, 0, 1), weights_only=True)
    b = torch.load(checkpoint_name(sync_root, 5, 0, 0, 1), weights_only=True)
    assert a.keys() == b.keys() and torch.equal(a["model"]["w"], b["model"]["w"])
    assert a["model"]["w"] is a["model"]["tied"]
    assert load_checkpoint(async_root, _ps1())[0] == 5


def test_tracker_moves_only_after_the_background_write(tmp_path, monkeypatch):
    root = str(tmp_path)
    save_checkpoint(root, 1, _state(1, 1.0), _ps1())
    release = threading.Event()
    original = checkpointing._torch_save_synced

    def slow_write(obj, path):
        assert release.wait(30)
        original(obj, path)

    monkeypatch.setattr(checkpointing, "_torch_save_synced", slow_write)
    saver = AsyncSaver()
    live = _state(2, 7.0)
    save_checkpoint_async(root, 2, live, _ps1(), saver)
    live["model"]["w"].fill_(-1.0)  # training goes on and changes the weights
    time.sleep(0.1)
    assert saver.pending and not saver.done()
    assert read_tracker(root) == (1, False), "the tracker waits for the files"
    assert os.path.isdir(os.path.join(root, "iter_0000002.tmp"))
    assert load_checkpoint(root, _ps1())[0] == 1
    release.set()
    saver.wait()
    assert read_tracker(root) == (2, False)
    _, state = load_checkpoint(root, _ps1())
    assert torch.equal(state["model"]["w"], torch.full((4, 3), 7.0)), "the values at save time"


# --------------------------------------------------------------------------- two ranks
def _dist_async_worker(rank, world_size, root):
    ps = ParallelState.build(world_size, rank, tp_size=2)  # both ranks write a shard
    go = os.path.join(root, "go")
    if rank == 1:  # rank 1's disk is slow: its write waits for rank 0's go-ahead
        original = checkpointing._torch_save_synced

        def slow_write(obj, path):
            while not os.path.exists(go):
                time.sleep(0.01)
            original(obj, path)

        checkpointing._torch_save_synced = slow_write
    saver = AsyncSaver()
    save_checkpoint_async(root, 3, _state(3, float(rank)), ps, saver)
    seen = None
    if rank == 0:
        tmp = os.path.join(root, "iter_0000003.tmp")
        deadline = time.monotonic() + 20
        while not os.path.exists(marker_path(tmp, "mp_rank_00")):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        seen = (read_tracker(root), os.path.exists(marker_path(tmp, "mp_rank_01")))
        open(go, "w").close()
    saver.wait()
    torch.distributed.barrier()
    _, state = load_checkpoint(root, ps)
    return seen, read_tracker(root), float(state["model"]["w"][0, 0])


def test_two_ranks_tracker_waits_for_the_slowest_writer(tmp_path):
    results = run_distributed(_dist_async_worker, 2, str(tmp_path))
    seen_by_rank0 = results[0][0]
    assert seen_by_rank0 == ((None, False), False), "own shard done, rank 1's not: no tracker"
    for rank, (_, tracker, value) in enumerate(results):
        assert tracker == (3, False) and value == float(rank)
    assert sorted(os.listdir(tmp_path / "iter_0000003")) == ["mp_rank_00", "mp_rank_01"]


def _dist_async_one_writer_fails(rank, world_size, root):
    ps = ParallelState.build(world_size, rank, tp_size=2)
    saver = AsyncSaver()
    save_checkpoint(root, 1, _state(1, float(rank)), ps)
    original = torch.save
    if rank == 1:
        def full(obj, f, *args, **kwargs):
            raise OSError(28, "No space left on device")

        torch.save = full
    started = time.monotonic()
    try:
        save_checkpoint_async(root, 3, _state(3, float(rank)), ps, saver, timeout_s=120.0)
        try:
            saver.wait()
        except RuntimeError as exc:
            return str(exc), time.monotonic() - started
        return None, time.monotonic() - started
    finally:
        torch.save = original


def test_a_failed_background_writer_stops_rank_0_waiting(tmp_path):
    """Rank 0 waited for the markers of a writer that had failed until the timeout (by
    default --distributed-timeout-minutes + 1 minutes) and then only said it saw none;
    now it stops at once with that writer's error, and publishes nothing."""
    results = run_distributed(_dist_async_one_writer_fails, 2, str(tmp_path))
    (message0, seconds0), (message1, _) = results
    assert "No space left on device" in message1
    assert seconds0 < 60, f"rank 0 waited {seconds0:.0f} s"
    assert message0.startswith("the background save of the checkpoint at iteration 3 to ")
    assert "the writer of mp_rank_01 failed: the checkpoint at iteration 3 could not be " \
        "written to " in message0
    assert "No space left on device" in message0 and "(rank 1)" in message0
    assert "the checkpoint was not published" in message0
    assert read_tracker(str(tmp_path)) == (1, False)




def _dist_async_tmp_dir_refused(rank, world_size, root):
    """An async save at 4 whose iter_XXXXXXX.tmp rank 0 cannot make (a full disk); the
    AgreedExit's (report, prints), or None when the save went through."""
    from megatron.agreed_exit import AgreedExit

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 2, _state(2, float(rank)), ps)
    real = os.makedirs

    def full(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device", path)
        return real(path, *args, **kwargs)

    if rank == 0:
        os.makedirs = full
    try:
        save_checkpoint_async(root, 4, _state(4, float(rank)), ps, AsyncSaver())
    except AgreedExit as exc:
        return exc.report, exc.prints
    finally:
        os.makedirs = real
    return None


def test_an_async_saves_temporary_directory_refused_fails_every_rank_with_one_report(
        tmp_path):
    """Rank 0 unable to make iter_XXXXXXX.tmp for an async save raised its OSError alone
    (a traceback) while the other ranks waited in the barrier after it (gloo: 'Connection
    closed by peer'; NCCL: until the timeout), as synchronous saves once did. Every rank
    exits with rank 0's message, printed once; the tracker keeps its checkpoint."""
    (report0, prints0), (report1, prints1) = run_distributed(
        _dist_async_tmp_dir_refused, 2, str(tmp_path))
    assert report0 == report1 and (prints0, prints1) == (True, False)
    tmp_dir = os.path.join(str(tmp_path), "iter_0000004.tmp")
    assert report0.startswith(f"rank 0 (of 2): error: the checkpoint at iteration 4 could "
                              f"not be written: {tmp_dir} could not be made (OSError: [Errno 28] No space "
                              "left on device"), report0
    assert read_tracker(str(tmp_path)) == (2, False)

def _dist_next_save_after_a_failed_writer(rank, world_size, root):
    import contextlib
    import io

    from megatron.agreed_exit import AgreedExit

    ps = ParallelState.build(world_size, rank, tp_size=2)
    saver = AsyncSaver()
    original, out = torch.save, io.StringIO()
    if rank == 1:
        def full(obj, f, *args, **kwargs):
            raise OSError(28, "No space left on device")

        torch.save = full
    try:
        with contextlib.redirect_stdout(out):
            save_checkpoint_async(root, 3, _state(3, float(rank)), ps, saver, timeout_s=120.0)
            while not saver.done():  # the writer thread calls torch.save: restore it after
                time.sleep(0.05)
            torch.save = original
            saver.report_failure()  # as the training loop does before each step
            saver.report_failure()  # once
            try:
                save_checkpoint_async(root, 5, _state(5, float(rank)), ps, saver)
            except AgreedExit as exc:
                return exc.report, exc.prints, out.getvalue()
        return None, None, out.getvalue()
    finally:
        torch.save = original


def test_the_next_save_after_a_failed_background_write_exits_every_rank_once(tmp_path):
    """Every rank raised its own RuntimeError at the next save (a traceback per rank) and
    the writer's failure was printed by each rank that saw it, as a repr: now rank 0 alone
    prints it once known (`report_failure`, while training goes on), and at the next save every rank exits with rank 0's report
    (naming the writer), printed once."""
    results = run_distributed(_dist_next_save_after_a_failed_writer, 2, str(tmp_path))
    (report0, prints0, out0), (report1, prints1, out1) = results
    assert report0 == report1 and (prints0, prints1) == (True, False)
    assert report0.startswith("error: the background save of the checkpoint at iteration 3")
    assert "the writer of mp_rank_01 failed" in report0 and "(rank 1)" in report0
    assert out0.count("ERROR: background save") == 1 and "ERROR" not in out1
    assert "CheckpointWriteError(" not in out0
    assert not os.path.exists(tmp_path / "iter_0000003")  # never published
    assert not os.path.exists(tmp_path / "iter_0000003.tmp"), "rank 0 removed the partial save"


def test_an_abandoned_save_is_never_published(tmp_path):
    """Ctrl-C while a background save is in flight: `abandon()` names it, and it is not
    published even when its files are written afterwards (the tracker keeps naming the
    previous checkpoint, so what the interrupt line says stays true)."""
    root, saver = str(tmp_path), AsyncSaver()
    save_checkpoint(root, 1, _state(1), _ps1())
    release = threading.Event()
    original = checkpointing._torch_save_synced

    def slow(obj, path):
        release.wait(30)
        original(obj, path)

    checkpointing._torch_save_synced = slow
    try:
        save_checkpoint_async(root, 3, _state(3), _ps1(), saver)
        assert saver.abandon() == f"the checkpoint at iteration 3 to {root}"
        release.set()
        saver.wait()
    finally:
        checkpointing._torch_save_synced = original
    assert read_tracker(root) == (1, False)
    assert not os.path.exists(tmp_path / "iter_0000003")
    assert saver.abandon() is None, "nothing in flight any more"


# --------------------------------------------------------------------------- trainer
# How each run ends, the iteration whose save fails on rank 1 (the one the run ends
# after) and the tracker left. A signal (--exit-signal-handler) reaches rank 1 only, and
# --exit-duration-in-mins counts from rank 1's process start two minutes ago: rank 0 has
# no local sign that the run ends after that save.
_ENDINGS = {
    "train-iters": (["--train-iters", "4"], 4, 2),
    "exit-interval": (["--exit-interval", "4"], 4, 2),
    "signal": (["--exit-signal-handler"], 4, 2),
    "duration": (["--exit-duration-in-mins", "1"], 1, None),
    "mid-run": (["--train-iters", "6"], 2, None),  # the run goes on: exits at the next save
}


def _dist_final_save_fails_on_rank_1(rank, world_size, root, ending):
    """A tp=2 run (both ranks write) with async saves every 2 iterations that ends as
    `ending` says, where rank 1's torch.save of the save the run ends after fails:
    (report, prints, code) of the AgreedExit."""
    import signal

    from megatron import training
    from megatron.agreed_exit import AgreedExit

    flags, fail_at, _ = _ENDINGS[ending]
    original, original_step = torch.save, training.train_step

    def full(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("iteration") == fail_at:
            raise OSError(28, "No space left on device")
        return original(obj, f, *args, **kwargs)

    def step(tr, data, **kwargs):
        out = original_step(tr, data, **kwargs)
        if ending == "signal" and rank == 1 and tr.state.iteration + 1 == fail_at:
            os.kill(os.getpid(), signal.SIGTERM)  # after the step: its save comes first
        if ending == "mid-run" and tr.state.iteration + 1 == fail_at + 1:
            while not tr.async_saver.done():  # the failure is known before the next step
                time.sleep(0.02)
        return out

    started = time.time() - (120.0 if rank == 1 else 0.0)
    training.train_step = step
    if rank == 1:
        torch.save = full
    try:
        run_pretrain(["--tensor-model-parallel-size", "2", "--save", root, "--save-interval",
                      "2", "--async-save", *flags], world_size, rank, started)
    except AgreedExit as exc:
        return exc.report, exc.prints, exc.code
    finally:
        torch.save, training.train_step = original, original_step
    return None, None, None


@pytest.mark.parametrize("ending", sorted(set(_ENDINGS) - {"mid-run"}))
def test_a_failed_final_async_save_exits_every_rank_with_one_report(tmp_path, capfd, ending):
    """The save the run ends with (--train-iters, --exit-interval, a signal on another
    rank, --exit-duration-in-mins), waited for at the end: each rank raised its own
    RuntimeError there (a traceback per rank). Now every rank exits with rank 0's report
    (status 1, printed once, naming the writer), the tracker keeps the previous checkpoint
    and rank 0 removes the partial directory. Rank 0 judged locally whether the run ended
    after that save and also printed the failure when it happened unless it knew: twice
    after a signal that only another rank received, or a duration counted elsewhere."""
    root = str(tmp_path / "ck")
    _, fail_at, kept = _ENDINGS[ending]
    (report0, prints0, code0), (report1, prints1, code1) = run_distributed(
        _dist_final_save_fails_on_rank_1, 2, root, ending)
    assert report0 == report1 and (prints0, prints1) == (True, False) and code1 == 1
    assert code0 == report0, "rank 0's exit prints the report (status 1)"
    assert report0.startswith(f"error: the background save of the checkpoint at iteration "
                              f"{fail_at}")
    assert "the writer of mp_rank_01 failed" in report0 and "(rank 1)" in report0
    assert "No space left on device" in report0
    out = capfd.readouterr().out
    assert f"saving checkpoint at iteration {fail_at:7d}" in out
    assert "ERROR: background save" not in out, "reported once, at exit"
    assert read_tracker(root) == (kept, False)
    left = ["latest_checkpointed_iteration.txt", f"iter_{kept:07d}"] if kept else []
    assert sorted(os.listdir(root)) == sorted(left)


def test_a_failed_async_save_the_run_goes_on_after_is_printed_then_exits_at_the_next(
        tmp_path, capfd):
    """A save that fails while training goes on: rank 0 prints the failure once it is
    known (before the next step), and the next save exits every rank with the report."""
    root = str(tmp_path / "ck")
    (report0, prints0, _), (report1, _, code1) = run_distributed(
        _dist_final_save_fails_on_rank_1, 2, root, "mid-run")
    assert report0 == report1 and prints0 and code1 == 1
    assert report0.startswith("error: the background save of the checkpoint at iteration 2")
    out = capfd.readouterr().out
    assert out.count("ERROR: background save of the checkpoint at iteration 2") == 1, out
    assert out.index("ERROR: background save") < out.index("saving checkpoint at iteration"
                                                           "       4"), "before the next save"
    assert read_tracker(root) == (None, False) and os.listdir(root) == []


def _trainer_async_scenario(root, world_size=1, rank=0, extra=()):
    """Uninterrupted losses; a run with async saves at 2 and 4 that stops at 4; the resume."""
    extra = list(extra)
    ref, _ = run_pretrain(extra, world_size, rank)
    first, tr = run_pretrain(extra + ["--save", root, "--save-interval", "2", "--exit-interval",
                                      "4", "--async-save"], world_size, rank)
    assert not tr.async_saver.pending, "the save that ends the run was waited for"
    resumed, _ = run_pretrain(extra + ["--load", root], world_size, rank)
    return ref, first, resumed


def _dist_trainer_async(rank, world_size, root):
    return _trainer_async_scenario(root, world_size, rank, ["--use-distributed-optimizer"])


def _check_scenario(ref, first, resumed, what):
    assert first == {i: ref[i] for i in range(1, 5)}, what
    assert resumed == {i: ref[i] for i in range(5, N + 1)}, what


def test_async_checkpoints_resume_bit_exactly(tmp_path, capsys):
    root = str(tmp_path / "ck")
    _check_scenario(*_trainer_async_scenario(root), "one process")
    out = capsys.readouterr().out
    for it in (2, 4):
        assert re.search(rf"successfully saved checkpoint at iteration\s+{it} to \S+\n  checkpoint "
                         r"save time \(blocking [0-9.]+ s, writing [0-9.]+ s in the background\)",
                         out), out[-2000:]
        # Megatron's line, as a synchronous save prints it (scripts take the rest as the path)
        assert re.search(rf"^saving checkpoint at iteration\s+{it} to {re.escape(root)}$", out,
                         re.M), out[-2000:]
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]


def test_async_checkpoints_resume_bit_exactly_with_distributed_optimizer(tmp_path):
    root = str(tmp_path / "ck")
    for rank, result in enumerate(run_distributed(_dist_trainer_async, 2, root)):
        _check_scenario(*result, f"distributed optimizer dp=2 rank {rank}")
    assert read_tracker(root) == (4, False)
    assert sorted(os.listdir(os.path.join(root, "iter_0000004", "mp_rank_00"))) == [
        "distrib_optim.pt", "model_optim_rng.pt"]


def test_the_save_time_line_names_the_wait_for_the_previous_save(tmp_path, monkeypatch, capsys):
    """Two saves closer together than the writer takes: the second one blocked training
    for the rest of the first write, and its line said only 'blocking 0.4 s', as if
    copying to CPU memory took that long. It names the wait; a save that did not wait
    says nothing of it."""
    original = checkpointing._torch_save_synced

    def slow_write(obj, path):
        time.sleep(0.4)
        original(obj, path)

    monkeypatch.setattr(checkpointing, "_torch_save_synced", slow_write)
    root, saver = str(tmp_path), AsyncSaver()
    save_checkpoint_async(root, 1, _state(1), _ps1(), saver)
    blocking = save_checkpoint_async(root, 2, _state(2), _ps1(), saver)  # at once
    saver.wait()
    assert blocking > 0.2
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "checkpoint save time" in ln]
    assert len(lines) == 2 and "waiting" not in lines[0], lines
    waited = re.search(r"\(blocking (\d+\.\d\d) s, of which (\d+\.\d\d) s waiting for the "
                       r"previous save to finish writing, writing \d+\.\d\d s in the "
                       r"background\)", lines[1])
    assert waited, lines[1]
    assert 0.2 < float(waited.group(2)) <= float(waited.group(1))
    assert read_tracker(root) == (2, False)


# --------------------------------------------------------------------------- told to stop
def test_finish_bounds_rank_0s_wait_for_a_part_that_never_comes(tmp_path, capsys):
    """A run stopping with rank 0's publisher waiting for another writer's marker: that
    wait ends after `finish`'s budget (it took the collective timeout, minutes, past
    torchrun's SIGKILL), nothing is published, and the failure names the missing part."""
    saver = AsyncSaver()
    root, tmp = tmp_path, str(tmp_path / "iter_0000005.tmp")
    os.makedirs(tmp)
    published = []

    def publish_when_complete():
        wait_for_markers(tmp, ["mp_rank_00", "mp_rank_01"], 600.0, stop=saver.stop_reason)
        saver.publish(lambda: published.append(5))

    open(marker_path(tmp, "mp_rank_00"), "w").close()  # rank 0's own part is complete
    saver.submit(publish_when_complete, "the checkpoint at iteration 5", who="[rank 0]")
    started = time.monotonic()
    assert saver.finish(0.3) is True
    assert time.monotonic() - started < 30.0 and not published  # not the 600 s wait
    out = capsys.readouterr().out
    assert "[rank 0] stopping: finishing the background save of the checkpoint at " \
           "iteration 5 first (at most 0 s)" in out
    assert "no finished files from mp_rank_01" in out and "not published" in out
    assert os.listdir(root) == ["iter_0000005.tmp"]
    assert saver.finish() is None, "nothing in flight any more"


_SIGTERM_CHILD = """
import os, signal, sys, time
from megatron.async_save import AsyncSaver
saver = AsyncSaver()
def write():
    time.sleep(1.5)
    open(sys.argv[1], "w").close()
saver.submit(write, "the checkpoint at iteration 5")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("not ended by SIGTERM")
"""


def test_sigterm_finishes_the_save_in_flight_then_ends_the_process(tmp_path):
    """SIGTERM (torchrun's, after another rank failed) under its default handling killed
    the process at once, the writer mid-file: the save a synchronous save would have kept
    was lost. Now the save finishes first, then the process ends by SIGTERM as before."""
    import subprocess
    import sys

    from tests.dist_utils import cpu_env

    done = tmp_path / "written"
    proc = subprocess.run([sys.executable, "-c", _SIGTERM_CHILD, str(done)],
                          env=cpu_env(PYTHONPATH=os.getcwd()), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -15, proc.stderr
    assert done.exists(), "the write in flight finished before the process ended"
    assert "stopping: finishing the background save of the checkpoint at iteration 5 " \
           "first" in proc.stdout


_ASYNC_TERM_WRAPPER = """
import os, runpy, sys, time
sys.path.insert(0, {root!r})
from megatron import checkpointing, training
if os.environ["RANK"] == "0":  # rank 0's disk is slow for iteration 5's file
    original = checkpointing._torch_save_synced
    def slow(obj, path):
        if isinstance(obj, dict) and obj.get("iteration") == 5:
            time.sleep(3.0)
        return original(obj, path)
    checkpointing._torch_save_synced = slow
else:  # rank 1 fails at iteration 6, while rank 0 still writes iteration 5
    original_step = training.train_step
    def step(tr, data, **kwargs):
        if tr.state.iteration + 1 == 6:
            raise ValueError("simulated data error at iteration 6")
        return original_step(tr, data, **kwargs)
    training.train_step = step
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.parametrize("flags", [[], ["--exit-signal-handler"]], ids=["default", "esh"])
def test_a_save_in_flight_is_kept_when_another_rank_fails(tmp_path, monkeypatch, flags):
    """The reviewer's case: torchrun, tp=2, rank 1 fails at iteration 6 while rank 0's
    background write of iteration 5 is slow. Torchrun's SIGTERM killed rank 0's writer:
    only iter_0000005.tmp was left and the tracker never moved. Now iteration 5 is
    published, as a synchronous save would have kept it."""
    import sys

    from tests import forked_script
    from tests.dist_utils import cpu_env, free_port
    from tests.test_preemption import MODEL

    forked_script.fork_torchrun_workers(monkeypatch)
    root = tmp_path / "ck"
    wrapper = tmp_path / "wrap.py"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wrapper.write_text(_ASYNC_TERM_WRAPPER.format(
        root=here, script=os.path.join(here, "pretrain_gpt.py")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--log-dir", str(tmp_path / "torchrun"), "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(wrapper),
           *MODEL, "--tensor-model-parallel-size", "2", "--train-iters", "10", "--save",
           str(root), "--save-interval", "5", "--async-save", *flags]
    log = tmp_path / "torchrun.log"
    pid = forked_script.start_command(cmd, cpu_env(PYTHONUNBUFFERED="1"), log)
    forked_script.wait([pid], 60)
    out = log.read_text()
    assert "simulated data error at iteration 6" in out
    assert read_tracker(str(root)) == (5, False), out[-3000:]
    # the lock file may stay when torchrun's SIGTERM ends rank 0 first (its flock goes with
    # the process: megatron/save_lock.py); nothing else may
    left = sorted(set(os.listdir(root)) - {".save.lock"})
    assert left == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert "stopping: finishing the background save of the checkpoint at iteration 5" in out
    if "[rank 0] stopped at" in out:  # rank 0's line names the checkpoint it finished
        assert "holds no checkpoint yet" not in out and "iter_0000005: relaunch" in out
