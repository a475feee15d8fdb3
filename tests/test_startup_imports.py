"""What a user waits for before a quick answer: `pretrain_gpt.py --help`, a mistyped flag
and a bad value are answered from the argument parser alone, before torch (over a second
of CPU time to import) is imported; the training path still gets torch's dtypes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Runs pretrain_gpt.main(argv) in a fresh interpreter and prints which heavy modules
# were imported by the time it returned or exited.
PROBE = """
import sys
sys.path.insert(0, {repo!r})
import pretrain_gpt
try:
    code = pretrain_gpt.main({argv!r})
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "triton"))
print("EXIT", code, "HEAVY", " ".join(heavy[:5]))
"""


def _probe(argv, env_extra=None):
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS")}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO), argv=argv)],
                         capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("EXIT")]
    assert line, out.stdout + out.stderr
    _, code, _, *heavy = line[-1].split()
    return code, heavy, out.stderr


@pytest.mark.parametrize("argv, code, message", [
    (["--help"], "0", ""),
    (["--num-layer", "2"], "2", "did you mean --num-layers?"),
    (["--num-layers", "two"], "2", "two"),
])
def test_help_and_argument_errors_do_not_import_torch(argv, code, message):
    got, heavy, stderr = _probe(argv)
    assert got == code, stderr
    assert message in stderr
    assert heavy == [], f"{argv} imported {heavy} before answering"


def test_srun_tasks_error_does_not_import_torch():
    got, heavy, stderr = _probe(["--num-layers", "2"], {"SLURM_STEP_NUM_TASKS": "4",
                                                        "SLURM_PROCID": "0"})
    assert got != "0" and "SLURM_STEP_NUM_TASKS=4" in stderr + got
    assert heavy == []


def test_model_config_default_dtype_is_still_float32():
    from megatron.core.config import ModelConfig

    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                      padded_vocab_size=16, seq_length=4, max_position_embeddings=4)
    assert cfg.params_dtype is torch.float32
    half = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                       padded_vocab_size=16, seq_length=4, max_position_embeddings=4,
                       params_dtype=torch.bfloat16)
    assert half.params_dtype is torch.bfloat16


def test_megatron_initialize_still_exports_the_srun_check():
    from megatron.initialize import srun_tasks_without_launcher
    from megatron.srun_tasks import srun_tasks_without_launcher as moved

    assert srun_tasks_without_launcher is moved


def test_a_broken_triton_install_does_not_end_a_cpu_run(tmp_path):
    """Triton's kernels are optional, but an install failing with other than ImportError
    (a driver or version mismatch) ended every run at the optimizer's `import triton`,
    CPU runs included. Now the run warns once and keeps torch's kernels."""
    import os

    broken = tmp_path / "site" / "triton"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("libcuda mismatch")\n')
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1")
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
            "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
            "--log-interval", "1", "--eval-iters", "0"]
    out = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("WARNING: Triton is installed but fails to import (RuntimeError: libcuda "
            "mismatch); running without its kernels") in out.stderr
    assert "iteration        1/       1" in out.stdout, out.stdout[-2000:]
