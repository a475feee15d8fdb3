"""Two training runs writing one --save: the second stops at start-up naming the first
(megatron/save_lock.py), on every rank; a killed run leaves no stale lock; a clean end
leaves no lock file; a file system without locks only gets a note."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron import save_lock
from megatron.checkpoint_dirs import read_tracker, unfinished_saves_report
from megatron.save_lock import LOCK_NAME, SaveDirLock, lock_save_dir
from tests.test_resume_guards import run_pretrain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK0 = SimpleNamespace(rank=0)


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = SaveDirLock(str(tmp_path))
    assert first.acquire() is None and first.held
    second = SaveDirLock(str(tmp_path))
    message = second.acquire()
    assert not second.held
    assert message.startswith(f"error: --save {tmp_path} is in use by another training run "
                              f"(host {os.uname().nodename}, process {os.getpid()}, since ")
    assert "Stop that run, or pass another --save" in message
    first.release()
    assert not os.path.exists(tmp_path / LOCK_NAME), "a clean end leaves no file"
    assert second.acquire() is None
    second.release()


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from megatron.save_lock import SaveDirLock; "
            f"assert SaveDirLock({str(tmp_path)!r}).acquire() is None; "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert "is in use by another training run" in SaveDirLock(str(tmp_path)).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(tmp_path / LOCK_NAME), "the file stays"
    lock = SaveDirLock(str(tmp_path))
    assert lock.acquire() is None, "the kernel released the killed process's lock"
    lock.release()


def test_a_second_run_on_the_same_save_stops_before_touching_it(tmp_path):
    """The first run (here: its lock, held by this process) owns --save; the second stops
    before it builds anything, and the first's checkpoint, tracker and the save it may be
    writing (iter_N.tmp) stay as they were; a run after the first ended removes that."""
    args = ["--seq-length", "8", "--train-iters", "4", "--save", str(tmp_path),
            "--save-interval", "2"]
    run_pretrain(args + ["--exit-interval", "2"])
    os.makedirs(tmp_path / "iter_0000003.tmp" / "mp_rank_00")  # the first run may write it
    before = sorted(os.listdir(tmp_path))
    mtime = os.path.getmtime(tmp_path / "iter_0000002")
    with SaveDirLock(str(tmp_path)) as first:
        assert first.acquire() is None
        with pytest.raises(SystemExit, match=rf"--save {tmp_path} is in use by another "
                                             "training run"):
            run_pretrain(args)
        assert sorted(os.listdir(tmp_path)) == sorted(before + [LOCK_NAME])
    assert read_tracker(str(tmp_path)) == (2, False)
    assert os.path.getmtime(tmp_path / "iter_0000002") == mtime
    assert os.path.isdir(tmp_path / "iter_0000003.tmp"), "another run's save is not removed"
    _backdate(tmp_path / "iter_0000003.tmp", 601)  # the first run stopped writing it
    tr = run_pretrain(args + ["--load", str(tmp_path)])
    assert tr.state.iteration == 4 and not os.path.exists(tmp_path / LOCK_NAME)
    assert not os.path.exists(tmp_path / "iter_0000003.tmp"), "once the first run is gone"


def test_an_evaluation_of_a_running_runs_save_is_not_refused(tmp_path, capsys):
    """The training command line plus --skip-train (evaluation only: it saves nothing)
    while that training runs: it was refused as a second run saving into --save. It
    evaluates the latest checkpoint, and leaves the running run's files alone."""
    args = ["--seq-length", "8", "--train-iters", "4", "--save", str(tmp_path),
            "--save-interval", "2"]
    run_pretrain(args + ["--exit-interval", "2"])
    os.makedirs(tmp_path / "iter_0000004.tmp" / "mp_rank_00")  # the running run's save
    _backdate(tmp_path / "iter_0000004.tmp", 3600)
    capsys.readouterr()
    with SaveDirLock(str(tmp_path)) as first:
        assert first.acquire() is None
        tr = run_pretrain(args + ["--load", str(tmp_path), "--skip-train", "--eval-iters", "1"])
        assert first.held and os.path.exists(tmp_path / LOCK_NAME)
    assert tr.state.iteration == 2
    out = capsys.readouterr().out
    assert "validation loss at iteration 2 on 4-sample draw from validation set" in out
    assert "iter_0000004.tmp" not in out
    assert os.path.isdir(tmp_path / "iter_0000004.tmp")
    assert read_tracker(str(tmp_path)) == (2, False)


def _two_ranks(rank, world_size, root):
    import torch.distributed as dist

    try:
        lock_save_dir(root, SimpleNamespace(rank=dist.get_rank()))
    except SystemExit as exc:
        return str(exc.code)
    return None


def test_every_rank_stops_together(tmp_path):
    from tests.dist_utils import run_distributed

    with SaveDirLock(str(tmp_path)) as first:
        assert first.acquire() is None
        codes = run_distributed(_two_ranks, 2, str(tmp_path))
    assert f"error: --save {tmp_path} is in use by another training run" in codes[0]
    assert codes[1] == "1", "rank 1 exits with status 1, rank 0 prints the message"


def test_a_file_system_without_locks_runs_with_a_note(tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(save_lock.fcntl, "flock", no_locks)
    with lock_save_dir(str(tmp_path), RANK0) as lock:
        assert not lock.held
    assert (f"note: --save {tmp_path}: its file system does not lock files (OSError: [Errno "
            f"{errno.ENOLCK}] No locks available)") in capsys.readouterr().out


def test_a_symlink_in_place_of_the_lock_file_is_not_followed(tmp_path):
    """The lock file is opened without following a link: a link planted there would make
    the run truncate and write its target."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "ck").mkdir()
    os.symlink(target, tmp_path / "ck" / LOCK_NAME)
    with pytest.raises(SystemExit, match=rf"cannot create {tmp_path}/ck/{LOCK_NAME}"):
        lock_save_dir(str(tmp_path / "ck"), RANK0)
    assert target.read_text() == "keep me"



def _backdate(path, seconds):
    """Set the modification time of `path` and everything under it `seconds` back."""
    when = time.time() - seconds
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.utime(os.path.join(top, name), (when, when))
    os.utime(path, (when, when))


def test_a_held_lock_removes_only_unfinished_saves_nobody_touched_lately(tmp_path):
    """A lock that the file system keeps per node (NFS mounted `nolock` or
    `local_lock=flock`, Lustre's `localflock`) is taken by a second job on another node
    too: holding it does not prove that no other run writes --save. A .tmp that anything
    under it was written to lately may be a live save of such a run (removing it would
    fail that save, or let it publish a checkpoint with files missing); it stays, with a
    warning saying why, and a start once it has been idle long enough removes it."""
    live = tmp_path / "iter_0000003.tmp"
    (live / "mp_rank_00").mkdir(parents=True)
    _backdate(live, 7200)
    (live / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")  # written just now
    report = unfinished_saves_report(str(tmp_path), locked=True, idle_s=600)
    assert live.is_dir(), "a save written to seconds ago is not removed"
    assert report.startswith(f"WARNING: --save {tmp_path} holds iter_0000003.tmp, written to "
                             "0 s ago: the unfinished save of another run, or one still being "
                             "written by a run on another node")
    assert "removed after 600 s without a write" in report
    _backdate(live, 601)
    report = unfinished_saves_report(str(tmp_path), locked=True, idle_s=600)
    assert not live.exists() and report.startswith(f"removed iter_0000003.tmp from --save "
                                                   f"{tmp_path}")
