"""`tools/checkpoint_convert.py` writing a conversion's output (reshard / to-megatron): a
--save holding a checkpoint is refused unless --overwrite; Ctrl-C, a full disk, a quota or
a read-only directory leave no partial output and give one message; two conversions into
one directory, or one into a directory a run saves into, are refused; an overwrite
interrupted mid-replace leaves a readable checkpoint."""
from __future__ import annotations

import errno
import os
import shutil

import pytest

from megatron import checkpoint_reshard as reshard
from megatron.checkpointing import MODEL_FILENAME
from megatron.trainer_checkpoint import save_trainer_checkpoint
from megatron.training import data_iterator
from tests.test_reshard import _steps, _trainer
from tests.write_faults import torch_save_over_quota
from tools import checkpoint_convert
from tools.interruptible import INTERRUPTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_holding_a_checkpoint_is_refused_unless_overwrite(tmp_path, capsys):
    """reshard / to-megatron into a --save that holds newer iterations would point its
    tracker back at the converted one: refused, nothing written; --overwrite replaces the
    same-named directory and the tracker, saying so, and keeps the other iterations."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    dst.mkdir()  # an empty directory is fine
    reshard_argv = ["reshard", "--load", str(src), "--save", str(dst),
                    "--target-tensor-model-parallel-size", "2",
                    "--target-pipeline-model-parallel-size", "1"]
    assert checkpoint_convert.main(reshard_argv) == 0
    shutil.copytree(dst / "iter_0000001", dst / "iter_0000020")  # a later run's checkpoint
    (dst / "latest_checkpointed_iteration.txt").write_text("20")
    for argv in (reshard_argv, ["to-megatron", "--load", str(src), "--save", str(dst)]):
        with pytest.raises(SystemExit, match=f"--save {dst} already holds a checkpoint: "
                           r"latest_checkpointed_iteration.txt \('20'\), iter_0000001, "
                           "iter_0000020; .* add --overwrite"):
            checkpoint_convert.main(argv)
        assert (dst / "latest_checkpointed_iteration.txt").read_text() == "20"
        assert sorted(os.listdir(dst)) == ["iter_0000001", "iter_0000020",
                                           "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    assert checkpoint_convert.main(["to-megatron", "--load", str(src), "--save", str(dst),
                                    "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"overwrite: replacing {dst / 'iter_0000001'}" in out and "said '20', now '1'" in out
    assert "writing 1 rank file to " in out  # to-megatron of the tp 1 source
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(os.listdir(dst)) == ["iter_0000001", "iter_0000020",
                                       "latest_checkpointed_iteration.txt"]
    assert reshard.read_layout(str(dst / "iter_0000001")).tp == 1  # to-megatron's copy
    with pytest.raises(SystemExit, match="is a file; pass a directory"):
        checkpoint_convert.check_save(str(dst / "latest_checkpointed_iteration.txt"))


def _interrupt_on(module, name: str, call: int, monkeypatch):
    """Make module.name raise KeyboardInterrupt (Ctrl-C) on its `call`-th call."""
    real, calls = getattr(module, name), []

    def fake(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fake)


def test_interrupted_conversion_leaves_no_partial_output(tmp_path, capsys, monkeypatch):
    """Ctrl-C during reshard / to-megatron (the 2nd rank file): the partial iter_N.tmp
    is removed, and a --save the tool created with it; one line, status 130 (it was a
    KeyboardInterrupt traceback and a partial directory of the model's size). Each finished
    rank file is reported as it is written (a large model's conversion printed nothing
    until the end)."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    argv = ["reshard", "--load", str(src), "--save", str(dst),
            "--target-tensor-model-parallel-size", "2"]
    with monkeypatch.context() as m:
        _interrupt_on(checkpoint_convert.torch, "save", 2, m)
        assert checkpoint_convert.main(argv) == INTERRUPTED
    out = capsys.readouterr()
    assert "[1/2] mp_rank_00 (" in out.out and "[2/2]" not in out.out
    assert "reshard: interrupted (Ctrl-C); the partial output was removed" in out.err
    assert not dst.exists()
    assert checkpoint_convert.main(argv) == 0
    assert "[2/2] mp_rank_01 (" in capsys.readouterr().out
    with monkeypatch.context() as m:
        _interrupt_on(checkpoint_convert.torch, "save", 2, m)
        assert checkpoint_convert.main(argv + ["--overwrite",
                                               "--target-pipeline-model-parallel-size", "2",
                                               "--target-tensor-model-parallel-size", "1"]) == 130
        _interrupt_on(checkpoint_convert, "load_checkpoint_file", 1, m)
        assert checkpoint_convert.main(["to-megatron", "--load", str(src), "--save",
                                        str(tmp_path / "mlm")]) == 130
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert reshard.read_layout(str(dst / "iter_0000001")).tp == 2, "the earlier one is kept"
    assert not (tmp_path / "mlm").exists()


def test_a_full_disk_during_a_conversion_is_one_message(tmp_path, monkeypatch):
    """reshard writing into a full disk ended in an OSError traceback (its partial output
    removed): one error line now, naming the directory and the free space, status 1."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    real, calls = checkpoint_convert.torch.save, []

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_convert.torch, "save", full)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                 "--target-tensor-model-parallel-size", "2"])
    assert str(err.value.code).startswith(
        f"error: writing {dst / 'iter_0000001.tmp'} failed (OSError: [Errno 28] No space left "
        f"on device); its partial output was removed; ")
    assert f"free on the file system of {tmp_path} (a disk quota or file-size limit may " \
           "allow less). Free space or pass another --save" in \
        str(err.value.code)
    assert not dst.exists()


def test_a_quota_during_a_conversion_is_named_not_torchs_zip_error(tmp_path, monkeypatch):
    """torch.save over quota raises RuntimeError 'unexpected pos ... vs ...' (the OSError
    in its context): the line showed that text and 'Free space' only; it names the quota
    and its fix now."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)

    monkeypatch.setattr(checkpoint_convert.torch, "save", torch_save_over_quota)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                 "--target-tensor-model-parallel-size", "2"])
    msg = str(err.value.code)
    assert msg.startswith(f"error: writing {dst / 'iter_0000001.tmp'} failed (OSError: "
                          f"[Errno 122] Disk quota exceeded: '{dst / 'iter_0000001.tmp'}"), msg
    assert "unexpected pos" not in msg
    assert msg.endswith("Free space within your disk quota (or have it raised), or pass "
                        "another --save on a file system with room in your quota")
    assert not dst.exists()


@pytest.mark.parametrize("command", ["reshard", "to-megatron"])
def test_torch_saves_own_full_disk_error_is_one_message(tmp_path, monkeypatch, command):
    """On a real full disk torch.save raises a RuntimeError ("unexpected pos ..."), not an
    OSError: reshard (checkpoint_util.py's too) and to-megatron ended in that traceback.
    Now the one error line, naming the file, with the partial output removed."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)

    def full(obj, f, *args, **kwargs):
        f.write(b"PK partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 10")

    monkeypatch.setattr(checkpoint_convert.torch, "save", full)
    extra = ["--target-tensor-model-parallel-size", "2"] if command == "reshard" else []
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main([command, "--load", str(src), "--save", str(dst), *extra])
    tmp_dir = dst / "iter_0000001.tmp"
    assert str(err.value.code).startswith(
        f"error: writing {tmp_dir} failed (OSError: could not write {tmp_dir / 'mp_rank_00'}"
        f"/{MODEL_FILENAME}: [enforce fail at inline_container.cc:672] . unexpected pos 64 "
        "vs 10); its partial output was removed; ")
    assert not dst.exists()


_FILE_SIZE_LIMIT = """
import os, resource, signal, sys, torch
from tools.checkpoint_convert import save_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
try:
    save_file({"w": torch.zeros(100_000)}, sys.argv[1])
except OSError as exc:  # the files still open while the error is handled, as the tool does
    print("failed:", exc)
    os.remove(sys.argv[1])
    for fd in os.listdir("/proc/self/fd"):
        try:
            print("open:", os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_a_failed_write_leaves_no_file_open(tmp_path):
    """A write that fails midway (a full disk; here a file-size limit) left the file open
    in torch's writer, held by the error's traceback: the partial output was removed, but
    its space stayed in use while the error line measured the free space ('0 bytes free'
    on a disk that had room again). The file is closed once the error is raised."""
    import subprocess
    import sys

    path = tmp_path / "model_optim_rng.pt"
    proc = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = f"failed: [Errno 27] File too large: '{path}'"  # the reason, not torch's text
    assert shown in proc.stdout, proc.stdout
    assert str(path) not in proc.stdout.replace(shown, ""), proc.stdout


def test_a_read_only_save_is_one_message(tmp_path, monkeypatch):
    """--save on a read-only file system (a mount of the shared checkpoint store): a new
    directory that cannot be made, or an existing one where the lock file cannot be
    written, ended reshard / checkpoint_util.py / from-hf / to-megatron in an OSError
    traceback. Now one line naming --save and the error (as a training run's check)."""
    from megatron import save_lock

    src, dst = tmp_path / "src", tmp_path / "ro" / "out"
    _one_step_checkpoint(src)
    real = os.makedirs

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    argv = ["reshard", "--load", str(src), "--save", str(dst),
            "--target-tensor-model-parallel-size", "2"]
    with monkeypatch.context() as m:
        m.setattr(os, "makedirs", read_only)
        with pytest.raises(SystemExit) as err:
            checkpoint_convert.main(argv)
    assert str(err.value.code) == (
        f"error: --save {dst} cannot be used: could not create it (OSError: [Errno 30] "
        f"Read-only file system: '{dst}'); pass a directory that can be created and written to")
    dst.mkdir(parents=True)

    def no_lock_file(self):
        raise OSError(errno.EROFS, "Read-only file system", self.path)

    monkeypatch.setattr(save_lock.SaveDirLock, "acquire", no_lock_file)
    with pytest.raises(SystemExit) as err:
        checkpoint_convert.main(argv)
    assert str(err.value.code).startswith(
        f"error: --save {dst} cannot be used: could not write its lock file (OSError: "
        "[Errno 30] Read-only file system: ")
    assert os.listdir(dst) == []


def test_ctrl_c_inside_torch_save_is_the_interrupt_not_a_full_disk(tmp_path, monkeypatch,
                                                                   capsys):
    """torch.save stopped by Ctrl-C midway raises a RuntimeError over the
    KeyboardInterrupt: a conversion reports the interrupt (status 130), not a write
    failure with free-space advice."""
    from tests.test_checkpointing_ranks import _ctrl_c_inside_torch_save

    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)
    monkeypatch.setattr(checkpoint_convert.torch, "save", _ctrl_c_inside_torch_save)
    assert checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                    "--target-tensor-model-parallel-size", "2"]) == 130
    assert "reshard: interrupted (Ctrl-C); the partial output was removed" in capsys.readouterr().err
    assert not dst.exists()


def _one_step_checkpoint(src):
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)


def test_a_conversion_into_a_directory_a_run_saves_into_is_refused(tmp_path):
    """A training run holds its --save's lock (megatron/save_lock.py) and is writing
    iter_0000001.tmp there. reshard / to-megatron / from-hf into that directory took no
    lock: the conversion emptied that iter_0000001.tmp for its own output, then moved its
    own iter_0000001 into place and pointed the tracker at it. Now each stops with one
    line naming the run that holds the directory, and leaves it as it was."""
    from megatron.save_lock import LOCK_NAME, SaveDirLock

    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)
    (dst / "iter_0000001.tmp" / "mp_rank_00").mkdir(parents=True)
    (dst / "iter_0000001.tmp" / "mp_rank_00" / "model_optim_rng.pt").write_text("the run's")
    with SaveDirLock(str(dst)) as run:
        assert run.acquire() is None
        for argv in (["reshard", "--target-tensor-model-parallel-size", "2"],
                     ["to-megatron"]):
            with pytest.raises(SystemExit) as err:
                checkpoint_convert.main(argv + ["--load", str(src), "--save", str(dst)])
            assert str(err.value.code).startswith(
                f"error: --save {dst} is in use by another training run (host "
                f"{os.uname().nodename}, process {os.getpid()}, since "), err.value.code
            assert sorted(os.listdir(dst)) == [LOCK_NAME, "iter_0000001.tmp"]
            assert (dst / "iter_0000001.tmp" / "mp_rank_00" /
                    "model_optim_rng.pt").read_text() == "the run's"
    assert checkpoint_convert.main(["to-megatron", "--load", str(src), "--save",
                                    str(dst)]) == 0, "once the run has ended"
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_two_conversions_into_one_directory(tmp_path, monkeypatch):
    """While a reshard writes into OUT, a second conversion into OUT (another process)
    and a training run saving there stop with one line naming the reshard; the reshard
    completes, and its lock is gone afterwards."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from megatron.save_lock import LOCK_NAME, lock_save_dir

    src, dst = tmp_path / "src", tmp_path / "dst"
    _one_step_checkpoint(src)
    seen = []
    done = checkpoint_convert.Progress.done

    def meanwhile(progress, name):
        if not seen:
            second = subprocess.run(
                [sys.executable, os.path.join(REPO, "tools", "checkpoint_convert.py"),
                 "to-megatron", "--load", str(src), "--save", str(dst)],
                cwd=REPO, capture_output=True, text=True, timeout=120)
            seen.append((second.returncode, second.stderr.strip().splitlines()))
            with pytest.raises(SystemExit) as err:
                lock_save_dir(str(dst), SimpleNamespace(rank=0))
            seen.append(str(err.value.code))
        done(progress, name)

    monkeypatch.setattr(checkpoint_convert.Progress, "done", meanwhile)
    assert checkpoint_convert.main(["reshard", "--load", str(src), "--save", str(dst),
                                    "--target-tensor-model-parallel-size", "2"]) == 0
    (status, lines), run = seen
    holder = (f"error: --save {dst} is in use by another run of tools/checkpoint_convert.py "
              f"reshard (host {os.uname().nodename}, process {os.getpid()}, since ")
    assert status == 1 and lines[-1].startswith(holder), lines  # after to-megatron's warnings
    assert run.startswith(holder), run
    assert sorted(os.listdir(dst)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert not os.path.exists(dst / LOCK_NAME)
    assert reshard.read_layout(str(dst / "iter_0000001")).tp == 2


def _remove_first_file_then_interrupt(monkeypatch):
    """shutil.rmtree of an `.old` directory stops (Ctrl-C) after removing one file."""
    real = shutil.rmtree

    def fake(path, *args, **kwargs):
        if str(path).endswith(".old"):
            os.remove(next(os.path.join(top, f) for top, _, files in os.walk(path)
                           for f in files))
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", fake)


def test_an_overwrite_interrupted_mid_replace_leaves_a_readable_checkpoint(tmp_path, capsys,
                                                                           monkeypatch):
    """reshard --overwrite stopped between moving iter_N aside and the new one into place
    leaves iter_N.old, the only copy, under the tracker's iteration: the tools (and
    --use-checkpoint-args) said the iteration directory did not exist while a training
    --load restored it; they read it now, saying so. A later --overwrite stopped while
    removing that .old removed it first, before the new copy was in place: nothing was
    left."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    argv = ["reshard", "--load", str(src), "--save", str(dst),
            "--target-tensor-model-parallel-size", "2"]
    assert checkpoint_convert.main(argv) == 0
    with monkeypatch.context() as m:
        _interrupt_on(os, "rename", 2, m)  # the 1st moves iter_1 aside, the 2nd the new one
        assert checkpoint_convert.main(argv + ["--overwrite"]) == INTERRUPTED
    assert sorted(os.listdir(dst)) == ["iter_0000001.old", "latest_checkpointed_iteration.txt"]
    capsys.readouterr()
    again = str(tmp_path / "again")
    assert checkpoint_convert.main(["reshard", "--load", str(dst), "--save", again,
                                    "--target-tensor-model-parallel-size", "1"]) == 0
    out = capsys.readouterr().out
    assert (f"note: {dst / 'iter_0000001'} is missing but {dst / 'iter_0000001'}.old is there "
            "(an interrupted save that was replacing it): reading that copy; `mv ") in out
    assert reshard.read_layout(os.path.join(again, "iter_0000001")).tp == 1
    from megatron.arguments_checkpoint import read_checkpoint_args

    assert read_checkpoint_args(str(dst))["tensor_model_parallel_size"] == 2
    assert sorted(os.listdir(dst)) == ["iter_0000001.old", "latest_checkpointed_iteration.txt"]
    with monkeypatch.context() as m:
        _remove_first_file_then_interrupt(m)
        assert checkpoint_convert.main(argv + ["--overwrite", "--target-pipeline-model-parallel"
                                               "-size", "2", "--target-tensor-model-parallel-"
                                               "size", "1"]) == INTERRUPTED
    layout = reshard.read_layout(reshard.locate_iteration(str(dst))[0])
    assert (layout.tp, layout.pp) == (1, 2), "the new copy is in place"


def test_the_old_copy_note_is_printed_once_per_command(tmp_path, capsys):
    """README: the tools read an `iter_N.old` left by a killed re-save where it is, with a
    note line. reshard (a target size left out), checkpoint_util.py and to-megatron looked
    the iteration up twice and printed the note twice."""
    from tools import checkpoint_util

    src = tmp_path / "src"
    cfg, rt, tr = _trainer(0, 1, "", save=str(src))
    _steps(tr, data_iterator(cfg, rt, "train", 0), 1)
    save_trainer_checkpoint(tr)
    os.rename(src / "iter_0000001", src / "iter_0000001.old")
    note = f"note: {src / 'iter_0000001'} is missing but"
    commands = [
        lambda out: checkpoint_convert.main(["reshard", "--load", str(src), "--save", out,
                                             "--target-tensor-model-parallel-size", "1"]),
        lambda out: checkpoint_convert.main(["reshard", "--load", str(src), "--save", out,
                                             "--target-pipeline-model-parallel-size", "1"]),
        lambda out: checkpoint_convert.main(["to-megatron", "--load", str(src), "--save", out]),
        lambda out: checkpoint_util.main(["--model-type", "GPT", "--load-dir", str(src),
                                          "--save-dir", out]),
    ]
    capsys.readouterr()
    for i, command in enumerate(commands):
        assert command(str(tmp_path / f"out{i}")) == 0
        captured = capsys.readouterr()
        assert (captured.out + captured.err).count(note) == 1, (i, captured.out)
