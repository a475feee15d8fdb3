"""Out-of-memory errors end the run with a report that says what to do (megatron/oom_report).

The error is injected: the model's forward (or a function the phase under test calls)
raises torch.OutOfMemoryError. In one process through pretrain_gpt.main, and through
torchrun with two gloo ranks (data-parallel) where only rank 1 runs out: this module is
then the script torchrun starts (see the bottom).
"""
from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import megatron.training as training
from megatron import oom_report, trainer_checkpoint
from megatron.arguments import parse_and_validate
from megatron.checkpointing import read_tracker
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.initialize import initialize_distributed, set_random_seed
from megatron.oom_report import EXIT_CODE, OomReport, OutOfMemoryExit
from tests import forked_script
from tests.dist_utils import cpu_env, free_port
from tests.test_train_loop import MOCK

ROOT = Path(__file__).resolve().parents[1]
TORCH_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                 "of 79.10 GiB of which 1.20 GiB is free.")


def _oom_in_forward_at(iteration: int, rank: int = 0):
    """Patch the model's forward to raise torch's OOM error during training iteration
    `iteration` on global rank `rank` (and on no other); returns the restore function."""
    armed = {"on": False}
    forward, step = GPTModel.forward, training.train_step

    def failing_forward(self, *args, **kwargs):
        if armed["on"]:
            raise torch.OutOfMemoryError(TORCH_MESSAGE)
        return forward(self, *args, **kwargs)

    def arming_step(tr, data, **kwargs):
        armed["on"] = tr.state.iteration + 1 == iteration and tr.rt.ps.rank == rank
        return step(tr, data, **kwargs)

    GPTModel.forward, training.train_step = failing_forward, arming_step

    def restore():
        GPTModel.forward, training.train_step = forward, step
    return restore


def _suggested_flags(report: str) -> list:
    """The first word (a flag, or `PYTORCH_CUDA_ALLOC_CONF=...`) of each suggestion."""
    block = report.split("what may help here", 1)[1].split("traceback (most recent", 1)[0]
    return [line.split()[0] for line in block.splitlines()[1:] if line.strip()]


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """The injected errors and the report's host-memory lines are those of a CPU run: on a
    machine with a GPU, the in-process runs are kept on the CPU (gloo) as on CI."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _main(argv) -> int:
    import pretrain_gpt

    return pretrain_gpt.main(MOCK + list(argv))


# --------------------------------------------------------------------------- in one process
def test_oom_in_forward_reports_and_exits_1_keeping_the_checkpoint(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    flags = ["--train-iters", "4", "--log-interval", "1", "--eval-iters", "0",
             "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--micro-batch-size", "1"]
    restore = _oom_in_forward_at(3)
    try:
        rc = _main(flags + ["--save", ck, "--save-interval", "2"])
    finally:
        restore()
    out, err = capsys.readouterr()
    assert rc == EXIT_CODE == 1
    assert "[rank 0] out of GPU memory in iteration 3 (forward)" in err
    assert ("rank 0 of 1: tensor-parallel rank 0 of 1, pipeline rank 0 of 1, data-parallel "
            "rank 0 of 1") in err
    assert f"torch: {TORCH_MESSAGE}" in err
    assert "host memory of this process: resident" in err  # gloo: no CUDA figures
    assert re.search(r"--dry-run's estimate for this layout .*\n +memory per GPU, estimate: "
                     r"[\d.]+ GiB = weights", err)
    # full recompute, micro-batch 1, tp = dp = 1: only a bigger layout and the dry run
    assert _suggested_flags(err) == ["--tensor-model-parallel-size", "check"]
    assert err.count("Traceback") == 0 and "executor.py" in err  # the compact one only
    assert err.rstrip().endswith("exiting with status 1")
    assert "iteration        3/" not in out
    # the failure wrote nothing: the checkpoint of iteration 2 is the latest, and resumes
    assert read_tracker(ck) == (2, False)
    assert sorted(os.listdir(ck)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert _main(flags + ["--load", ck]) == 0
    out = capsys.readouterr().out
    assert "successfully loaded checkpoint from" in out and "iteration        3/" in out


def test_oom_in_evaluation_names_it_and_suggests_recompute(capsys, monkeypatch):
    forward = GPTModel.forward

    def failing_in_eval(self, *args, **kwargs):
        if not self.training:
            raise torch.OutOfMemoryError(TORCH_MESSAGE)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPTModel, "forward", failing_in_eval)
    assert _main(["--train-iters", "6", "--eval-interval", "2", "--eval-iters", "1"]) == 1
    err = capsys.readouterr().err
    assert "[rank 0] out of GPU memory in evaluation at iteration 2\n" in err
    assert _suggested_flags(err) == ["--recompute-granularity", "--recompute-granularity",
                                     "--micro-batch-size", "--tensor-model-parallel-size",
                                     "check"]
    assert "--micro-batch-size 1 (now 2) with the same --global-batch-size 4" in err


def _raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError(TORCH_MESSAGE)


@pytest.mark.parametrize("target, phase", [
    ((training, "build_stage_models"), "building the model"),
    ((trainer_checkpoint, "load_model_state_dicts"), "loading the checkpoint"),
])
def test_oom_during_setup_names_the_phase(target, phase, tmp_path, capsys, monkeypatch):
    ck = str(tmp_path / "ck")
    if phase == "loading the checkpoint":
        assert _main(["--train-iters", "2", "--eval-iters", "0", "--save", ck,
                      "--save-interval", "1"]) == 0
    monkeypatch.setattr(*target, _raise_oom)
    cfg = parse_and_validate(MOCK + ["--train-iters", "2", "--eval-iters", "0", "--load", ck],
                             world_size=1, env={"RANK": "0"}, cuda_available=False)
    rt = initialize_distributed(cfg.parallel, 0, 1, 0)
    set_random_seed(cfg.training.seed, rt)
    capsys.readouterr()
    with pytest.raises(OutOfMemoryExit) as stop:
        training.pretrain(cfg, rt)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert f"[rank 0] out of GPU memory in {phase}\n" in err
    # no activations yet: only the layout changes apply
    assert _suggested_flags(err) == ["--tensor-model-parallel-size", "check"]


def _host_allocation_failure() -> RuntimeError:
    """The error this torch raises when the host cannot give the memory."""
    try:
        torch.empty(2**60, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("2**60 bytes were allocated")


@pytest.mark.parametrize("host", [False, True, "python"])
def test_oom_in_the_first_optimizer_step(host, capsys, monkeypatch):
    """A CUDA OOM, torch's host allocator failing, and Python's own MemoryError."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    error = (MemoryError() if host == "python" else _host_allocation_failure() if host
             else torch.OutOfMemoryError(TORCH_MESSAGE))

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(MegatronOptimizer, "_clip_and_step", fail)
    assert _main(["--train-iters", "2", "--eval-iters", "0"]) == 1
    err = capsys.readouterr().err
    what = "host" if host else "GPU"
    assert f"out of {what} memory in iteration 1 (optimizer step)\n" in err
    assert ("  python: MemoryError\n" in err) == (host == "python")
    assert re.search(r"host memory of this process: resident [\d.]+ GiB, peak resident "
                     r"[\d.]+ GiB, host total [\d.]+ GiB", err)


def test_oom_while_saving_names_it_and_publishes_nothing(tmp_path, capsys, monkeypatch):
    ck = str(tmp_path / "ck")
    monkeypatch.setattr(trainer_checkpoint, "save_trainer_checkpoint", _raise_oom)
    assert _main(["--train-iters", "4", "--eval-iters", "0", "--save", ck,
                  "--save-interval", "2"]) == 1
    assert "out of GPU memory in saving the checkpoint of iteration 2\n" in capsys.readouterr().err
    assert read_tracker(ck)[0] is None


# --------------------------------------------------------------------------- the parts
def _config(*flags, world_size=1):
    return parse_and_validate(MOCK + ["--train-iters", "1", *flags], world_size=world_size,
                              env={"RANK": "0"}, cuda_available=False)


def _fake_rt(device: str, world_size: int = 1):
    ps = ParallelState.build(world_size=world_size, rank=0, tp_size=1, pp_size=1)
    return types.SimpleNamespace(ps=ps, device=torch.device(device))


def test_the_report_survives_failing_memory_queries(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA driver shutting down")

    for name in ("mem_get_info", "memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, broken)
    monkeypatch.setattr(oom_report, "host_memory", broken)
    monkeypatch.setattr(oom_report, "format_memory_report", broken)
    cfg = _config()
    for kind, device in (("device", "cuda:0"), ("host", "cpu")):
        exc = torch.OutOfMemoryError(TORCH_MESSAGE)
        text = oom_report.format_report(cfg, _fake_rt(device).ps, torch.device(device), exc,
                                        kind, "iteration 7 (backward)")
        assert "memory figures unavailable (RuntimeError: CUDA driver shutting down)" in text
        assert "no estimate for this layout (RuntimeError: CUDA driver shutting down)" in text
        assert "memory in iteration 7 (backward)\n" in text
        assert _suggested_flags(text)[-1] == "check"


def test_cuda_figures_and_the_fragmentation_hint(monkeypatch):
    figures = {"allocated": 6 * 2**30, "reserved": 10 * 2**30, "peak": 9 * 2**30,
               "total": 80 * 2**30, "free": 2**29}
    monkeypatch.setattr(oom_report, "device_memory", lambda device: dict(figures))
    cfg, exc = _config(), torch.OutOfMemoryError(TORCH_MESSAGE)
    text = oom_report.format_report(cfg, _fake_rt("cuda:0").ps, torch.device("cuda:0"), exc,
                                    "device", "iteration 1 (forward)")
    assert ("cuda:0: allocated 6.00 GiB, reserved 10.00 GiB, peak allocated 9.00 GiB, "
            "total 80.00 GiB (free 0.50 GiB)") in text
    assert "--dry-run's estimate for this layout (this GPU: 80.00 GiB):" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the launch environment: " \
           "4.00 GiB of the 10.00 GiB reserved is cached but unallocated" in text
    figures["allocated"] = int(9.5 * 2**30)  # 0.5 GiB cached: not worth a hint
    text = oom_report.format_report(cfg, _fake_rt("cuda:0").ps, torch.device("cuda:0"), exc,
                                    "device", "iteration 1 (forward)")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in text


def test_suggestions_follow_the_configuration():
    dp2 = _config("--micro-batch-size", "1", world_size=2)
    flags = [s.split(":")[0] for s in oom_report.suggestions(dp2)]
    assert "--use-distributed-optimizer" in flags
    assert "--micro-batch-size" not in " ".join(flags)
    both = _config("--use-distributed-optimizer", "--recompute-activations", world_size=2)
    flags = [s.split(":")[0] for s in oom_report.suggestions(both)]
    assert flags[0].startswith("--recompute-granularity full")  # selective is on already
    assert "--use-distributed-optimizer" not in flags
    tp2 = _config("--tensor-model-parallel-size", "2", world_size=2)
    text = "\n".join(oom_report.suggestions(tp2))
    assert "--sequence-parallel: split" in text
    assert "--tensor-model-parallel-size 4 (now 2) or --pipeline-model-parallel-size 2" in text
    sp = _config("--tensor-model-parallel-size", "4", "--sequence-parallel", world_size=4)
    text = "\n".join(oom_report.suggestions(sp))  # 4 heads: tp 8 impossible
    assert "--sequence-parallel" not in text and "--tensor-model-parallel-size" not in text


def test_host_allocation_failures_are_recognised_and_others_pass():
    assert oom_report.out_of_memory_kind(_host_allocation_failure()) == "host"  # torch's words
    assert oom_report.out_of_memory_kind(torch.OutOfMemoryError("x")) == "device"
    assert oom_report.out_of_memory_kind(torch.cuda.OutOfMemoryError("x")) == "device"
    assert oom_report.out_of_memory_kind(RuntimeError("CUDA error: out of memory")) == "device"
    assert oom_report.out_of_memory_kind(MemoryError()) == "host"  # Python's own
    assert oom_report.out_of_memory_kind(RuntimeError("shape mismatch")) is None
    with pytest.raises(ValueError):
        with OomReport(_config(), _fake_rt("cpu")):
            raise ValueError("not memory")


# --------------------------------------------------------------------------- two gloo ranks
@pytest.mark.slow
def test_torchrun_dp2_one_rank_out_of_memory_ends_the_job():
    flags = MOCK + ["--train-iters", "20", "--log-interval", "1", "--eval-iters", "0",
                    "--micro-batch-size", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(__file__).resolve()), "--oom-rank", "1", "--oom-iteration", "2", *flags]
    proc = forked_script.run(cmd, cwd=ROOT, env=cpu_env(), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "[rank 1] out of GPU memory in iteration 2 (forward)" in out, out[-3000:]
    assert "rank 1 of 2: tensor-parallel rank 0 of 1, pipeline rank 0 of 1, data-parallel " \
           "rank 1 of 2" in out
    report = out[out.index("[rank 1] out of GPU memory"):]
    assert "--use-distributed-optimizer: shard the optimizer state" in report
    assert "[rank 0] out of" not in out  # rank 0 waited in the all-reduce until ended
    assert re.search(r"exitcode\s*:\s*1\b", out), out[-3000:]  # torchrun names rank 1's status


if __name__ == "__main__":  # torchrun's script for the test above
    args = sys.argv[1:]
    oom_rank, oom_iteration = int(args[1]), int(args[3])
    import pretrain_gpt

    _oom_in_forward_at(oom_iteration, oom_rank)
    sys.exit(pretrain_gpt.main(args[4:]))


def test_model_load_passes_an_out_of_memory_error_through():
    """load_model_state_dicts turns a RuntimeError from load_state_dict into "the
    checkpoint's model does not fit this run's"; an out-of-memory error is not that."""
    class Chunk(torch.nn.Linear):
        def load_state_dict(self, *args, **kwargs):
            raise torch.OutOfMemoryError(TORCH_MESSAGE)

    chunk = Chunk(2, 2)
    with pytest.raises(torch.OutOfMemoryError):
        trainer_checkpoint.load_model_state_dicts(chunk, {"model": chunk.state_dict()})
    with pytest.raises(SystemExit, match="does not fit this run's"):
        trainer_checkpoint.load_model_state_dicts(torch.nn.Linear(2, 3),
                                                  {"model": chunk.state_dict()})


def test_host_report_names_the_limit_below_the_hosts_memory(tmp_path, monkeypatch):
    """A host allocation that fails under `ulimit -v` or a cgroup's limit (a container, a
    Slurm job): the report shows that limit and sets the estimate beside it, not beside the
    host's total alone, which the process could never reach."""
    gib = 2**30
    cgroup = tmp_path / "memory.max"
    cgroup.write_text("max\n")  # cgroup v2: no limit
    monkeypatch.setattr(oom_report, "CGROUP_LIMIT_FILES", (str(cgroup),))
    monkeypatch.setattr(oom_report.resource, "getrlimit",
                        lambda what: (6 * gib, oom_report.resource.RLIM_INFINITY))
    cfg, exc = _config(), _host_allocation_failure()
    text = oom_report.format_report(cfg, _fake_rt("cpu").ps, torch.device("cpu"), exc, "host",
                                    "iteration 1 (forward)")
    assert "address-space limit (ulimit -v) 6.00 GiB" in text
    assert "cgroup memory limit" not in text
    assert "--dry-run's estimate for this layout (this process's limit: 6.00 GiB):" in text
    cgroup.write_text(f"{3 * gib}\n")
    text = oom_report.format_report(cfg, _fake_rt("cpu").ps, torch.device("cpu"), exc, "host",
                                    "iteration 1 (forward)")
    assert "cgroup memory limit 3.00 GiB" in text and "(this process's limit: 3.00 GiB)" in text


def test_every_phase_in_the_tables_names_a_function_that_exists():
    """The phase comes from (file, function) pairs: one that a refactor moved or renamed
    would never match again and the report would say 'the training loop' instead."""
    import ast

    root = Path(__file__).resolve().parents[1]
    for where, name, _ in oom_report._PHASES + oom_report._STEP_PARTS:
        files = sorted((root / where).rglob("*.py")) if where.endswith("/") else [root / where]
        defined = {node.name for f in files for node in ast.walk(ast.parse(f.read_text()))
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name in defined, f"{where}: no function {name} (oom_report's phase tables)"
