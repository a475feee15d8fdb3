"""End to end through torchrun: train with TP=2 x DP=2 on 4 gloo processes, read the
tensorboard events back, stop at a checkpoint, resume, and get the same losses as an
uninterrupted run (bit-identical printed values: fp32 on CPU is deterministic)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked_script
from tests.dist_utils import cpu_env, free_port

ROOT = Path(__file__).resolve().parents[1]

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1",
    "--use-cpu-initialization", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
]


def torchrun(nproc: int, args: list, env_extra=None) -> str:
    """Train under torchrun; its launcher is forked from this process (tests/forked_script.py:
    its imports come free), its ranks are fresh processes. Returns the output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_gpt.py"), *args]
    proc = forked_script.run(cmd, cpu_env(**(env_extra or {})), timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def rewind_to(ckpt: Path, iteration: int) -> None:
    """Point a checkpoint directory's tracker back at an earlier saved iteration: resuming
    from it is then what resuming after a stop there would be (the later iterations'
    directories are overwritten by the resumed run). Costs one launch less than a run
    stopped with --exit-interval (which tests/test_pipeline_parallel.py keeps)."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() != str(iteration)
    tracker.write_text(str(iteration))


def losses_by_iteration(log: str) -> dict:
    found = re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)
    return {int(i): v for i, v in found}


@pytest.mark.slow
def test_torchrun_tp2_dp2_train_tensorboard_save_resume(tmp_path):
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    ckpt = tmp_path / "ckpt"
    full = torchrun(4, layout + MODEL + ["--train-iters", "8", "--save", str(ckpt),
                                         "--save-interval", "4",
                                         "--tensorboard-dir", str(tmp_path / "tb")])
    ref = losses_by_iteration(full)
    assert sorted(ref) == list(range(1, 9)), full[-3000:]
    assert "validation loss at iteration 4" in full

    from megatron.logging_utils import read_scalars
    scalars = read_scalars(str(tmp_path / "tb"))
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 9))
    assert "learning-rate" in scalars and "lm loss vs samples" in scalars
    assert "lm loss validation" in scalars

    assert (ckpt / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt").exists()
    rewind_to(ckpt, 4)  # as if the run had stopped after saving at iteration 4
    resumed = torchrun(4, layout + MODEL + ["--train-iters", "8", "--load", str(ckpt),
                                            "--save", str(ckpt), "--save-interval", "4"])
    assert losses_by_iteration(resumed) == {i: ref[i] for i in range(5, 9)}, resumed[-3000:]


@pytest.mark.slow
def test_preprocess_then_train_on_real_text(tmp_path):
    """Corpus -> SentencePiece -> preprocess_data -> torchrun training with --data-path,
    validation perplexity printed, loss falling."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_corpus.py"), "--output",
                    str(data / "corpus.jsonl"), "--max-mb", "0.6", "--tokenizer-prefix",
                    str(data / "spm"), "--vocab-size", "512"], check=True, cwd=ROOT)
    proc = forked_script.run(  # forked: its imports (torch, megatron) come free
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
         str(data / "corpus.jsonl"), "--output-prefix", str(data / "py"),
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
         str(data / "spm.model"), "--append-eod", "--workers", "1"],
        dict(os.environ), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    flags = [a for a in MODEL if a not in ("--mock-data",)]
    i = flags.index("--tokenizer-type")
    del flags[i:i + 4]  # NullTokenizer and its --vocab-size
    out = torchrun(2, ["--tensor-model-parallel-size", "2"] + flags + [
        "--train-iters", "12", "--data-path", str(data / "py_text_document"), "--split", "90,10,0",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(data / "spm.model"),
        "--data-cache-path", str(data / "cache"), "--num-workers", "1", "--lr", "5e-3"])
    losses = losses_by_iteration(out)
    assert sorted(losses) == list(range(1, 13))
    assert float(losses[12]) < float(losses[1]) - 0.5, losses
    assert re.search(r"validation loss at iteration 12 on \d+-sample draw from validation set "
                     r"\| lm loss value: [0-9.E+-]+ \| lm loss PPL: [0-9.E+-]+", out), out[-2000:]
