"""tools/layout_parity.py: layouts, the curve comparison, and whole runs on the CPU."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.logging_utils import format_iteration_line
from tests import forked_script
from tests.dist_utils import cpu_env
from tools import layout_parity as lp

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "255", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-3", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
        "--eval-iters", "0"]


def test_parse_layout_sizes_and_options():
    lay = lp.parse_layout("tp2pp2vp2dp2+distopt+overlap")
    assert (lay.tp, lay.pp, lay.vp, lay.dp, lay.ranks) == (2, 2, 2, 2, 8)
    assert lay.options == ("distopt", "overlap")
    assert lp.parse_layout("dp4").ranks == 4


@pytest.mark.parametrize("text, message", [
    ("tp2x", "write sizes as tpN"), ("tp2tp4", "tp given twice"), ("tp0", "at least 1"),
    ("tp2+fast", "unknown option"), ("vp2", "needs pp >= 2")])
def test_parse_layout_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        lp.parse_layout(text)


def test_layout_flags():
    model = ["--num-layers", "8"]
    flags = lp.layout_flags(lp.parse_layout("tp2pp2vp2+distopt"), model)
    assert flags[:4] == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert "--sequence-parallel" in flags and "--use-distributed-optimizer" in flags
    i = flags.index("--num-layers-per-virtual-pipeline-stage")
    assert flags[i + 1] == "2"  # 8 layers / (2 stages * 2 virtual stages)
    assert "--sequence-parallel" not in lp.layout_flags(lp.parse_layout("tp2+nosp"), model)
    assert "--no-compile" in lp.layout_flags(lp.parse_layout("tp1+eager"), model)
    with pytest.raises(ValueError, match="multiple of pp\\*vp = 6"):
        lp.layout_flags(lp.parse_layout("pp3vp2"), model)


def test_every_layout_pads_the_vocabulary_alike():
    layouts = [lp.parse_layout(t) for t in ("tp1", "tp2", "tp4pp2", "tp3")]
    assert lp.vocab_multiple(layouts, []) == 128 * 12
    assert lp.vocab_multiple(layouts[:2], ["--make-vocab-size-divisible-by", "64"]) == 128
    for lay in layouts:  # Megatron pads to (flag x tp): the same multiple for every layout
        flags = lp.layout_flags(lay, ["--num-layers", "8"], 128 * 12)
        i = flags.index("--make-vocab-size-divisible-by")
        assert int(flags[i + 1]) * lay.tp == 128 * 12


def test_a_layout_padded_otherwise_fails():
    curve = {2: (7.0, 1.0)}
    ref = {"layout": lp.parse_layout("tp1"), "curve": curve, "error": None, "seconds": 1.0,
           "padded_vocab": 4224}
    row = dict(ref, layout=lp.parse_layout("tp2"), padded_vocab=4352)
    line, ok = lp.row_line(row, ref, [2], (0.01, 0.05))
    assert not ok and "FAIL: padded vocabulary 4352 against 4224 in the reference" in line
    line, ok = lp.row_line(dict(row, padded_vocab=4224), ref, [2], (0.01, 0.05))
    assert ok and line.endswith("  ok")


def test_rank_env_one_gpu_gives_each_rank_its_own_nccl_host():
    envs = [lp.rank_env(r, 4, 1234, True, "run") for r in range(4)]
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    plain = lp.rank_env(3, 4, 1234, False, "run")
    assert plain["LOCAL_RANK"] == "3" and plain["LOCAL_WORLD_SIZE"] == "4"
    assert plain.get("NCCL_HOSTID") == os.environ.get("NCCL_HOSTID")  # left as it was


def _log(points):
    """pretrain_gpt.py's iteration lines for {iteration: (loss, grad norm)}."""
    return "\n".join(format_iteration_line(i, 60, 8 * i, 10.0, 1e-3, 8, {"lm loss": loss}, 1.0,
                                           grad_norm=g) for i, (loss, g) in points.items())


def test_curves_parse_the_training_log_line():
    points = {2: (8.364573, 1.318), 3: (8.291478, 2.5)}
    assert lp.curves(_log(points)) == points
    no_norm = format_iteration_line(4, 60, 32, 10.0, 1e-3, 8, {"lm loss": 7.5}, 1.0)
    assert lp.curves(no_norm) == {4: (7.5, None)}


def _ref(n=40):
    return {i: (8.0 - 0.02 * i, 1.0 + 0.5 * (i % 3)) for i in range(2, 2 + n)}


def test_compare_passes_swings_that_cancel_and_fails_a_scale_error():
    ref, its, tol = _ref(), list(range(2, 42)), (0.01, 0.05)
    # rounding in a spiky stretch: single iterations swing 20% both ways, means agree
    swing = {i: (l, g * (1.2 if i % 2 else 0.8)) for i, (l, g) in ref.items()}
    m = lp.compare(ref, swing, its)
    assert m["gnorm_max_rel"] > 0.19 and m["gnorm_window_rel"] < 0.05
    assert lp.verdict(m, tol) == "ok"
    # a gradient 15% too large in every iteration (a wrong scale) fails
    scaled = {i: (l, g * 1.15) for i, (l, g) in ref.items()}
    assert lp.verdict(lp.compare(ref, scaled, its), tol) == "FAIL: grad norm beyond 0.05"
    shifted = {i: (l * 1.02, g) for i, (l, g) in ref.items()}
    assert lp.verdict(lp.compare(ref, shifted, its), tol) == "FAIL: loss beyond 0.01"
    cut = {i: v for i, v in ref.items() if i < 30}
    assert lp.verdict(lp.compare(ref, cut, its), tol).startswith("FAIL: no log line for iterations [30")


def test_skipped_iterations_compare_by_their_skip():
    skipped_line = format_iteration_line(5, 60, 40, 10.0, 1e-3, 8, {}, 2.0**17, skipped_iters=1)
    ref = lp.curves(_log({4: (7.0, 1.5)}) + "\n" + skipped_line)
    assert ref == {4: (7.0, 1.5), 5: (None, None)}
    both = lp.compare(ref, dict(ref), [4, 5])
    assert lp.verdict(both, (0.01, 0.05)) == "ok" and both["stepped"] == 1
    one = lp.compare(ref, {4: (7.0, 1.5), 5: (6.9, 1.4)}, [4, 5])
    assert lp.verdict(one, (0.01, 0.05)).startswith("FAIL: skipped in one run only: iterations [5]")
    none = lp.compare({5: (None, None)}, {5: (None, None)}, [5])
    assert lp.verdict(none, (0.01, 0.05)).startswith("FAIL: no iteration updated the weights")


def test_a_table_line_for_runs_whose_last_iteration_was_skipped():
    """--fp16 with the dynamic loss scale skips the first iterations (scale 2**32): a short
    run ends on a skipped step, whose loss is None; the table prints it, no TypeError."""
    skipped = {2: (None, None), 3: (None, None)}
    ref = {"layout": lp.parse_layout("tp1"), "curve": skipped, "error": None, "seconds": 1.0,
           "padded_vocab": 512}
    line, ok = lp.row_line(ref, ref, [2, 3], (0.01, 0.05))
    assert ok and "nan" in line and line.endswith("reference")
    row = dict(ref, layout=lp.parse_layout("tp2"), curve=dict(skipped))
    line, ok = lp.row_line(row, ref, [2, 3], (0.01, 0.05))
    assert not ok and "no iteration updated the weights" in line


def test_compare_forgives_one_printed_grad_norm_unit():
    ref = {2: (5.0, 0.010), 3: (5.0, 0.010)}
    got = {2: (5.0, 0.011), 3: (5.0, 0.011)}  # 10% apart, but one unit of the printed 0.010
    m = lp.compare(ref, got, [2, 3])
    assert m["gnorm_max_rel"] == 0.0 and m["gnorm_window_rel"] == 0.0


def test_describe_exit_names_a_timeout():
    assert lp.describe_exit(124, 3) == "timed out after 3 s (--timeout)"
    assert lp.describe_exit(2, 3) == "exit 2"


def test_dropout_left_on_is_warned_about():
    """Own model flags without dropout 0 (Megatron's default is 0.1) make every layout fail
    for the dropout masks alone: the tool says so and names the flags to add."""
    assert lp.dropout_warning(lp.DEFAULT_MODEL) is None and lp.dropout_warning(TINY) is None
    bare = TINY[:TINY.index("--hidden-dropout")] + TINY[TINY.index("--attention-dropout") + 2:]
    warning = lp.dropout_warning(bare)
    assert warning is not None
    assert "--hidden-dropout 0.1 (the default), --attention-dropout 0.1 (the default)" in warning
    assert "add --hidden-dropout 0 --attention-dropout 0" in warning
    assert "--hidden-dropout 0.05" in lp.dropout_warning(bare + ["--hidden-dropout", "0.05",
                                                                 "--attention-dropout", "0.0"])


def test_the_cpu_default_model_is_cheap_and_takes_every_layout():
    """Without CUDA the README's 50-iteration command must end well inside --timeout on 2
    cores: a small fraction of the GPU model's FLOPs per iteration, with the same layers,
    heads and batch (tp8, pp4vp2, dp8 all still possible)."""
    from megatron.arguments import parse_and_validate
    from megatron.logging_utils import model_flops_per_token

    gpu, cpu = lp.default_model(True), lp.default_model(False)
    assert "--bf16" in gpu and "--bf16" not in cpu

    def flops(model, layout="tp1"):
        argv = model + lp.layout_flags(lp.parse_layout(layout), model) + ["--train-iters", "2"]
        lay = lp.parse_layout(layout)
        cfg = parse_and_validate(argv, world_size=lay.ranks, env={}, cuda_available=False)
        assert (cfg.parallel.tp_size, cfg.parallel.pp_size) == (lay.tp, lay.pp)
        return model_flops_per_token(cfg.model, cfg.data.seq_length) * (
            cfg.data.global_batch_size * cfg.data.seq_length)

    assert flops(cpu) < flops(gpu) / 10
    for layout in ("tp8", "pp4vp2", "dp8", "tp2pp2vp2dp2"):
        flops(cpu, layout)
    for flag in ("--num-layers", "--num-attention-heads", "--global-batch-size"):
        assert lp.flag_value(cpu, flag) == lp.flag_value(gpu, flag)


def test_default_tolerances_by_precision():
    assert lp.default_tolerance(["--bf16"]) == (0.01, 0.05)
    assert lp.default_tolerance([]) == (1e-4, 0.01)



def _alive(procs):
    return [p.pid for p in procs if p.poll() is None]


def test_wait_all_stops_its_ranks_when_interrupted():
    """An exception while the tool waits (Ctrl-C, or SIGTERM turned into SystemExit) stops
    the ranks it started instead of leaving them running without it."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
             for _ in range(2)]
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            lp._wait_all(procs, time.time() + 60)
        assert _alive(procs) == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        for p in procs:
            p.kill()
            p.wait()


def _processes_naming(text: str):
    """pids of the processes whose command line holds `text` (Linux /proc)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find the ranks")
def test_sigterm_stops_the_ranks_too(tmp_path):
    """`timeout N python tools/layout_parity.py ...` (benchmarks/layout_parity_one_gpu.sh)
    ends the tool with SIGTERM: its ranks end with it, not left holding the GPU."""
    out = tmp_path / "out"
    tool = subprocess.Popen([sys.executable, str(ROOT / "tools" / "layout_parity.py"),
                             "--layouts", "tp1", "--iters", "1", "--out-dir", str(out),
                             "--"] + TINY, env=cpu_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (out / "seed" / "rank0.log").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert _processes_naming(str(out)), "the seed run's rank did not start"
        tool.send_signal(signal.SIGTERM)
        assert tool.wait(timeout=30) != 0
        time.sleep(0.5)
        deadline = time.monotonic() + 15  # the ranks end just after the tool on a busy CPU
        while _processes_naming(str(out)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_naming(str(out)) == []
    finally:
        tool.kill()
        for pid in _processes_naming(str(out)):
            os.kill(pid, signal.SIGKILL)

@pytest.mark.slow
def test_layouts_match_one_process_on_cpu_and_a_bad_layout_fails(tmp_path, monkeypatch, capsys):
    """The tool's main() in this process, its ranks forked from it where it has no CUDA (a
    forked child cannot use its parent's CUDA context): tests/forked_script.ForkedPopen
    runs pretrain_gpt.py as `__main__` in a process of its own with the environment,
    output file and directory the tool gives it, less the interpreter's start and the
    imports (some 3 s of CPU a rank; 11 ranks here). test_sigterm_stops_the_ranks_too
    starts the tool and its rank as fresh processes."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(lp, "subprocess", SimpleNamespace(
            Popen=forked_script.ForkedPopen, STDOUT=subprocess.STDOUT,
            TimeoutExpired=subprocess.TimeoutExpired))
    for name, value in cpu_env({}).items():  # the environment the tool passes on to its ranks
        monkeypatch.setenv(name, value)
    status = lp.main(["--layouts", "tp1,tp2,pp2vp2,dp2+distopt+overlap,tp3", "--iters", "3",
                      "--one-gpu", "--out-dir", str(tmp_path), "--"] + TINY)
    out, err = capsys.readouterr()
    assert status == 1, out + err[-3000:]  # tp3 cannot split 4 heads
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert rows["tp1"].endswith("reference")
    for name in ("tp2", "pp2vp2", "dp2+distopt+overlap"):
        assert rows[name].endswith("  ok"), out
        loss_max = float(rows[name].split()[2])
        assert loss_max <= 1e-4  # fp32 on the CPU: the same curve up to summation order
    assert "FAIL: exit 2" in rows["tp3"]
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in err
    assert (tmp_path / "01-tp2" / "rank1.log").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_nccl_ranks_match_one_process(tmp_path):
    """Two NCCL ranks on GPU 0 (each its own NCCL_HOSTID) train like one process, bf16."""
    cmd = [sys.executable, str(ROOT / "tools" / "layout_parity.py"), "--layouts",
           "tp1,tp2,dp2+distopt", "--iters", "5", "--one-gpu", "--out-dir", str(tmp_path),
           "--"] + TINY + ["--bf16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:-1]}
    assert rows["tp2"].endswith("  ok") and rows["dp2+distopt"].endswith("  ok")
    assert re.search(r"distributed_backend \.+ nccl", (tmp_path / "01-tp2" / "rank0.log").read_text())
