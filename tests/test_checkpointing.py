import enum
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.checkpointing import (
    CHECKPOINT_VERSION,
    CheckpointWriteError,
    args_to_plain,
    check_save_dir,
    checkpoint_name,
    get_rng_state,
    later_checkpoints_warning,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    save_checkpoint_async,
    set_rng_state,
    tracker_path,
)
from megatron.core.parallel_state import ParallelState
from tests.write_faults import torch_save_over_quota


class _FakeTracker:
    """Duck-typed RNG tracker (get_states/set_states), like the tensor-parallel one."""

    def __init__(self):
        self.states = {"model-parallel-rng": torch.arange(8, dtype=torch.uint8)}

    def get_states(self):
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states):
        self.states = {k: v.clone() for k, v in states.items()}


def _model_state(tp, pp, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + 10 * pp + tp)
    return {
        "language_model": {
            "encoder": {
                "layers.0.mlp.dense_h_to_4h.weight": torch.randn(8, 4, generator=g),
                "layers.0.mlp.dense_h_to_4h.bias": torch.randn(8, generator=g).bfloat16(),
                "final_layernorm.weight": torch.randn(4, generator=g).half(),
            }
        }
    }


def _full_state(iteration, tp, pp, seed=0, tracker=None):
    return {
        "args": args_to_plain({"num_layers": 2, "params_dtype": torch.bfloat16,
                               "data_path": ("a", Path("/x/b")), "tp": tp, "pp": pp}),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "model": _model_state(tp, pp, seed),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                      "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": iteration * 8,
                                "lr_decay_style": "cosine"},
        "rng_state": [get_rng_state(tracker)],
    }


def _assert_tree_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # byte-exact, NaNs included
        assert torch.equal(as_bytes(a), as_bytes(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_tree_equal(x, y)
    else:
        assert a == b


def _ps1():
    return ParallelState.build(world_size=1, rank=0)


# --- paths and tracker -----------------------------------------------------------------
def test_checkpoint_names():
    assert checkpoint_name("/ck", 100, 0, 0, 1) == "/ck/iter_0000100/mp_rank_00/model_optim_rng.pt"
    assert checkpoint_name("/ck", 1234567, 3, 0, 1) == \
        "/ck/iter_1234567/mp_rank_03/model_optim_rng.pt"
    assert checkpoint_name("/ck", 5, 1, 2, 4) == "/ck/iter_0000005/mp_rank_01_002/model_optim_rng.pt"
    assert checkpoint_name("/ck", 5, 0, 0, 2, release=True) == \
        "/ck/release/mp_rank_00_000/model_optim_rng.pt"
    assert tracker_path("/ck") == "/ck/latest_checkpointed_iteration.txt"


def test_read_tracker(tmp_path):
    assert read_tracker(str(tmp_path)) == (None, False)
    Path(tracker_path(str(tmp_path))).write_text("42")
    assert read_tracker(str(tmp_path)) == (42, False)
    Path(tracker_path(str(tmp_path))).write_text("release")
    assert read_tracker(str(tmp_path)) == (0, True)


def test_later_checkpoints_warning_only_when_a_later_iteration_is_tracked(tmp_path):
    root = str(tmp_path)
    assert later_checkpoints_warning(root, 0) is None  # nothing saved there yet
    for content, start, warns in [("40", 0, True), ("40", 20, True), ("40", 40, False),
                                  ("40", 60, False), ("release", 0, False), ("abc", 0, False)]:
        Path(tracker_path(root)).write_text(content)
        assert (later_checkpoints_warning(root, start) is not None) == warns, (content, start)
    Path(tracker_path(root)).write_text("40")
    assert "up to iteration 40" in later_checkpoints_warning(root, 20)


@pytest.mark.parametrize("tracker, said", [
    (None, "does not exist"), ("abc", "is malformed"), ("release", "names 'release'"),
    ("20", "names iteration 20")])
def test_later_checkpoints_warning_names_untracked_later_directories(tmp_path, tracker, said):
    """Iteration directories past the run's start that the tracker does not name (another
    run's copied in, a tracker lost or rolled back) were replaced by this run's saves
    without a word: the warning only read the tracker."""
    root = str(tmp_path)
    for it in (20, 30, 40, 50, 60):
        os.makedirs(os.path.join(root, f"iter_{it:07d}"))
    if tracker is not None:
        Path(tracker_path(root)).write_text(tracker)
    msg = later_checkpoints_warning(root, 20)
    assert msg is not None, tracker
    assert msg.startswith(f"WARNING: --save {root} holds iter_0000030, iter_0000040, "
                          "iter_0000050 and 1 more, past this run's start at iteration 20, "
                          f"and its latest_checkpointed_iteration.txt {said}"), msg
    assert "move them out of" in msg
    assert later_checkpoints_warning(root, 60) is None  # nothing past the start


@pytest.mark.parametrize("data, shown", [
    (b"\xff\xfe1", "'\ufffd\ufffd1'"),
    (b"7" * 10**6, "'" + "7" * 200 + "... (over 4096 bytes)'"),
], ids=["not-utf8", "huge"])
def test_a_binary_or_huge_tracker_is_named_briefly(tmp_path, data, shown):
    """A tracker that is not UTF-8 was a bare codec error that did not name the file; a
    large file copied over it was read whole and printed in the message."""
    Path(tracker_path(str(tmp_path))).write_bytes(data)
    with pytest.raises(ValueError) as err:
        read_tracker(str(tmp_path))
    msg = str(err.value)
    assert msg.startswith(f"malformed checkpoint tracker file {tracker_path(str(tmp_path))}: "
                          f"content {shown}; expected"), msg[:400]
    assert len(msg) < 1000


@pytest.mark.parametrize("content", ["abc", "", "0", "-3", "12.5"])
def test_malformed_tracker_names_file_and_content(tmp_path, content):
    Path(tracker_path(str(tmp_path))).write_text(content)
    with pytest.raises(ValueError) as err:
        read_tracker(str(tmp_path))
    msg = str(err.value)
    assert tracker_path(str(tmp_path)) in msg and repr(content) in msg
    save_checkpoint(str(tmp_path / "ck"), 5, _full_state(5, 0, 0), _ps1())
    Path(tracker_path(str(tmp_path / "ck"))).write_text(content)
    from megatron.checkpoint_reshard import locate_iteration  # the tools' way in

    for load in (lambda: load_checkpoint(str(tmp_path / "ck"), _ps1()),
                 lambda: locate_iteration(str(tmp_path / "ck"))):
        with pytest.raises(SystemExit) as err:  # a clean exit, not a traceback
            load()
        assert str(err.value).startswith(f"error: malformed checkpoint tracker file "
                                         f"{tracker_path(str(tmp_path / 'ck'))}: content "
                                         f"{content!r}")
        assert str(err.value).endswith(f"the checkpoints under {tmp_path / 'ck'} are "
                                       "iter_0000005: to resume from one, write its iteration into "
                                       f"{tracker_path(str(tmp_path / 'ck'))} (e.g. `printf 5 > "
                                       f"{tracker_path(str(tmp_path / 'ck'))}`)")


def test_tracker_naming_a_missing_iteration_lists_the_existing_ones(tmp_path):
    root = str(tmp_path)
    for it in (5, 10):
        save_checkpoint(root, it, _full_state(it, 0, 0), _ps1())
    Path(tracker_path(root)).write_text("7")
    with pytest.raises(SystemExit) as err:
        load_checkpoint(root, _ps1())
    msg = str(err.value)
    assert f"{tmp_path / 'iter_0000007'} does not exist" in msg
    assert "iter_0000005, iter_0000010" in msg and "mp_rank" not in msg
    assert f"printf 10 > {tracker_path(root)}" in msg
    from megatron.checkpoint_reshard import locate_iteration  # the tools' way in

    with pytest.raises(SystemExit, match="the checkpoints under .*: iter_0000005, iter_0000010"):
        locate_iteration(root)


def _truncate(path, size=5000):
    with open(path, "rb") as f:
        head = f.read(size)
    with open(path, "wb") as f:
        f.write(head)


def test_truncated_shard_names_the_file_and_the_earlier_checkpoint(tmp_path):
    from megatron.checkpoint_reshard import load_shard, read_layout

    root = str(tmp_path)
    for it in (5, 10):
        save_checkpoint(root, it, _full_state(it, 0, 0), _ps1())
    path = checkpoint_name(root, 10, 0, 0, 1)
    _truncate(path)
    for load in (lambda: load_checkpoint(root, _ps1()), lambda: load_shard(path),
                 lambda: read_layout(str(tmp_path / "iter_0000010"))):
        with pytest.raises(SystemExit) as err:
            load()
        msg = str(err.value)
        assert msg.startswith(f"error: cannot read checkpoint file {path} (")
        assert "(the file is truncated or not a torch checkpoint" in msg
        assert "iter_0000005" in msg
        # torch's paragraph of advice after its one-line reason is left out
        assert "miniz" not in msg and "high likelihood" not in msg and "\n" not in msg
        assert f"printf 5 > {tracker_path(root)}" in msg
    Path(path).write_bytes(b"")  # an empty file (EOFError, or the mmap refusal)
    for load in (lambda: load_checkpoint(root, _ps1()), lambda: load_shard(path)):
        with pytest.raises(SystemExit, match="cannot read checkpoint file"):
            load()


def test_a_missing_first_shard_names_the_checkpoint_incomplete_and_the_earlier_one(tmp_path):
    """A save killed after making mp_rank_00/ but before writing its file: the layout
    check (the trainer's and the tools') said only 'checkpoint shard ... is missing'."""
    from megatron.checkpoint_reshard import inspect_checkpoint

    root = str(tmp_path)
    for it in (5, 10):
        save_checkpoint(root, it, _full_state(it, 0, 0), _ps1())
    os.remove(checkpoint_name(root, 10, 0, 0, 1))
    with pytest.raises(SystemExit) as err:
        inspect_checkpoint(str(tmp_path / "iter_0000010"))
    msg = str(err.value.code)
    assert msg.startswith(f"error: checkpoint {tmp_path / 'iter_0000010'} is incomplete: "
                          "mp_rank_00/model_optim_rng.pt is missing")
    assert f"printf 5 > {tracker_path(root)}" in msg


# --- single-process save/load ----------------------------------------------------------
def test_round_trip_single_process(tmp_path, capsys):
    root = str(tmp_path / "ck")
    state = _full_state(100, 0, 0, tracker=_FakeTracker())
    seconds = save_checkpoint(root, 100, state, _ps1())
    assert seconds >= 0.0
    out = capsys.readouterr().out
    assert f"saving checkpoint at iteration     100 to {root}" in out
    # Megatron's line exactly, the time on a line of its own
    assert f"\n  successfully saved checkpoint at iteration     100 to {root}\n" \
           f"  checkpoint save time (blocking " in out
    assert Path(tracker_path(root)).read_text() == "100"  # no newline, like Megatron
    assert sorted(os.listdir(root)) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    path = checkpoint_name(root, 100, 0, 0, 1)
    _assert_tree_equal(torch.load(path, weights_only=True), state)  # plain data only
    iteration, loaded = load_checkpoint(root, _ps1())
    assert iteration == 100
    _assert_tree_equal(loaded, state)
    assert loaded["args"]["params_dtype"] == "torch.bfloat16"


def test_resave_same_iteration_replaces(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 5, _full_state(5, 0, 0, seed=1), _ps1())
    save_checkpoint(root, 5, _full_state(5, 0, 0, seed=2), _ps1())
    _, loaded = load_checkpoint(root, _ps1())
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=2))
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("linked", ["iter_0000005", "iter_0000005.tmp", "iter_0000005.old"])
def test_a_linked_directory_in_the_way_goes_as_a_link(tmp_path, capsys, linked):
    """An iteration directory moved to other storage and linked back, then saved again
    (a resume from an earlier checkpoint reaching it): shutil.rmtree refused the link
    after the new directory was in place, so the save failed with 'could not be moved into
    place' and no tracker; a linked `.tmp`/`.old` failed it too. The link goes, what it
    points to stays as it was, and the tracker names the new save."""
    cold = tmp_path / "cold" / "iter_0000005"
    (cold / "mp_rank_00").mkdir(parents=True)
    (cold / "mp_rank_00" / "model_optim_rng.pt").write_text("not this save's")
    root = tmp_path / "ck"
    root.mkdir()
    os.symlink(cold, root / linked)
    save_checkpoint(str(root), 5, _full_state(5, 0, 0, seed=2), _ps1())
    assert (cold / "mp_rank_00" / "model_optim_rng.pt").read_text() == "not this save's"
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert not os.path.islink(root / "iter_0000005") and read_tracker(str(root)) == (5, False)
    _, loaded = load_checkpoint(str(root), _ps1())
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=2))
    assert f"note: {root / linked} is a link to {cold}: the link is removed" in \
        capsys.readouterr().out


def test_crash_before_rename_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    # a save of iteration 20 that died after writing its shard, before the rename
    partial = tmp_path / "iter_0000020.tmp" / "mp_rank_00"
    partial.mkdir(parents=True)
    (partial / "model_optim_rng.pt").write_bytes(b"truncated")
    iteration, loaded = load_checkpoint(root, _ps1())
    assert iteration == 10
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=1))
    # the next save of iteration 20 clears the leftovers and becomes the latest
    save_checkpoint(root, 20, _full_state(20, 0, 0, seed=3), _ps1())
    assert not (tmp_path / "iter_0000020.tmp").exists()
    iteration, loaded = load_checkpoint(root, _ps1())
    assert iteration == 20
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=3))


def test_crash_before_tracker_write_keeps_previous(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    save_checkpoint(root, 20, _full_state(20, 0, 0, seed=2), _ps1())
    Path(tracker_path(root)).write_text("10")  # as if the tracker write never happened
    assert load_checkpoint(root, _ps1())[0] == 10


def test_crash_while_replacing_same_iteration_recovers_old_copy(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    # a re-save of iteration 10 died after moving the old directory aside
    os.rename(tmp_path / "iter_0000010", tmp_path / "iter_0000010.old")
    (tmp_path / "iter_0000010.tmp").mkdir()
    iteration, loaded = load_checkpoint(root, _ps1())
    assert iteration == 10
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=1))


def _lock_as_another_process(root):
    """Hold `root`'s save lock through a descriptor of its own (flock locks belong to the
    open file: this process's loads find it held, as they would another run's)."""
    import fcntl

    fd = os.open(os.path.join(root, ".save.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"training run, host h, process 4242, since 2026-01-01 00:00:00\n")
    return fd


def test_a_load_waits_for_a_running_save_that_is_replacing_the_checkpoint(tmp_path):
    """A --load-only job (evaluation, generation) started while the run saving into that
    directory re-saves iteration 10, between its two renames (iter_10 -> iter_10.old, then
    iter_10.tmp -> iter_10): the load moved iter_10.old back, the run's own rename then
    failed ('Directory not empty') and its save with it. Now, the save lock held by
    another process, the load waits for the new copy and leaves the directory alone."""
    import threading

    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    save_checkpoint(root, 20, _full_state(10, 0, 0, seed=2), _ps1())
    Path(tracker_path(root)).write_text("10")
    os.rename(tmp_path / "iter_0000010", tmp_path / "iter_0000010.old")
    os.rename(tmp_path / "iter_0000020", tmp_path / "iter_0000010.tmp")  # the new copy
    fd = _lock_as_another_process(root)
    renamed = []

    def writer():  # the running save, a moment later
        time.sleep(0.5)
        try:
            os.rename(tmp_path / "iter_0000010.tmp", tmp_path / "iter_0000010")
            renamed.append(True)
        except OSError as exc:
            renamed.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        iteration, loaded = load_checkpoint(root, _ps1())
    finally:
        thread.join()
        os.close(fd)
    assert renamed == [True]
    assert iteration == 10
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=2))


def test_a_load_does_not_restore_the_old_copy_while_another_run_holds_the_lock(
        tmp_path, monkeypatch):
    from megatron import checkpoint_load

    monkeypatch.setattr(checkpoint_load, "REPLACE_WAIT_S", 0.3, raising=False)
    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    os.rename(tmp_path / "iter_0000010", tmp_path / "iter_0000010.old")
    fd = _lock_as_another_process(root)
    try:
        with pytest.raises(SystemExit) as info:
            load_checkpoint(root, _ps1())
    finally:
        os.close(fd)
    text = str(info.value.code)
    assert text.startswith(f"error: {tmp_path / 'iter_0000010'} is missing and "
                           f"{tmp_path / 'iter_0000010'}.old is there, while another training "
                           "run (host h, process 4242")
    assert "did not finish within 0 s. Load again once its save has finished" in text
    assert sorted(os.listdir(tmp_path)) == [".save.lock", "iter_0000010.old",
                                            "latest_checkpointed_iteration.txt"]
    # Once that run is gone (its lock released), the load restores the copy.
    iteration, loaded = load_checkpoint(root, _ps1())
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=1))


def test_a_run_holding_its_own_save_lock_restores_the_old_copy(tmp_path):
    from megatron.save_lock import SaveDirLock

    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    os.rename(tmp_path / "iter_0000010", tmp_path / "iter_0000010.old")
    with SaveDirLock(root) as lock:
        assert lock.acquire() is None
        iteration, loaded = load_checkpoint(root, _ps1())
        assert lock.held
    assert iteration == 10 and not os.path.exists(tmp_path / "iter_0000010.old")


def test_a_resave_over_an_interrupted_replace_never_leaves_no_complete_copy(tmp_path,
                                                                             monkeypatch):
    """iter_N.old without iter_N is the only copy of N. A save of N stopped while removing
    it (Ctrl-C, here after its first file) removed it before moving the new copy into place,
    and the stopped save's directory too: neither copy was left, and the load restored the
    half-deleted .old."""
    import shutil

    root = str(tmp_path)
    save_checkpoint(root, 10, _full_state(10, 0, 0, seed=1), _ps1())
    os.rename(tmp_path / "iter_0000010", tmp_path / "iter_0000010.old")
    original = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        if str(path).endswith(".old"):
            first = next(os.path.join(top, f) for top, _, files in os.walk(path) for f in files)
            os.remove(first)
            raise KeyboardInterrupt
        return original(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 10, _full_state(10, 0, 0, seed=2), _ps1())
    monkeypatch.undo()
    iteration, loaded = load_checkpoint(root, _ps1())
    assert iteration == 10
    _assert_tree_equal(loaded["model"], _model_state(0, 0, seed=2))


def test_release_checkpoint_loads_as_iteration_zero(tmp_path):
    save_checkpoint(str(tmp_path), 0, _full_state(0, 0, 0), _ps1(), release=True)
    assert Path(tracker_path(str(tmp_path))).read_text() == "release"
    iteration, state = load_checkpoint(str(tmp_path), _ps1())
    assert iteration == 0 and (tmp_path / "release" / "mp_rank_00").is_dir()


def test_check_save_dir_creates_the_directory_or_names_the_problem(tmp_path):
    root = tmp_path / "a" / "b"
    check_save_dir(str(root), _ps1())
    assert root.is_dir() and os.listdir(root) == [], "created, the probe file removed"
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub", Path("/proc/x")):
        with pytest.raises(SystemExit) as err:
            check_save_dir(str(bad), _ps1())
        msg = str(err.value)
        assert msg.startswith(f"error: --save {bad} cannot be used: ") and "Error: [Errno" in msg


def test_a_tensorboard_dir_that_cannot_be_written_stops_the_run_with_a_message(tmp_path):
    """--tensorboard-dir naming a file (or an unwritable place) ended the run in a
    FileExistsError traceback from inside tensorboard; now the start-up check names it."""
    from megatron.arguments import parse_and_validate
    from megatron.initialize import initialize_distributed
    from megatron.training import pretrain

    (tmp_path / "tb").write_text("x")
    argv = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3 --train-iters 1 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 50 --eval-iters 0 "
            f"--num-workers 0 --tensorboard-dir {tmp_path / 'tb'}").split()
    cfg = parse_and_validate(argv, world_size=1, env={}, cuda_available=False)
    with pytest.raises(SystemExit) as err:
        pretrain(cfg, initialize_distributed(cfg.parallel, 0, 1, 0))
    assert str(err.value).startswith(f"error: --tensorboard-dir {tmp_path / 'tb'} cannot be "
                                     "used: could not create it or write into it")


def _disk_full(monkeypatch):
    """torch.save fails as it does on a full disk (after writing part of the file)."""
    def full(obj, f, *args, **kwargs):
        f.write(b"PK partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 10")

    monkeypatch.setattr(torch, "save", full)


def test_full_disk_names_iteration_path_free_space_and_intact_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path)
    save_checkpoint(root, 5, _full_state(5, 0, 0), _ps1())
    _disk_full(monkeypatch)
    with pytest.raises(SystemExit) as err:  # one message, no traceback, as with several ranks
        save_checkpoint(root, 10, _full_state(10, 0, 0), _ps1())
    msg = str(err.value.code)
    path = os.path.join(root, "iter_0000010.tmp", "mp_rank_00", "model_optim_rng.pt")
    assert msg.startswith(f"error: the checkpoint at iteration 10 could not be written to "
                          f"{path} (RuntimeError: [enforce fail")
    assert re.search(rf"; (\d+ bytes|\d+\.\d (KiB|MiB|GiB|TiB)) free on the file system of "
                     rf"{root} \(a disk quota or file-size limit may allow less\); ", msg)
    assert f"the previous checkpoint {os.path.join(root, 'iter_0000005')} is intact" in msg
    assert isinstance(err.value.__cause__, CheckpointWriteError), "the error is chained"
    assert isinstance(err.value.__cause__.__cause__, RuntimeError), "... and the original one"
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    monkeypatch.undo()
    assert load_checkpoint(root, _ps1())[0] == 5


def test_quota_behind_torchs_zip_error_is_named_with_its_fix(tmp_path, monkeypatch):
    """torch.save into a file over quota fails with RuntimeError "unexpected pos ... vs ...",
    the OSError in its context; the message showed torch's text and the file system's free
    space (tens of GiB) as if there were room: it names the quota and its fix now."""
    root = str(tmp_path)

    monkeypatch.setattr(torch, "save", torch_save_over_quota)
    with pytest.raises(SystemExit) as err:
        save_checkpoint(root, 10, _full_state(10, 0, 0), _ps1())
    msg = str(err.value.code)
    assert "(OSError: [Errno 122] Disk quota exceeded); " in msg, msg
    assert "unexpected pos" not in msg
    assert "(a disk quota or file-size limit may allow less)" in msg
    assert msg.endswith("Free space within your disk quota (or have it raised), or pass "
                        "another --save on a file system with room in your quota")


def test_file_size_limit_is_named_with_the_limit(tmp_path):
    """A real `ulimit -f` (torch.save's own RuntimeError, EFBIG in its context): the
    message names the limit and how to raise it, not 'unexpected pos'."""
    code = (f"import resource, sys; sys.path.insert(0, {os.getcwd()!r}); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.RLIM_INFINITY)); "
            "from tests.test_checkpointing import _full_state, _ps1; import torch; "
            "from megatron.checkpointing import save_checkpoint; "
            "state = _full_state(3, 0, 0); state['big'] = torch.zeros(2**18); "
            f"save_checkpoint({str(tmp_path)!r}, 3, state, _ps1())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "(OSError: [Errno 27] File too large; this process may write files of at most " \
           "512.0 KiB (ulimit -f 512)); " in last, last
    assert "unexpected pos" not in last
    assert last.endswith("Raise the file-size limit (ulimit -f unlimited) before the run, or "
                         "pass another --save on a file system without one")
    assert os.listdir(tmp_path) == []


def test_out_of_memory_while_writing_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """Serialising a checkpoint can fail for lack of host memory; the message used to
    advise freeing disk space."""
    root = str(tmp_path)
    save_checkpoint(root, 5, _full_state(5, 0, 0), _ps1())

    def no_memory(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 8589934592 bytes.")

    def no_python_memory(obj, f, *args, **kwargs):  # pickling a large object, say
        raise MemoryError()

    monkeypatch.setattr(torch, "save", no_python_memory)
    with pytest.raises(SystemExit, match="out of host memory while serialising"):
        save_checkpoint(root, 10, _full_state(10, 0, 0), _ps1())
    monkeypatch.setattr(torch, "save", no_memory)
    with pytest.raises(SystemExit) as err:
        save_checkpoint(root, 10, _full_state(10, 0, 0), _ps1())
    msg = str(err.value.code)
    assert "out of host memory while serialising it" in msg and "free on the" not in msg
    assert f"the previous checkpoint {os.path.join(root, 'iter_0000005')} is intact" in msg
    assert "--dry-run" in msg and "Free space" not in msg
    assert sorted(os.listdir(root)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]


def _tracker_disk_full(monkeypatch, iteration):
    """Writing the tracker of `iteration` fails as on a full disk, after its temporary
    file was created (the write's own clean-up must remove it)."""
    from megatron import checkpointing

    original = checkpointing.write_tracker

    def full(root, it, release):
        if it != iteration:
            return original(root, it, release)
        real_fsync = os.fsync

        def no_space(fd):
            raise OSError(28, "No space left on device")
        os.fsync = no_space
        try:
            return original(root, it, release)
        finally:
            os.fsync = real_fsync

    monkeypatch.setattr(checkpointing, "write_tracker", full)


def _assert_tracker_failure_message(msg, root):
    tracker = tracker_path(root)
    assert msg.startswith(f"error: the checkpoint at iteration 4 was written to "
                          f"{os.path.join(root, 'iter_0000004')}, but {tracker} could not be "
                          "updated to name it (OSError: [Errno 28] No space left on device); ")
    assert f"the previous checkpoint {os.path.join(root, 'iter_0000002')} is intact" in msg
    assert f"free space and run `printf 4 > {tracker}`" in msg


def test_a_tracker_that_cannot_be_written_exits_naming_both_checkpoints(tmp_path, monkeypatch):
    """The last write of a save (the tracker) failing on a full disk was an OSError
    traceback; the checkpoint directory is complete, the tracker names the previous one."""
    root = str(tmp_path)
    save_checkpoint(root, 2, _full_state(2, 0, 0), _ps1())
    _tracker_disk_full(monkeypatch, 4)
    with pytest.raises(SystemExit) as err:
        save_checkpoint(root, 4, _full_state(4, 0, 0), _ps1())
    _assert_tracker_failure_message(str(err.value.code), root)
    assert isinstance(err.value.__cause__, CheckpointWriteError)
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"], "no tracker .tmp"
    monkeypatch.undo()
    assert load_checkpoint(root, _ps1())[0] == 2
    Path(tracker_path(root)).write_text("4")  # the fix the message gives
    assert load_checkpoint(root, _ps1())[0] == 4


def test_a_tracker_that_cannot_be_written_in_a_background_save(tmp_path, monkeypatch):
    from megatron.async_save import AsyncSaver

    root, saver = str(tmp_path), AsyncSaver()
    save_checkpoint(root, 2, _full_state(2, 0, 0), _ps1())
    _tracker_disk_full(monkeypatch, 4)
    save_checkpoint_async(root, 4, _full_state(4, 0, 0), _ps1(), saver)
    with pytest.raises(RuntimeError) as err:
        saver.wait()
    prefix = f"the background save of the checkpoint at iteration 4 to {root} failed: "
    assert str(err.value).startswith(prefix)
    _assert_tracker_failure_message("error: " + str(err.value)[len(prefix):], root)


def test_full_disk_in_a_background_save(tmp_path, monkeypatch):
    from megatron.async_save import AsyncSaver

    saver = AsyncSaver()
    _disk_full(monkeypatch)
    save_checkpoint_async(str(tmp_path), 3, _full_state(3, 0, 0), _ps1(), saver)
    with pytest.raises(RuntimeError, match="background save") as err:
        saver.wait()
    assert isinstance(err.value.__cause__, CheckpointWriteError)
    assert "there is no earlier checkpoint in" in str(err.value)
    assert read_tracker(str(tmp_path)) == (None, False)


def test_save_rejects_iteration_zero(tmp_path):
    with pytest.raises(ValueError, match="iteration 0"):
        save_checkpoint(str(tmp_path), 0, {}, _ps1())


def test_a_load_path_with_an_unexpanded_tilde_is_named(tmp_path, capsys, monkeypatch):
    """`--load "~/ckpt"` (quoted) started from random with only Megatron's warning; it now
    also says that '~' was not expanded, and how to write the path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/me")
    assert load_checkpoint("~/ckpt", _ps1()) is None
    out = capsys.readouterr().out
    assert "WARNING: could not find the metadata file ~/ckpt/latest_checkpointed_iteration.txt" in out
    assert "(--load ~/ckpt; '~' was not expanded to a home directory" in out
    assert "write /home/me/ckpt" in out


def test_missing_checkpoint_behaviours(tmp_path, capsys):
    assert load_checkpoint(str(tmp_path / "nothing"), _ps1()) is None
    assert "WARNING: could not find the metadata file" in capsys.readouterr().out
    assert load_checkpoint(None, _ps1()) is None
    with pytest.raises(SystemExit, match="exit-on-missing-checkpoint"):
        load_checkpoint(str(tmp_path), _ps1(), exit_on_missing=True)


def test_load_pointing_at_untracked_checkpoints_is_refused(tmp_path, capsys):
    """No tracker, but --load is an iteration directory or holds some: an error with the
    fix, not a fresh start whose saves would mix with those checkpoints."""
    root = str(tmp_path / "ck")
    for it in (5, 10):
        save_checkpoint(root, it, _full_state(it, 0, 0), _ps1())
    iter_dir = str(tmp_path / "ck" / "iter_0000010")
    with pytest.raises(SystemExit, match=rf"--load {iter_dir} is one checkpoint's iteration "
                                         rf"directory; .* --load {root} "):
        load_checkpoint(iter_dir, _ps1())
    os.remove(tracker_path(root))
    with pytest.raises(SystemExit, match=r"has no latest_checkpointed_iteration.txt but holds "
                                         r"checkpoints; .*iter_0000005, iter_0000010.*printf 10"):
        load_checkpoint(root, _ps1())
    assert load_checkpoint(str(tmp_path / "empty"), _ps1()) is None  # Megatron's warning
    assert "will start from random" in capsys.readouterr().out


def test_missing_rank_file_names_path_and_layout(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 3, _full_state(3, 0, 0), _ps1())
    # a tp=2 run (rank 1 of 2, no process group) looking for mp_rank_01
    ps = ParallelState.build(world_size=2, rank=1, tp_size=2, create_groups=False)
    with pytest.raises(SystemExit) as err:
        load_checkpoint(root, ps)
    msg = str(err.value)
    assert checkpoint_name(root, 3, 1, 0, 1) in msg
    assert "tensor-model-parallel size 1" in msg and "pipeline-model-parallel size 1" in msg
    assert "mp_rank_00" in msg


# --- RNG and args ----------------------------------------------------------------------
def test_rng_state_round_trip_through_weights_only_file(tmp_path):
    tracker = _FakeTracker()
    random.random(), np.random.rand(), torch.rand(1)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = get_rng_state(tracker)
    expected = (random.random(), np.random.rand(3).tolist(), np.random.randn(),
                torch.rand(4))
    path = tmp_path / "rng.pt"
    torch.save({"rng_state": [state]}, path)
    loaded = torch.load(path, weights_only=True)["rng_state"][0]
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    tracker.states = {}
    set_rng_state(loaded, tracker)
    again = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4))
    assert again[:3] == expected[:3] and torch.equal(again[3], expected[3])
    assert torch.equal(tracker.states["model-parallel-rng"], torch.arange(8, dtype=torch.uint8))
    assert loaded["cuda_rng_state"] is None or torch.cuda.is_available()


def test_set_rng_state_accepts_megatron_numpy_form():
    state = get_rng_state()
    state["np_rng_state"] = np.random.get_state()  # what Megatron itself pickles
    expected = np.random.rand(2)
    set_rng_state(state)
    assert np.array_equal(np.random.rand(2), expected)


class _Color(enum.Enum):
    RED = "red"


def test_args_to_plain():
    import argparse

    plain = args_to_plain({
        "dtype": torch.float16, "sizes": (1, 2), "path": Path("/a/b"), "nested": {"s": {3}},
        "color": _Color.RED, "ns": argparse.Namespace(x=1), "np": np.int64(4), "none": None,
        "obj": object,
    })
    assert plain == {"dtype": "torch.float16", "sizes": [1, 2], "path": "/a/b",
                     "nested": {"s": [3]}, "color": "red", "ns": {"x": 1}, "np": 4,
                     "none": None, "obj": str(object)}
    assert type(plain["np"]) is int



def test_two_tracker_writes_at_once_keep_their_temporary_files_apart(tmp_path, monkeypatch):
    """Two runs saving into one --save where the file system cannot lock it: both wrote
    `latest_checkpointed_iteration.txt.tmp`; the second truncated it after the first had
    moved it into place (a reader found the tracker empty) and then failed to find it."""
    from megatron import checkpointing

    root = str(tmp_path)
    real_fsync, seen = os.fsync, []

    def other_run_meanwhile(fd):
        real_fsync(fd)
        if not seen:
            seen.append(True)
            checkpointing.write_tracker(root, 6, False)  # the other run, start to end
            seen.append(read_tracker(root))

    monkeypatch.setattr(os, "fsync", other_run_meanwhile)
    checkpointing.write_tracker(root, 4, False)
    assert seen[1:] == [(6, False)]
    assert read_tracker(root) == (4, False)
    assert os.listdir(root) == ["latest_checkpointed_iteration.txt"]
