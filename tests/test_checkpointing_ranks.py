"""Checkpoint saves and loads over several gloo ranks (a shard missing, truncated or refused
on one rank stops every rank with one report), and saves stopped midway (Ctrl-C, an
interrupt inside torch.save): what stays on disk. Single-rank basics: test_checkpointing.py."""
import errno
import os
import time

import pytest
import torch

from megatron.checkpointing import (
    check_save_dir,
    checkpoint_name,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
    tracker_path,
)
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.test_checkpointing import (
    _assert_tree_equal,
    _full_state,
    _model_state,
    _ps1,
    _truncate,
)


# --- distributed (4 gloo processes) ----------------------------------------------------
def _dist_save_load(rank, world_size, root, tp, pp):
    ps = ParallelState.build(world_size, rank, tp_size=tp, pp_size=pp)
    state = _full_state(7, ps.tp_rank, ps.pp_rank) if ps.dp_rank == 0 else None
    save_checkpoint(root, 7, state, ps)
    iteration, loaded = load_checkpoint(root, ps)
    return {"iteration": iteration, "tp": ps.tp_rank, "pp": ps.pp_rank, "model": loaded["model"],
            "args": loaded["args"]}


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_distributed_save_load(tmp_path, tp, pp):
    root = str(tmp_path)
    results = run_distributed(_dist_save_load, 4, root, tp, pp)
    expected_dirs = sorted({os.path.basename(os.path.dirname(checkpoint_name(root, 7, t, p, pp)))
                            for t in range(tp) for p in range(pp)})
    assert sorted(os.listdir(tmp_path / "iter_0000007")) == expected_dirs
    assert len(expected_dirs) == tp * pp  # one file per (tp, pp): only DP-rank-0 wrote
    assert sorted(os.listdir(tmp_path)) == ["iter_0000007", "latest_checkpointed_iteration.txt"]
    for res in results:
        assert res["iteration"] == 7 and (res["args"]["tp"], res["args"]["pp"]) == \
            (res["tp"], res["pp"])
        _assert_tree_equal(res["model"], _model_state(res["tp"], res["pp"]))


def _dist_wrong_layout(rank, world_size, root):
    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0) if ps.dp_rank == 0 else None, ps)
    return _load_message(root, ParallelState.build(world_size, rank, tp_size=4))


def _load_message(root, ps):
    """load_checkpoint's SystemExit message, or None when it loads."""
    try:
        load_checkpoint(root, ps)
    except SystemExit as exc:
        return str(exc)
    return None


def test_distributed_missing_shard_exits_on_every_rank(tmp_path):
    messages = run_distributed(_dist_wrong_layout, 4, str(tmp_path))
    assert all(m is not None and m == messages[0] for m in messages)
    assert "mp_rank_02" in messages[0] and "mp_rank_03" in messages[0]
    assert "tensor-model-parallel size 2" in messages[0]


def _dist_file_gone(rank, world_size, root):
    import torch.distributed as dist

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 2, _full_state(2, ps.tp_rank, 0), ps)
    save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0), ps)
    if rank == 0:
        os.remove(checkpoint_name(root, 4, 1, 0, 1))
    dist.barrier()
    return _load_message(root, ps)


def test_a_rank_file_gone_from_the_runs_own_layout_is_named_incomplete(tmp_path):
    """The message told a tp-2 run to 'run with the checkpoint's sizes or reshard' a tp-2
    checkpoint that had lost mp_rank_01's file: it names the checkpoint incomplete and the
    one to fall back to."""
    messages = run_distributed(_dist_file_gone, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"error: checkpoint {tmp_path / 'iter_0000004'} is "
                                  "incomplete: mp_rank_01/model_optim_rng.pt is missing (its "
                                  "layout is this run's: tensor-model-parallel size 2")
    assert "Run with the checkpoint's sizes" not in messages[0]
    assert f"printf 2 > {tracker_path(str(tmp_path))}" in messages[0]


def _dist_truncated_shard(rank, world_size, root):
    import torch.distributed as dist

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0), ps)
    if rank == 0:
        _truncate(checkpoint_name(root, 4, 1, 0, 1))
    dist.barrier()
    return _load_message(root, ps)


def test_distributed_truncated_shard_exits_on_every_rank(tmp_path):
    """Only rank 1's file is damaged; rank 0 must not go on alone (it would hang). Both
    exit with one report, naming the rank (printed by rank 0 only: test_agreed_exit.py)."""
    messages = run_distributed(_dist_truncated_shard, 2, str(tmp_path))
    bad = checkpoint_name(str(tmp_path), 4, 1, 0, 1)
    assert messages[0].startswith(f"rank 1 (of 2): error: cannot read checkpoint file {bad}")
    assert messages[1] == messages[0]


def _dist_bad_save_dir(rank, world_size, path):
    try:
        check_save_dir(path, ParallelState.build(world_size, rank))
    except SystemExit as exc:
        return str(exc)
    return None


def test_distributed_bad_save_dir_exits_on_every_rank(tmp_path):
    (tmp_path / "file").write_text("x")
    messages = run_distributed(_dist_bad_save_dir, 2, str(tmp_path / "file" / "ck"))
    assert messages[0].startswith("rank 0 (of 2): error: --save ") and \
        "NotADirectoryError" in messages[0]
    assert messages[1] == messages[0]


def _dist_full_disk_on_one_rank(rank, world_size, root):
    from megatron.agreed_exit import AgreedExit

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 2, _full_state(2, ps.tp_rank, 0), ps)
    real_save = torch.save
    if rank == 1:
        def full(obj, f, *args, **kwargs):
            raise OSError(28, "No space left on device")

        torch.save = full
    try:
        save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0), ps)
    except AgreedExit as exc:
        cause = exc.__cause__
        return (exc.report, exc.prints, exc.code,
                None if cause is None else type(cause).__name__)
    finally:
        torch.save = real_save  # the test harness returns results with it
    return None


def _dist_tracker_full(rank, world_size, root):
    from megatron import checkpointing
    from megatron.agreed_exit import AgreedExit

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 2, _full_state(2, ps.tp_rank, 0), ps)

    def full(root_, iteration, release):
        raise OSError(28, "No space left on device")

    checkpointing.write_tracker = full
    try:
        save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0), ps)
    except AgreedExit as exc:
        return exc.report, exc.prints
    return None


def test_distributed_tracker_write_failure_exits_every_rank_with_one_report(tmp_path):
    """Rank 0 failing to write the tracker raised alone (a traceback) while the other
    ranks waited in the barrier after it."""
    (report0, prints0), (report1, prints1) = run_distributed(_dist_tracker_full, 2,
                                                             str(tmp_path))
    assert report0 == report1 and (prints0, prints1) == (True, False)
    assert report0.startswith("rank 0 (of 2): error: the checkpoint at iteration 4 was "
                              "written to")
    assert read_tracker(str(tmp_path)) == (2, False)


def test_distributed_full_disk_on_one_rank_fails_every_rank(tmp_path):
    """Every rank raises the same report, printed by rank 0 only (it used to be a
    traceback on each rank, rank 0's only saying that 'rank(s) [1] failed')."""
    results = run_distributed(_dist_full_disk_on_one_rank, 2, str(tmp_path))
    (report0, prints0, code0, cause0), (report1, prints1, code1, cause1) = results
    assert report0 == report1
    path = os.path.join(str(tmp_path), "iter_0000004.tmp", "mp_rank_01", "model_optim_rng.pt")
    assert report0.startswith("rank 1 (of 2): error: the checkpoint at iteration 4 could not "
                              f"be written to {path} (OSError: [Errno 28] No space left on device)")
    assert f"the previous checkpoint {os.path.join(str(tmp_path), 'iter_0000002')} is intact" \
        in report0
    assert (prints0, code0) == (True, report0) and (prints1, code1) == (False, 1)
    assert (cause0, cause1) == (None, "CheckpointWriteError"), "the failing rank chains its error"
    assert read_tracker(str(tmp_path)) == (2, False)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def _dist_save_refused(rank, world_size, root, where):
    """Save at 2, then at 4 with one write refused on one rank: rank 1's done-marker (a
    full quota, `where` "marker") or rank 0's iter_XXXXXXX.tmp directory ("tmp_dir", a full
    disk). Returns the AgreedExit's (report, prints), None when the save went through."""
    from megatron import checkpointing
    from megatron.agreed_exit import AgreedExit

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 2, _full_state(2, ps.tp_rank, 0), ps)
    real_mark, real_makedirs = checkpointing.mark_done, os.makedirs
    if where == "marker" and rank == 1:
        def over_quota(tmp_dir, name):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

        checkpointing.mark_done = over_quota
    if where == "tmp_dir" and rank == 0:
        def full(path, *args, **kwargs):
            if str(path).endswith(".tmp"):
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return real_makedirs(path, *args, **kwargs)

        os.makedirs = full
    try:
        save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0), ps)
    except AgreedExit as exc:
        return exc.report, exc.prints
    finally:
        checkpointing.mark_done, os.makedirs = real_mark, real_makedirs
    return None


def test_a_marker_refused_on_one_rank_fails_every_rank_with_one_report(tmp_path):
    """A rank whose files were written but whose (empty) done-marker was refused (a full
    quota) raised its OSError alone: rank 0 died in the agreement with gloo's
    'Connection closed by peer'. Every rank exits with the same report now."""
    (report0, prints0), (report1, prints1) = run_distributed(
        _dist_save_refused, 2, str(tmp_path), "marker")
    assert report0 == report1 and (prints0, prints1) == (True, False)
    marker = os.path.join(str(tmp_path), "iter_0000004.tmp", ".done.mp_rank_01")
    assert report0.startswith("rank 1 (of 2): error: the checkpoint at iteration 4 could not "
                              f"be written: its marker {marker} could not be created (OSError: "
                              "[Errno 122] Disk quota exceeded)"), report0
    assert read_tracker(str(tmp_path)) == (2, False)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_temporary_directory_refused_fails_every_rank_with_one_report(tmp_path):
    """Rank 0 unable to make iter_XXXXXXX.tmp (a full disk or inode quota) raised its
    OSError alone while the others waited in the barrier (under gloo: 'Connection closed
    by peer'). Every rank exits with the same report now; the tracker is unchanged."""
    (report0, prints0), (report1, prints1) = run_distributed(
        _dist_save_refused, 2, str(tmp_path), "tmp_dir")
    assert report0 == report1 and (prints0, prints1) == (True, False)
    tmp_dir = os.path.join(str(tmp_path), "iter_0000004.tmp")
    assert report0.startswith(f"rank 0 (of 2): error: the checkpoint at iteration 4 could not "
                              f"be written: "
                              f"{tmp_dir} could not be made (OSError: [Errno 28] No space "
                              f"left on device: '{tmp_dir}'); "), report0
    assert read_tracker(str(tmp_path)) == (2, False)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_a_temporary_directory_refused_is_one_message(tmp_path, monkeypatch):
    root = str(tmp_path)
    save_checkpoint(root, 2, _full_state(2, 0, 0), _ps1())
    real = os.makedirs

    def over_quota(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", over_quota)
    with pytest.raises(SystemExit) as err:
        save_checkpoint(root, 4, _full_state(4, 0, 0), _ps1())
    assert str(err.value.code).startswith("error: the checkpoint at iteration 4 could not be "
                                          "written: ")
    assert "Disk quota exceeded" in str(err.value.code)
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


# ---------------------------------------------------------------------- a save stopped midway
def _interrupt_writes_of(monkeypatch, iteration, before=None):
    """Ctrl-C (KeyboardInterrupt) in the file writes of `iteration`'s save; `before(path)`
    runs first."""
    from megatron import checkpointing

    original = checkpointing._torch_save_synced

    def interrupted(obj, path):
        if isinstance(obj, dict) and obj.get("iteration") == iteration:
            if before is not None:
                before(path)
            raise KeyboardInterrupt
        original(obj, path)

    monkeypatch.setattr(checkpointing, "_torch_save_synced", interrupted)


def test_a_save_stopped_midway_removes_its_partial_directory(tmp_path, monkeypatch):
    """Ctrl-C during a save's file writes left `iter_N.tmp/` until the next start warned
    of it. Now the save removes the directory it made (its only writer has stopped: the
    exception is this process's own), tells `on_stop`, and re-raises; the previous
    checkpoint and the tracker are untouched."""
    root, told = str(tmp_path), []
    save_checkpoint(root, 2, _full_state(2, 0, 0), _ps1())
    _interrupt_writes_of(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 4, _full_state(4, 0, 0), _ps1(),
                        on_stop=lambda d, removed: told.append((d, removed)))
    assert told == [(os.path.join(root, "iter_0000004.tmp"), True)]
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert load_checkpoint(root, _ps1())[0] == 2


def _ctrl_c_inside_torch_save(obj, f, *args, **kwargs):
    """What torch.save into an open file does when Ctrl-C comes midway: its zip writer,
    closed on the way out, raises a RuntimeError over the KeyboardInterrupt."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs "
                           "598") from None  # `from None` keeps the context, as torch's does


def test_ctrl_c_inside_torch_save_stops_the_save_as_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C inside torch.save (a real one, on a 2-rank tp run) surfaced as torch's
    RuntimeError: the save was reported as a write failure ("could not be written ...
    Free space or pass another --save", status 1, not the interrupt line) and a rank hung
    until torchrun killed it. The KeyboardInterrupt behind it now stops the save as
    Ctrl-C does: partial directory removed, `on_stop` told, the tracker untouched."""
    root, told = str(tmp_path), []
    save_checkpoint(root, 2, _full_state(2, 0, 0), _ps1())
    monkeypatch.setattr(torch, "save", _ctrl_c_inside_torch_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 4, _full_state(4, 0, 0), _ps1(),
                        on_stop=lambda d, removed: told.append((d, removed)))
    assert told == [(os.path.join(root, "iter_0000004.tmp"), True)]
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert read_tracker(root) == (2, False)


def test_a_save_stopped_after_publishing_keeps_the_published_directory(tmp_path, monkeypatch):
    """Ctrl-C after the rename, before the tracker: the published `iter_N/` stays (a load
    takes the tracker's checkpoint), and nothing is reported as removed."""
    from megatron import checkpointing

    root, told = str(tmp_path), []
    save_checkpoint(root, 2, _full_state(2, 0, 0), _ps1())
    original = checkpointing.write_tracker

    def interrupted(root_, iteration, release):
        if iteration == 4:
            raise KeyboardInterrupt
        original(root_, iteration, release)

    monkeypatch.setattr(checkpointing, "write_tracker", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 4, _full_state(4, 0, 0), _ps1(),
                        on_stop=lambda d, removed: told.append((d, removed)))
    assert told == []
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]
    assert read_tracker(root) == (2, False)


@pytest.mark.parametrize("other_writer", ["silent", "stopped"])
def test_a_stopped_save_stays_while_another_writer_may_still_write(tmp_path, monkeypatch,
                                                                    other_writer):
    """Rank 0 of tp=2 (no process group: the other writer is simulated by its marker).
    When the other writer never says it stopped (killed, or on a node the Ctrl-C did not
    reach, still writing), the partial directory stays for the next start's warning;
    once its marker is there, the directory goes."""
    from megatron.async_save import mark_failed

    root, told = str(tmp_path), []
    ps = ParallelState.build(2, 0, tp_size=2)

    def other(path):
        if other_writer == "stopped":
            mark_failed(os.path.dirname(os.path.dirname(path)), "mp_rank_01", "stopped")

    _interrupt_writes_of(monkeypatch, 4, before=other)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 4, _full_state(4, 0, 0), ps, stop_wait_s=0.3,
                        on_stop=lambda d, removed: told.append(removed))
    assert told == [other_writer == "stopped"]
    assert os.path.isdir(tmp_path / "iter_0000004.tmp") == (other_writer == "silent")
    assert read_tracker(root) == (None, False)


def _dist_ctrl_c_in_a_save(rank, world_size, root):
    """tp=2, both ranks write: Ctrl-C reaches rank 1 in its file writes and rank 0 after
    its own (in the barrier after writing; simulated without that collective)."""
    from megatron import checkpointing

    ps = ParallelState.build(world_size, rank, tp_size=2)
    save_checkpoint(root, 2, _full_state(2, ps.tp_rank, 0), ps)
    told, original = [], (checkpointing._torch_save_synced, checkpointing._after_write)

    def interrupted(*args, **kwargs):
        time.sleep(0.5 if rank == 1 else 0.0)  # rank 0 waits for rank 1's marker
        raise KeyboardInterrupt

    if rank == 1:
        checkpointing._torch_save_synced = interrupted
    else:
        checkpointing._after_write = interrupted
    try:
        save_checkpoint(root, 4, _full_state(4, ps.tp_rank, 0), ps,
                        on_stop=lambda d, removed: told.append(removed))
    except KeyboardInterrupt:
        return told
    finally:
        checkpointing._torch_save_synced, checkpointing._after_write = original
    return None


def test_distributed_ctrl_c_in_a_save_removes_the_partial_directory_once(tmp_path):
    """Rank 0 removes `iter_N.tmp/` (once) only after rank 1, still writing when Ctrl-C
    came, has left its marker; the tracker keeps the previous checkpoint."""
    assert run_distributed(_dist_ctrl_c_in_a_save, 2, str(tmp_path)) == [[True], []]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert read_tracker(str(tmp_path)) == (2, False)
