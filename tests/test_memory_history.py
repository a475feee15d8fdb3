"""--record-memory-history (megatron/memory_history.py): the flags' checks, and the wiring
through a real training run on the CPU with torch's two allocator-history functions
replaced by recorders (the CPU has no CUDA allocator): recording starts before the model
is built and stops at the end; the last rank writes the snapshot every --log-interval
iterations (atomically: no temporary file left); a rank that runs out of memory writes
its own snapshot and the out-of-memory report names it."""
from __future__ import annotations

import errno
import os

import pytest
import torch

import megatron.training as training
from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.memory_history import VIEWER, MemoryHistory, oom_snapshot_path
from tests.test_oom_report import TORCH_MESSAGE, _main, _oom_in_forward_at
from tests.test_train_loop import MOCK

FLAGS = MOCK + ["--train-iters", "2"]


def test_flags_need_cuda_and_each_other(caplog):
    with pytest.raises(ArgumentsError, match="--record-memory-history records the CUDA "
                                             "caching allocator's history, and CUDA is not "
                                             "available here; drop the flag"):
        parse_and_validate(FLAGS + ["--record-memory-history"], world_size=1, env={},
                           cuda_available=False)
    cfg = parse_and_validate(FLAGS + ["--record-memory-history", "--memory-snapshot-path",
                                     "/x/m.pickle"], world_size=1, env={},
                             cuda_available=True)
    history = MemoryHistory.from_config(cfg, rank=0, world_size=1)
    assert history.path == "/x/m.pickle" and history.writes_intervals
    assert not MemoryHistory.from_config(cfg, rank=0, world_size=2).writes_intervals
    cfg = parse_and_validate(FLAGS + ["--memory-snapshot-path", "m.pickle"], world_size=1,
                             env={}, cuda_available=False)
    assert "--memory-snapshot-path m.pickle has no effect without --record-memory-history" \
        in caplog.text
    assert MemoryHistory.from_config(cfg, 0, 1).path is None


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    """torch's history functions replaced: `events` lists ("record", enabled) and
    ("dump", path) in order, and ("model", None) when a GPTModel is built; every rank's
    history writes under tmp_path/snap.pickle."""
    events = []

    def record(enabled="all", **kwargs):
        events.append(("record", enabled))

    def dump(path):
        events.append(("dump", path))
        with open(path, "w") as f:
            f.write(f"snapshot {sum(e[0] == 'dump' for e in events)}")

    init = GPTModel.__init__

    def counting_init(self, *args, **kwargs):
        events.append(("model", None))
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monkeypatch.setattr(GPTModel, "__init__", counting_init)
    path = str(tmp_path / "snap.pickle")
    monkeypatch.setattr(training.MemoryHistory, "from_config", classmethod(
        lambda cls, config, rank, world_size: cls(path, rank, world_size,
                                                  config.logging.log_interval)))
    return events, path


def test_training_writes_the_snapshot_every_log_interval(recorder, tmp_path, capsys):
    events, path = recorder
    assert _main(["--train-iters", "6", "--log-interval", "2", "--eval-iters", "0"]) == 0
    out = capsys.readouterr().out
    assert events[0] == ("record", "all") and events[1] == ("model", None)
    assert events[-1] == ("record", None)  # stopped at the end
    dumps = [e[1] for e in events if e[0] == "dump"]
    assert len(dumps) == 3 and all(d.startswith(path + ".") and d.endswith(".tmp") for d in dumps)
    assert os.listdir(tmp_path) == ["snap.pickle"]  # renamed into place, nothing left over
    assert open(path).read() == "snapshot 3"
    assert out.count(f" > memory snapshot of rank 0 written to {path} (replaced every 2 "
                     f"iterations; open it at {VIEWER})") == 1


def test_out_of_memory_writes_the_ranks_snapshot_and_names_it(recorder, tmp_path, capsys):
    events, path = recorder
    restore = _oom_in_forward_at(3)
    try:
        rc = _main(["--train-iters", "6", "--log-interval", "5", "--eval-iters", "0"])
    finally:
        restore()
    err = capsys.readouterr().err
    oom_path = oom_snapshot_path(path, 0)
    assert rc == 1 and oom_path == str(tmp_path / "snap_oom_rank0.pickle")
    assert f"torch: {TORCH_MESSAGE}" in err
    assert (f"memory snapshot (--record-memory-history): {oom_path} (open it at "
            f"{VIEWER})") in err
    assert os.listdir(tmp_path) == ["snap_oom_rank0.pickle"]  # no interval reached
    assert events[-1] == ("record", None)


def test_the_temporary_file_is_never_one_already_there(monkeypatch, tmp_path):
    """The snapshot went through `<path>.tmp<pid>`, a name anyone could predict: a link
    placed there beforehand (another user of a shared directory) had the snapshot written
    onto the file it points to. The temporary file is now created exclusively under a
    random name, and the link's target is left alone."""
    def dump(path):
        with open(path, "w") as f:
            f.write("snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "snap.pickle"
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    assert MemoryHistory(str(path), 0, 1, 10).write(str(path)) == str(path)
    assert victim.read_text() == "precious"
    assert not os.path.islink(path) and path.read_text() == "snapshot"
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, victim.name,
                                                   f"{path.name}.tmp{os.getpid()}"])


def test_a_failed_snapshot_does_not_hide_the_out_of_memory_report(monkeypatch, tmp_path):
    def failing_dump(path):
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", failing_dump)
    history = MemoryHistory(str(tmp_path / "s.pickle"), 1, 2, 10)
    history.recording = True
    text = history.write_oom()
    assert text == (f"not written to {tmp_path / 's_oom_rank1.pickle'}: "
                    "RuntimeError('disk full')")
    assert os.listdir(tmp_path) == []
    assert oom_snapshot_path("snapshot", 3) == "snapshot_oom_rank3.pickle"


def test_a_full_disk_ends_the_interval_snapshots_not_the_run(recorder, tmp_path, capsys,
                                                              monkeypatch):
    """A periodic snapshot that could not be written (no space, quota) ended the training
    run with an OSError traceback; it warns once and the run goes on."""
    events, path = recorder

    def full(path):
        events.append(("dump", path))
        with open(path, "wb"):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", full)
    assert _main(["--train-iters", "6", "--log-interval", "2", "--eval-iters", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"warning: cannot write the memory snapshot to --memory-snapshot-path "
                     f"{path} (No space left on device): these snapshots stopped here, "
                     "training continues; free space there (or raise your quota), or pass "
                     "another --memory-snapshot-path") == 1
    assert sum(e[0] == "dump" for e in events) == 1  # not tried again at every interval
    assert "iteration        6/       6" in out
    assert os.listdir(tmp_path) == []  # its temporary file removed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_holds_the_recorded_allocation(tmp_path):
    import pickle

    history = MemoryHistory(str(tmp_path / "s.pickle"), 0, 1, 1)
    history.start()
    try:
        x = torch.empty(1 << 20, device="cuda")
        history.after_iteration(1)
    finally:
        history.stop()
    with open(tmp_path / "s.pickle", "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][x.device.index]
    assert any(e["action"] == "alloc" and e["size"] == 4 << 20 for e in trace)
