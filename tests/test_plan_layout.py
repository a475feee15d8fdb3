"""tools/plan_layout.py: every layout it lists passes the project's validation for the world
size and carries --dry-run's own memory figure; the cost model's terms are the documented
ones; what it says when nothing fits or the input is wrong."""
from __future__ import annotations

import functools
import logging
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from megatron.arguments import parse_and_validate, run_dry_run
from megatron.memory_estimate import estimate_memory
from tests import forked_script
from tools import layout_cost
from tools.layout_report import check_command, format_plan, format_table, inputs_to_remove
from tools.plan_layout import (
    Layout,
    build_parser,
    build_request,
    gpus_that_fit,
    main,
    plan_layouts,
    smallest_layouts,
    tensor_sizes,
    validate_layout,
)

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--max-position-embeddings", "128", "--global-batch-size", "64",
         "--bf16"]


def _preset(name: str, gpus: int, *extra: str) -> tuple:
    return ("--config", str(ROOT / "configs" / f"{name}.yaml"), "--gpus", str(gpus),
            "--gpu-memory-gb", "80", *extra)


@functools.lru_cache(maxsize=None)
def _plan(argv: tuple):
    req = build_request(list(argv))
    return req, plan_layouts(req, progress=None)


def _layout_of(config) -> Layout:
    p, m, d = config.parallel, config.model, config.data
    return Layout(p.tp_size, p.pp_size, p.virtual_pp_size or 1, d.micro_batch_size,
                  p.sequence_parallel, p.use_distributed_optimizer, m.recompute_granularity)


def _run(argv, capsys):
    """(exit code, stdout, stderr without the progress lines a slow machine gets)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    err = "".join(line for line in err.splitlines(keepends=True)
                  if not re.fullmatch(r"  \.\.\. \d+/\d+ layouts considered\n?", line))
    return code, out, err


# ---------------------------------------------------------------- listed layouts


@pytest.mark.parametrize("name,gpus", [("gpt3-1.3b", 16), ("gpt3-13b", 64), ("llama-1b", 8)])
def test_listed_layouts_pass_validation_with_dry_run_memory(name, gpus):
    """Each listed layout, given to pretrain_gpt.py's own parse (as on a GPU machine) with the
    world size, validates to that layout and has exactly the estimate --dry-run prints."""
    req, result = _plan(_preset(name, gpus))
    listed = result.fitting[:req.top]
    assert len(listed) == req.top
    assert any(p.layout.pp > 1 for p in listed) or name != "gpt3-13b"
    for plan in listed:
        argv = check_command(req, plan.layout)[2:]
        cfg = parse_and_validate(argv, world_size=gpus, env={}, cuda_available=True)
        assert _layout_of(cfg) == plan.layout
        assert cfg.parallel.tp_size * cfg.parallel.pp_size * cfg.parallel.dp_size == gpus
        assert estimate_memory(cfg) == plan.memory
        assert plan.memory["total"] <= 0.9 * 80 * 2**30
        assert plan.layout.tp <= 8
    times = [p.cost.total for p in result.fitting]
    assert times == sorted(times)


PRESET_GPUS = [(p.stem, 128 if p.stem == "gpt3-175b" else 8)
               for p in sorted((ROOT / "configs").glob("*.yaml"))]


@pytest.mark.parametrize("name,gpus", PRESET_GPUS)
def test_every_preset_gets_a_layout_that_passes_dry_run(name, gpus, capsys):
    """The best layout's check command, parsed as `python pretrain_gpt.py` on this machine
    parses it with WORLD_SIZE set, passes --dry-run (exit 0, no memory warning)."""
    req, result = _plan(_preset(name, gpus))
    assert result.fitting, f"{name} on {gpus} GPUs: nothing fits"
    argv = check_command(req, result.fitting[0].layout)[2:]
    cfg = parse_and_validate(argv, world_size=gpus, env={}, cuda_available=False)
    capsys.readouterr()
    assert run_dry_run(cfg, gpus) == 0
    out = capsys.readouterr().out
    assert "all input files found" in out and "exceeds" not in out


def test_script_prints_a_plan_whose_check_command_runs():
    """End to end: the printed check command (WORLD_SIZE=N python pretrain_gpt.py ...
    --dry-run) runs as printed. Both commands are forked from this process
    (tests/forked_script.py: their imports come free)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = forked_script.run([sys.executable, "tools/plan_layout.py", *_preset("gpt3-125m", 8),
                              "--top", "3"], env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rank  tp  pp  vp  dp  mbs" in out and "rel. time" in out
    assert "ESTIMATE" in out and "not a measurement" in out and "NVLINK_BW" in out
    line = out.split("check it:\n", 1)[1].splitlines()[0].strip()
    world, command = line.split(" ", 1)
    assert world == "WORLD_SIZE=8"
    argv = shlex.split(command)
    argv[0] = sys.executable
    check = forked_script.run(argv, dict(env, WORLD_SIZE="8"), timeout=600, cwd=ROOT)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "world size 8 = tensor 1 x pipeline 1 x data 8" in check.stdout


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_a_model_with_room_gets_pure_data_parallelism(gpus):
    req, result = _plan(_preset("gpt3-125m", gpus))
    best = result.fitting[0]
    assert (best.layout.tp, best.layout.pp, best.config.parallel.dp_size) == (1, 1, gpus)
    assert result.smallest.memory["total"] < 0.5 * req.limit_bytes


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--global-batch-size", "16"]


@pytest.mark.parametrize("argv,gpus", [(TINY, 4), (SMALL, 8)])
def test_a_tiny_model_gets_pure_data_parallelism(argv, gpus):
    """A model that fits on one GPU many times over trains data parallel: tensor and
    pipeline parallelism only add communication (and a bubble) to it."""
    _, result = _plan(("--gpus", str(gpus), "--gpu-memory-gb", "80", *argv))
    best = result.fitting[0]
    assert (best.layout.tp, best.layout.pp, best.config.parallel.dp_size) == (1, 1, gpus)


def test_a_model_too_big_for_one_gpu_gets_the_smallest_tp_that_fits():
    """3 layers (no pipeline of 2 or 4) too big for one 24 GiB GPU: tp 2 x dp 2, not tp 4."""
    _, result = _plan(("--gpus", "4", "--gpu-memory-gb", "24", "--num-layers", "3",
                       "--hidden-size", "8192", "--num-attention-heads", "64",
                       "--seq-length", "2048", "--max-position-embeddings", "2048",
                       "--global-batch-size", "64", "--bf16"))
    assert min(p.layout.tp for p in result.fitting) == 2
    best = result.fitting[0]
    assert (best.layout.tp, best.layout.pp, best.config.parallel.dp_size) == (2, 1, 2)


def test_175b_on_64_gpus_uses_tensor_and_pipeline_parallelism():
    req = build_request(list(_preset("gpt3-175b", 64)))
    layouts = [Layout(tp, pp, 1, 1, tp > 1, 64 // (tp * pp) > 1, rc)
               for tp in tensor_sizes(64, 8) for pp in (1, 2, 4, 8, 16, 32, 64)
               if 64 % (tp * pp) == 0 for rc in (None, "full")]
    best = plan_layouts(req, layouts=layouts, progress=None).fitting[0]
    assert best.layout.tp > 1 and best.layout.pp > 1


def test_tensor_parallel_stays_within_a_node():
    assert tensor_sizes(24, 8) == [1, 2, 4, 8]  # 3 and 6 would straddle two nodes
    assert tensor_sizes(6, 8) == [1, 2, 3, 6]  # one node: any divisor
    assert tensor_sizes(64, 4) == [1, 2, 4]
    req, result = _plan(_preset("gpt3-1.3b", 16, "--gpus-per-node", "4"))
    assert result.fitting and max(p.layout.tp for p in result.fitting) == 4
    _, wide = _plan(_preset("gpt3-1.3b", 16))
    assert max(p.layout.tp for p in wide.fitting) == 8


# ------------------------------------------------------------------- cost model


def _small_cost(layout: Layout, gpus: int, gpus_per_node: int = 8, *extra: str):
    req = build_request(["--gpus", str(gpus), "--gpu-memory-gb", "80", *SMALL, *extra])
    config = validate_layout(req.ns, req.explicit, layout, gpus)
    return config, layout_cost.step_cost(config, gpus_per_node)


def test_bubble_is_p_minus_1_over_m_v():
    # 16 GPUs = pp 4 x dp 4; global batch 64 / (micro batch 2 x dp 4) = 8 micro-batches
    config, cost = _small_cost(Layout(1, 4, 2, 2, False, False, None), 16)
    assert config.data.num_micro_batches == 8 and config.parallel.virtual_pp_size == 2
    assert cost.bubble == pytest.approx(3 / (8 * 2))
    _, plain = _small_cost(Layout(1, 4, 1, 2, False, False, None), 16)
    assert plain.bubble == pytest.approx(3 / 8)
    req = build_request(["--gpus", "16", "--gpu-memory-gb", "80", *SMALL])
    result = plan_layouts(req, layouts=[Layout(1, 4, 2, 2, False, False, None)], progress=None)
    assert format_table(result.fitting).splitlines()[1].split()[10] == "18.8"
    # the column is idle over busy time (the paper's), which a reader could take for a share
    text = " ".join(format_plan(req, result).split())
    assert "bubble %: the pipeline's idle time over its busy time, (p - 1) / (m v)" in text


def test_cost_model_moves_the_obvious_ways():
    none = _small_cost(Layout(2, 1, 1, 1, True, False, None), 8)[1]
    selective = _small_cost(Layout(2, 1, 1, 1, True, False, "selective"), 8)[1]
    full = _small_cost(Layout(2, 1, 1, 1, True, False, "full"), 8)[1]
    assert none.total < selective.total < full.total
    l, h, s = 8, 256, 128
    assert full.compute - none.compute == pytest.approx(
        24 * l * h * h * (1 + s / (6 * h)) * 64 * s / 8 / layout_cost.GPU_FLOPS)
    assert full.tp_comm == pytest.approx(none.tp_comm * 6 / 4)
    small_mb = _small_cost(Layout(1, 1, 1, 1, False, False, None), 8)[1]
    big_mb = _small_cost(Layout(1, 1, 1, 8, False, False, None), 8)[1]
    assert big_mb.total < small_mb.total
    inside = _small_cost(Layout(1, 1, 1, 1, False, False, None), 8, 8)[1]
    across = _small_cost(Layout(1, 1, 1, 1, False, False, None), 8, 4)[1]
    assert across.dp_exposed == pytest.approx(inside.dp_exposed * layout_cost.NVLINK_BW
                                              / layout_cost.NETWORK_BW)
    overlapped = _small_cost(Layout(1, 1, 1, 1, False, False, None), 8, 8,
                             "--overlap-grad-reduce")[1]
    assert overlapped.dp_exposed == pytest.approx(inside.dp_exposed * (1 - layout_cost.DP_OVERLAP))


def test_the_last_pipeline_stage_does_all_the_logits():
    """A pipeline splits the layers, not the logits layer: the busiest stage's compute."""
    flat = _small_cost(Layout(1, 1, 1, 2, False, False, None), 8)[1]
    piped = _small_cost(Layout(1, 2, 1, 2, False, False, None), 8)[1]
    h, v, tokens = 256, 50304, 64 * 128
    logits = 3 * 2 * h * v * tokens / layout_cost.GPU_FLOPS
    layers = flat.compute * 8 - logits  # dp 8: a rank's tokens are an eighth
    assert piped.compute == pytest.approx((layers / 2 + logits) / 4)
    assert piped.compute > flat.compute * 1.5  # the logits are most of this small model


def test_each_collective_and_send_costs_a_latency():
    tp2 = _small_cost(Layout(2, 1, 1, 2, True, False, None), 8)[1]
    n_mb, layers = 64 // (2 * 4), 8
    assert tp2.tp_comm > n_mb * layers * 4 * layout_cost.COMM_LATENCY_S
    pp2 = _small_cost(Layout(1, 2, 1, 2, False, False, None), 8)[1]
    assert pp2.p2p > (64 // (2 * 4)) * 2 * layout_cost.COMM_LATENCY_S


def test_help_says_the_ranking_is_an_estimate():
    text = " ".join(build_parser().format_help().split())
    assert "ESTIMATE" in text and "not a measurement" in text
    for name in layout_cost.CONSTANTS:
        assert name in text


# --------------------------------------------------------- nothing fits, bad input


def test_nothing_fits_exits_1_and_names_what_would_help(capsys):
    code, out, err = _run(_preset("gpt3-175b", 8), capsys)
    assert code == 1 and out == ""
    assert err.startswith("no layout fits: ")
    assert "already considered: micro batch down to 1, full recompute" in err
    assert "what would help:" in err and "GPUs with more memory: --gpu-memory-gb" in err
    more = int(re.search(r"more GPUs: the least-memory layouts fit with --gpus (\d+)", err)[1])
    req = build_request(list(_preset("gpt3-175b", 8)))
    assert gpus_that_fit(req) == more
    fits = lambda n: plan_layouts(req, n, smallest_layouts(n, 8), progress=None).fitting  # noqa: E731
    assert fits(more) and not fits(more // 2)


def test_too_little_memory_for_any_gpu_count(capsys):
    code, _, err = _run(_preset("gpt3-1.3b", 8)[:-1] + ("1",), capsys)
    assert code == 1 and "no layout fits" in err
    assert "not more GPUs alone: nothing fits up to --gpus 512" in err


def test_more_memory_suggested_is_enough(capsys):
    """--gpu-memory-gb 2 for gpt3-125m: the least-memory layout needs 2.1 GiB, 2.3 with the
    margin; the advice said '--gpu-memory-gb 2 or more' (rounded to nearest), the value that
    had just failed."""
    code, _, err = _run(_preset("gpt3-125m", 8)[:-1] + ("2",), capsys)
    assert code == 1 and "no layout fits" in err
    need = float(re.search(r"needs ([\d.]+) GiB per GPU", err)[1])
    more = int(re.search(r"GPUs with more memory: --gpu-memory-gb (\d+) or more", err)[1])
    assert more * 0.9 >= need and more == 3


def test_preset_save_interval_is_not_a_warning_to_the_planner(capsys, caplog):
    """README's command (gpt3-13b, 64 GPUs) began with 'WARNING: --save-interval 1000 has
    no effect without --save ...; add --save DIR': the preset's save-interval, advice for a
    training run, not for a planner that saves nothing."""
    caplog.set_level(logging.INFO, logger="megatron.arguments")
    code, out, _ = _run(_preset("gpt3-13b", 64), capsys)
    assert code == 0 and "best: " in out
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warned if "--save" in w], warned


@pytest.mark.parametrize("extra,message", [
    (["--gpus", "0"], "--gpus 0 must be >= 1"),
    ([], "--gpus N (the number of GPUs in all) is required"),
    (["--gpu", "64"], "--gpus N (the number of GPUs in all) is required; --gpu is not a flag: "
                      "did you mean --gpus?"),
    (["--gpus", "12"], "--gpus 12 is more than one node of --gpus-per-node 8 but not whole "
                       "nodes; use a multiple of 8 (e.g. 8 or 16)"),
    (["--gpus", "8", "--top", "0"], "--top 0 must be >= 1"),
    (["--gpus", "8", "--gpu-memory-gb", "0"], "--gpu-memory-gb 0.0 must be > 0"),
    # nan and inf were a ValueError / OverflowError traceback from int(gb * GiB)
    (["--gpus", "8", "--gpu-memory-gb", "nan"], "--gpu-memory-gb nan is not a finite number"),
    (["--gpus", "8", "--gpu-memory-gb", "inf"], "--gpu-memory-gb inf is not a finite number"),
    (["--gpus", "8", "--hiden-size", "3"], "did you mean --hidden-size?"),
    (["--gpus", "8", "--vocab-file", "/nonexistent/gpt2-vocab.json", "--merge-file",
      "/nonexistent/gpt2-merges.txt"],
     "--vocab-file /nonexistent/gpt2-vocab.json: file not found. The plan needs only the "
     "vocabulary size: leave the tokenizer flags out (GPT-2's 50257 tokens), or pass "
     "--tokenizer-type NullTokenizer --vocab-size N"),
])
def test_bad_planner_input(extra, message, capsys):
    argv = ["--config", str(ROOT / "configs" / "gpt3-1.3b.yaml"), "--gpu-memory-gb", "80", *extra]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("plan_layout.py: error: ") and message in err


def test_gpu_count_with_no_valid_layout_names_reasons_and_neighbours(capsys):
    code, _, err = _run(_preset("gpt3-1.3b", 7), capsys)
    assert code == 2
    assert "no layout of --gpus 7 passes the validation" in err
    assert "--num-attention-heads 16 is not divisible by --tensor-model-parallel-size 7" in err
    assert "GPU counts near it with layouts that pass: --gpus 4, --gpus 6, --gpus 8" in err


def test_global_batch_and_gpu_memory_are_needed(capsys, monkeypatch):
    model = [a for a in SMALL if a not in ("--global-batch-size", "64")]
    code, _, err = _run(["--gpus", "8", "--gpu-memory-gb", "80", *model], capsys)
    assert code == 2 and "pass --global-batch-size" in err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = _run(["--gpus", "8", *SMALL], capsys)
    assert code == 2 and "no GPU here to read the memory from: pass --gpu-memory-gb" in err
    assert main(SMALL) == 2 and "--gpus N (the number of GPUs in all) is required" in \
        capsys.readouterr().err


def test_switches_the_input_turns_on_must_be_removed():
    req = build_request(list(_preset("gpt3-13b", 8)))  # its YAML sets sequence-parallel
    assert inputs_to_remove(req.ns, req.explicit, Layout(1, 2, 1, 1, False, True, None)) == \
        ["--sequence-parallel"]
    assert inputs_to_remove(req.ns, req.explicit, Layout(4, 1, 1, 1, True, True, "full")) == []


def test_check_command_reproduces_the_table_figure_on_a_machine_without_gpu():
    """The table's figure assumes compiled layers (a GPU machine); the check command asks for
    them, so its --dry-run prints the same figure where there is no GPU (an RMSNorm model's
    eager layers keep more)."""
    req, result = _plan(_preset("llama-1b", 8))
    plan = result.fitting[0]
    cfg = parse_and_validate(check_command(req, plan.layout)[2:], world_size=8, env={},
                             cuda_available=False)
    assert cfg.model.normalization == "RMSNorm"
    assert estimate_memory(cfg) == plan.memory


def test_full_recompute_flags_fix_the_layer_count_the_plan_used():
    """The plan estimates full recompute with --recompute-num-layers 1; an input that gave
    another count kept it in the printed flags, so the check did not reproduce the table."""
    layout = Layout(tp=1, pp=2, vp=1, mbs=2, sp=False, dist_opt=False, recompute="full")
    argv = SMALL + ["--recompute-num-layers", "4", "--lr", "1e-4", "--train-iters", "1",
                    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    cfg = parse_and_validate(argv + layout.flags(8), world_size=2, env={},
                             cuda_available=True)
    assert cfg.model.recompute_num_layers == 1
    assert cfg.model.recompute_granularity == "full" and cfg.model.recompute_method == "uniform"


def test_check_command_with_data_flags_says_it_needs_the_files(capsys):
    """A training command line with --data-path plans fine anywhere, but its check command's
    --dry-run also looks for the data files (exit 1 where they are not)."""
    note = "(it also checks that the data files exist: run it where they are"
    code, out, _ = _run(_preset("gpt3-125m", 8, "--data-path", "/nonexistent/corpus"), capsys)
    assert code == 0 and note in out
    code, out, _ = _run(_preset("gpt3-125m", 8), capsys)
    assert code == 0 and note not in out


def test_the_inputs_own_layout_flags_are_named_and_left_out_of_the_check(capsys):
    """Layout flags on the planner's command line (a training command pasted whole) are the
    planner's to choose: the report names them as replaced and its check command leaves them
    out, so the check runs the plan's layout alone (the input's --sequence-parallel at the
    plan's tp 1 was kept, and the valued flags appeared twice)."""
    argv = SMALL + ["--gpus", "8", "--gpu-memory-gb", "80", "--top", "2",
                    "--tensor-model-parallel-size=2", "--sequence-parallel",
                    "--micro-batch-size", "4", "--recompute-granularity", "selective"]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    assert ("  in place of the command line's --tensor-model-parallel-size=2 "
            "--sequence-parallel --micro-batch-size 4 --recompute-granularity selective "
            "(the planner chooses the layout") in out
    assert "remove from the --config file" not in out
    check = shlex.split(out.split("check it:\n", 1)[1].splitlines()[0].split("=", 1)[1])[1:]
    req = build_request(argv)
    best = plan_layouts(req, progress=None).fitting[0]
    assert check == check_command(req, best.layout)
    tail = check[2:]
    assert "--tensor-model-parallel-size=2" not in tail and "selective" not in tail
    assert tail.count("--micro-batch-size") == 1
    assert ("--sequence-parallel" in tail) == best.layout.sp
    cfg = parse_and_validate(check[2:-1], world_size=8, env={}, cuda_available=True)
    assert _layout_of(cfg) == best.layout


def test_layout_switches_set_by_a_config_file_are_to_be_removed_there(tmp_path, capsys):
    """A switch the plan does not use that came from a --config file is named for removal
    there (the check command cannot turn a store_true flag off)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("sequence-parallel: true\n")
    code, out, _ = _run(SMALL + ["--config", str(cfg), "--gpus", "1", "--gpu-memory-gb", "80",
                                 "--top", "1"], capsys)
    assert code == 0 and "best: tp 1," in out  # one GPU: no SP
    assert "  and remove from the --config file: --sequence-parallel\n" in out
    assert "in place of the command line's" not in out
