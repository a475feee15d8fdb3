"""A seeded sample of flag combinations run through the argument layer as `pretrain_gpt.py
--dry-run` runs it (parse_and_validate, then the dry-run report). Each outcome must be a
success or a clean argument error (exit status 2, a message naming a flag); any other
exception is a defect. --rampup-batch-size with a learning-rate warmup once died here with a
TypeError (the ramp's values are strings on the namespace): no test combined the two.

A wider sweep (every pair of ~115 common flags and 10,000 random triples/quadruples, world
sizes 1-8) found nothing else; this sample keeps the same oracle in the suite."""
from __future__ import annotations

import contextlib
import io
import random

from megatron.arguments import ArgumentsError, parse_and_validate, run_dry_run
from tests.args_helpers import BASE

# (flag, values); None: a switch. "{data}"/"{tmp}" are filled in with the test's paths.
OPTIONS = [
    ("--num-layers", ["2", "8"]), ("--num-attention-heads", ["8", "2"]),
    ("--tensor-model-parallel-size", ["2", "4"]), ("--pipeline-model-parallel-size", ["2"]),
    ("--sequence-parallel", [None]), ("--num-layers-per-virtual-pipeline-stage", ["1"]),
    ("--micro-batch-size", ["1", "4"]), ("--global-batch-size", ["8", "16"]),
    ("--rampup-batch-size", ["4 4 64 --train-samples 640", "2 2 20 --train-samples 100"]), ("--train-samples", ["640", "100"]),
    ("--lr-decay-samples", ["500"]), ("--lr-decay-iters", ["8"]),
    ("--lr-warmup-iters", ["2", "20"]), ("--lr-warmup-samples", ["16", "320"]),
    ("--lr-warmup-fraction", ["0.01", "0.5"]),
    ("--lr-decay-style", ["cosine", "inverse-square-root"]), ("--min-lr", ["1e-5"]),
    ("--weight-decay-incr-style", ["cosine"]), ("--fp16", [None]), ("--bf16", [None]),
    ("--loss-scale", ["1024"]), ("--initial-loss-scale", ["65536"]),
    ("--recompute-granularity", ["full", "selective"]), ("--recompute-method", ["block"]),
    ("--recompute-num-layers", ["1"]), ("--use-distributed-optimizer", [None]),
    ("--data-path", ["{data}", "0.3 {data} 0.7 {data}"]), ("--split", ["949,50,1", "98,2"]),
    ("--train-data-path", ["{data}"]), ("--save", ["{tmp}/ckpt"]),
    ("--load", ["{tmp}/none"]), ("--save-interval", ["5"]), ("--exit-interval", ["3"]),
    ("--exit-signal-handler", [None]), ("--tensorboard-dir", ["{tmp}/tb"]),
    ("--eval-interval", ["5"]), ("--eval-iters", ["0", "2"]), ("--skip-train", [None]),
    ("--use-checkpoint-args", [None]), ("--finetune", [None]),
    ("--dataloader-type", ["cyclic"]), ("--num-experts", ["2"]),
    ("--use-rotary-position-embeddings", [None]), ("--swiglu", [None]),
    ("--normalization", ["RMSNorm"]), ("--config", ["configs/gpt3-125m.yaml"]),
    ("--checkpoint-activations", [None]), ("--warmup", ["0.01"]),
]
REPLACES = {"--train-samples": ["--train-iters"], "--rampup-batch-size": ["--train-iters"], "--data-path": ["--mock-data"],
            "--train-data-path": ["--mock-data"],
            "--config": ["--num-layers", "--hidden-size", "--num-attention-heads",
                         "--seq-length", "--max-position-embeddings"]}
SAMPLES, SEED = 80, 2305


def command(combo, data: str, tmp: str) -> list:
    """BASE without the flags the combination gives or replaces, then the combination."""
    drop = {f for f, _ in combo}
    for f, _ in combo:
        drop.update(REPLACES.get(f, []))
    argv, i = [], 0
    while i < len(BASE):
        has_value = i + 1 < len(BASE) and not BASE[i + 1].startswith("--")
        if BASE[i] not in drop:
            argv += BASE[i:i + 1 + has_value]
        i += 1 + has_value
    for flag, value in combo:
        argv += [flag] + ([] if value is None else
                          value.format(data=data, tmp=tmp).split())
    return argv


def sample():
    """(combination, world size) pairs: 2-4 flags each, seeded."""
    rng = random.Random(SEED)
    out = []
    for _ in range(SAMPLES):
        flags = rng.sample(OPTIONS, rng.choice([2, 3, 4]))
        out.append((tuple((f, rng.choice(v)) for f, v in flags), rng.choice([1, 2, 4, 8])))
    return out


def outcome(argv, world_size: int) -> str:
    """'ok', 'error' (a clean argument error), or the unexpected exception."""
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            cfg = parse_and_validate(argv, world_size=world_size, env={},
                                     cuda_available=False)
            run_dry_run(cfg, world_size, show=False)
    except ArgumentsError as e:
        return "error" if e.code == 2 and "--" in e.message else f"unclear error: {e}"
    except SystemExit as e:  # argparse's own errors: status 2 and "error:" on stderr
        clean = e.code == 2 and "error:" in sink.getvalue()
        return "error" if clean else f"SystemExit({e.code!r}): {sink.getvalue()[-300:]}"
    except Exception as e:  # noqa: BLE001 -- the defect this test looks for
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_sampled_flag_combinations_succeed_or_fail_cleanly(tmp_path):
    from tests.test_gpt_dataset import make_corpus

    data, _ = make_corpus(tmp_path / "corpus", [40] * 100, vocab=100)
    combos = sample()
    assert {f for combo, _ in combos for f, _ in combo} == {f for f, _ in OPTIONS}
    seen = {"ok": 0, "error": 0}
    crashed = {}
    for combo, world in combos:
        argv = command(combo, data, str(tmp_path))
        result = outcome(argv, world)
        if result in seen:
            seen[result] += 1
        else:
            crashed[f"WORLD_SIZE={world} " + " ".join(argv)] = result
    assert not crashed, "\n".join(f"{k}\n  -> {v}" for k, v in crashed.items())
    assert seen["ok"] >= 10 and seen["error"] >= 10, seen  # both outcomes are exercised
