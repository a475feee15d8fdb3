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


TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--vocab-size", "64", "--tokenizer-type", "NullTokenizer"]
BROKEN_TRITON = ("WARNING: Triton is installed but fails to import (RuntimeError: libcuda "
                 "mismatch); running without its kernels")


@pytest.fixture(scope="module")
def broken_triton(tmp_path_factory):
    """(the environment of a Triton install whose import raises RuntimeError, a directory
    holding a checkpoint pretrain_gpt.py saved there, that run's process result)."""
    import os

    root = tmp_path_factory.mktemp("broken_triton")
    broken = root / "site" / "triton"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("libcuda mismatch")\n')
    from tests.dist_utils import cpu_env

    # cpu_env: CUDA hidden, so a GPU machine runs this CPU check on the CPU too
    env = cpu_env({k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRITON_INTERPRET")})
    env.update(PYTHONPATH=f"{root / 'site'}{os.pathsep}{env['PYTHONPATH']}")
    argv = TINY + ["--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                   "--mock-data", "--log-interval", "1", "--eval-iters", "0",
                   "--save", str(root / "ckpt"), "--save-interval", "1"]
    out = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv],
                         capture_output=True, text=True, timeout=120, cwd=root, env=env)
    return env, root, out


def test_a_broken_triton_install_does_not_end_a_cpu_run(broken_triton):
    """Triton's kernels are optional, but an install failing with other than ImportError
    (a driver or version mismatch) ended every run at the optimizer's `import triton`,
    CPU runs included. Now the run warns once and keeps torch's kernels."""
    _, _, out = broken_triton
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(BROKEN_TRITON) == 1, out.stderr[-3000:]
    assert "iteration        1/       1" in out.stdout, out.stdout[-2000:]


@pytest.mark.parametrize("tool", ["generate", "server", "zeroshot"])
def test_a_broken_triton_install_does_not_end_the_other_entry_points(broken_triton, tool):
    """tools/generate.py, the text generation server and tasks/main.py load the same model
    modules as pretrain_gpt.py: they ended at `import triton` too (a RuntimeError
    traceback). Each now warns once and runs on torch's kernels (the server up to its
    load of a --load without a checkpoint: it would serve forever)."""
    env, root, trained = broken_triton
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = str(root / "ckpt")
    (root / "wiki.tokens").write_text("1 2 3 4 5 6 7 8 9 10 11 12\n")
    argv, status, done = {
        "generate": (["tools/generate.py", "--load", ckpt, "--prompt-ids", "1,2,3",
                      "--greedy", "--max-new-tokens", "2", "--json"], 0, '"generated_ids"'),
        "server": (["tools/run_text_generation_server.py", "--load", str(root / "none")], 1,
                   "error: no checkpoint under --load"),
        "zeroshot": (["tasks/main.py", "--task", "WIKITEXT103", "--valid-data",
                      str(root / "wiki.tokens"), "--load", ckpt, "--no-load-optim",
                      "--no-load-rng", *TINY], 0, "validation results on WIKITEXT103"),
    }[tool]
    out = subprocess.run([sys.executable, str(REPO / argv[0]), *argv[1:]], capture_output=True,
                         text=True, timeout=120, cwd=root, env=env)
    both = out.stdout + out.stderr
    assert out.returncode == status and done in both, both[-3000:]
    assert out.stderr.count(BROKEN_TRITON) == 1 and "Traceback" not in both, both[-3000:]


@pytest.mark.parametrize("tool", ["checkpoint_util", "checkpoint_convert", "benchmark",
                                  "tune_gemms", "beam_search"])
def test_a_broken_triton_install_does_not_end_the_cpu_tools(broken_triton, tool):
    """The checkpoint converters, tools/benchmark.py and tools/tune_gemms.py (--record-only
    runs on the CPU) load the optimizer or model modules too: they ended at `import triton`
    with a RuntimeError traceback. Each now warns once and runs on torch's kernels; the
    beam-search library module imports (the server that loads it gives the warning)."""
    env, root, trained = broken_triton
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt, out_dir = str(root / "ckpt"), str(root / f"out_{tool}")
    tiny = ["--preset", "tiny", "--device", "cpu"]
    argv, done = {
        "checkpoint_util": (["tools/checkpoint_util.py", "--model-type", "GPT", "--load-dir",
                             ckpt, "--save-dir", out_dir], out_dir),
        "checkpoint_convert": (["tools/checkpoint_convert.py", "reshard", "--load", ckpt,
                                "--save", out_dir, "--target-tensor-parallel-size", "1"], out_dir),
        "benchmark": (["tools/benchmark.py", *tiny, "--steps", "1", "--warmup", "0"],
                      "tokens_per_s"),
        "tune_gemms": (["tools/tune_gemms.py", "--record-only", *tiny], "| product |"),
        "beam_search": (["-c", "import tools.beam_search; print('imported')"], "imported"),
    }[tool]
    script = [str(REPO / argv[0])] if argv[0].endswith(".py") else [argv[0]]
    out = subprocess.run([sys.executable, *script, *argv[1:]], capture_output=True, text=True,
                         timeout=120, cwd=REPO if tool == "beam_search" else root, env=env)
    both = out.stdout + out.stderr
    assert out.returncode == 0 and done in both, both[-3000:]
    warned = 0 if tool == "beam_search" else 1
    assert out.stderr.count(BROKEN_TRITON) == warned and "Traceback" not in both, both[-3000:]


HIDDEN_PROBE = """
import sys
sys.path.insert(0, {repo!r})
from megatron.core import fused_activation, triton_jit
from megatron.initialize import announce_broken_triton
from torch.utils._triton import has_triton_package

print("HIDDEN", fused_activation.triton is None, sys.modules["triton"] is None,
      has_triton_package(), triton_jit.broken_triton_warning() is not None)
announce_broken_triton(1)
announce_broken_triton(0)
announce_broken_triton(0)
"""


def test_a_broken_triton_install_is_hidden_by_the_first_kernel_module(broken_triton):
    """The first megatron.core module to import Triton hides a broken install: torch's own
    lazy `import triton` (torch.compile's) then finds it absent instead of raising, and
    the warning is kept for the entry point, which prints it on rank 0 once a process."""
    env, root, _ = broken_triton
    out = subprocess.run([sys.executable, "-c", HIDDEN_PROBE.format(repo=str(REPO))],
                         capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HIDDEN True True False True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert out.stderr.count(BROKEN_TRITON) == 1, out.stderr[-3000:]
