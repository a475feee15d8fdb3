"""configs/*.yaml presets pass --dry-run (with the GPT-3 paper's shapes) and the launch
scripts in scripts/ are valid bash whose pretrain_gpt.py command line the CLI accepts."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron.arguments import count_parameters, parse_and_validate, run_dry_run
from megatron.memory_estimate import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CLI_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]

# name: (layers, hidden, heads, nominal parameters, global batch, lr); GPT-3 paper table 2.1
# (1.3B: 16 heads of 128, 13B: width 5120 -- see the comments in the files).
GPT3 = {
    "gpt3-125m": (12, 768, 12, 125e6, 256, 6.0e-4),
    "gpt3-350m": (24, 1024, 16, 350e6, 256, 3.0e-4),
    "gpt3-760m": (24, 1536, 16, 760e6, 256, 2.5e-4),
    "gpt3-1.3b": (24, 2048, 16, 1.3e9, 512, 2.0e-4),
    "gpt3-2.7b": (32, 2560, 32, 2.7e9, 512, 1.6e-4),
    "gpt3-6.7b": (32, 4096, 32, 6.7e9, 1024, 1.2e-4),
    "gpt3-13b": (40, 5120, 40, 13e9, 1024, 1.0e-4),
    "gpt3-175b": (96, 12288, 96, 175e9, 1536, 0.6e-4),
}


def _load(path, world_size=8, cuda=False, extra=()):
    return parse_and_validate(["--config", str(path), "--dry-run", *CLI_DATA, *extra],
                              world_size=world_size, env={}, cuda_available=cuda)


def test_every_preset_is_there():
    names = {p.stem for p in CONFIGS}
    assert set(GPT3) | {"llama-1b", "llama-7b"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_preset_passes_dry_run(path, capsys):
    cfg = _load(path)
    assert run_dry_run(cfg, 8) == 0
    out = capsys.readouterr().out
    assert "all input files found" in out and "memory per GPU" in out
    text = path.read_text()
    assert "Layout for 8 x 80 GB GPUs" in text or "Does NOT fit on 8 x 80 GB GPUs" in text


@pytest.mark.parametrize("name", sorted(GPT3))
def test_gpt3_shapes_match_the_paper(name):
    layers, hidden, heads, nominal, gbs, lr = GPT3[name]
    cfg = _load(ROOT / "configs" / f"{name}.yaml")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (layers, hidden, heads)
    assert cfg.data.seq_length == 2048 and cfg.data.global_batch_size == gbs
    assert cfg.optimizer.lr == pytest.approx(lr) and cfg.optimizer.min_lr == pytest.approx(lr / 10)
    assert abs(count_parameters(m).total / nominal - 1) < 0.05


def test_llama_presets():
    small = _load(ROOT / "configs" / "llama-1b.yaml").model
    assert (small.normalization, small.activation, small.position_embedding_type) == \
        ("RMSNorm", "swiglu", "rope")
    # Llama 3.2 1B ties its output layer to the embeddings (tie_word_embeddings), rope 5e5
    assert small.num_query_groups == 8 and not small.untie_embeddings_and_output_weights
    assert small.rotary_base == 500000 and small.layernorm_epsilon == 1e-5
    assert not small.add_bias_linear and small.ffn_hidden_size == 8192
    big = _load(ROOT / "configs" / "llama-7b.yaml")
    assert big.model.num_query_groups == big.model.num_attention_heads == 32
    assert big.model.ffn_hidden_size == 11008 and big.data.seq_length == 4096
    assert big.parallel.tp_size == 4 and big.parallel.sequence_parallel


@pytest.mark.parametrize("path", [p for p in CONFIGS if "Layout for 8 x 80 GB" in p.read_text()],
                         ids=lambda p: p.stem)
def test_stated_layouts_fit_80gb(path):
    """The memory estimate (as on a GPU: compiled layers) agrees with each file's claim:
    under 72 GiB, and the header's "about N GiB per GPU" within 1 GiB of it."""
    est = estimate_memory(_load(path, cuda=True))
    assert est["total"] < 72 * 2**30
    stated = re.search(r"about (\d+) GiB per GPU", " ".join(path.read_text().split()))
    assert stated, f"{path.name}: the header states no 'about N GiB per GPU'"
    assert abs(int(stated.group(1)) - est["total"] / 2**30) <= 1.0, (stated.group(0), est)


def test_175b_fits_its_stated_128_gpus():
    cfg = _load(ROOT / "configs" / "gpt3-175b.yaml", world_size=128, cuda=True)
    assert (cfg.parallel.tp_size, cfg.parallel.pp_size) == (8, 16)
    est = estimate_memory(cfg)["total"] / 2**30
    assert est < 72
    text = " ".join(path_175b().read_text().split())
    assert f"Per GPU about {round(est)} GiB on stage 0" in text
    small = estimate_memory(_load(path_175b(), cuda=True))["total"] / 2**30  # WORLD_SIZE=8
    assert f"estimates about {round(small)} GiB per GPU" in text


def path_175b():
    return ROOT / "configs" / "gpt3-175b.yaml"


def test_readme_and_175b_comment_tell_how_8_gpus_fare(capsys):
    """README names the preset that does not fit on 8 GPUs; the 175B file's claim about
    WORLD_SIZE=8 holds as it says: with --gpu-memory-gb 80 (no GPU here) --dry-run warns."""
    no_fit = [p.name for p in CONFIGS if "Does NOT fit on 8 x 80 GB GPUs" in p.read_text()]
    assert no_fit == ["gpt3-175b.yaml"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "suggested layout for 8 x 80 GB GPUs, except gpt3-175b.yaml: it does not fit" in readme
    path = ROOT / "configs" / "gpt3-175b.yaml"
    assert "--gpu-memory-gb 80" in path.read_text()
    run_dry_run(_load(path), 8)
    assert "exceeds" not in capsys.readouterr().out  # no GPU, no --gpu-memory-gb: no verdict
    run_dry_run(_load(path, extra=["--gpu-memory-gb", "80"]), 8)
    assert "per GPU exceeds 80.0 GiB (--gpu-memory-gb)" in capsys.readouterr().out


# -------------------------------------------------------------------------- scripts

SCRIPTS = ["pretrain_gpt.sh", "pretrain_gpt_distributed.sh", "pretrain_gpt_distributed_with_mp.sh"]
SHIM = """#!/usr/bin/env bash
printf '%s\\n' "$(basename "$0")" "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-}" \
    "$@" > "$SHIM_OUT"
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def _launch_argv(script: str, tmp_path: Path, env_extra: dict, flags=()):
    """Run the script (with `flags` after its name) with `python` and `torchrun` replaced
    by a recorder; return (launcher, CUDA_DEVICE_MAX_CONNECTIONS, argv)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("python", "torchrun"):
        (bindir / name).write_text(SHIM)
        (bindir / name).chmod(0o755)
    out = tmp_path / "argv.txt"
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SHIM_OUT=str(out), **env_extra)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--dry-run", *flags], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    return lines[0], lines[1], lines[2:]


def _world_size(launcher: str, argv) -> int:
    if launcher == "python":
        return 1
    value = lambda flag: int(argv[argv.index(flag) + 1])
    return value("--nproc-per-node") * value("--nnodes")


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_command_line_is_accepted(script, tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(50257)}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")  # validation checks it exists
    paths = {"DATA_PATH": str(tmp_path / "corpus_text_document"), "VOCAB_FILE": str(vocab),
             "MERGE_FILE": str(tmp_path / "merges.txt"), "CHECKPOINT_PATH": str(tmp_path / "ck")}
    launcher, connections, argv = _launch_argv(script, tmp_path, paths)
    assert launcher == ("python" if script == "pretrain_gpt.sh" else "torchrun")
    assert connections == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    entry = argv.index("pretrain_gpt.py")
    assert (ROOT / argv[entry]).is_file()
    world = _world_size(launcher, argv[:entry])
    cfg = parse_and_validate(argv[entry + 1:], world_size=world, env={}, cuda_available=False)
    assert cfg.args["dry_run"] and cfg.args["data_path"] == [paths["DATA_PATH"]]
    assert cfg.checkpoint.save == cfg.checkpoint.load == paths["CHECKPOINT_PATH"]
    if script.endswith("_mp.sh"):
        assert (world, cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.dp_size) == (8, 2, 2, 2)
        assert cfg.parallel.sequence_parallel
    elif launcher == "torchrun":
        assert (world, cfg.parallel.dp_size) == (8, 8)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_takes_a_blend_in_data_path(script, tmp_path):
    """DATA_PATH="0.3 a 0.7 b" reaches --data-path as four words, as Megatron-LM's example
    scripts pass their unquoted $DATA_PATH (it was one argument, a prefix that is no file)."""
    blend = f"0.3 {tmp_path}/a_text_document 0.7 {tmp_path}/b_text_document"
    _, _, argv = _launch_argv(script, tmp_path, {"DATA_PATH": blend})
    start = argv.index("--data-path") + 1
    assert argv[start:start + 5] == blend.split() + ["--vocab-file"]


@pytest.mark.parametrize("flags", [CLI_DATA, ["--train-data-path", "t_text_document"]],
                         ids=["mock-data", "train-data-path"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_data_flags_after_the_script_replace_its_data_path(script, flags, tmp_path):
    """`bash scripts/pretrain_gpt.sh --mock-data ...` (to try a script without data) was
    refused: '--mock-data and --data-path/--train-data-path are exclusive', the
    --data-path being the script's own. Data flags after the script name replace it."""
    launcher, _, argv = _launch_argv(script, tmp_path, {}, flags)
    entry = argv.index("pretrain_gpt.py")
    assert "--data-path" not in argv
    cfg = parse_and_validate(argv[entry + 1:], world_size=_world_size(launcher, argv[:entry]),
                             env={}, cuda_available=False)
    assert cfg.args["mock_data"] == ("--mock-data" in flags)


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_quickstart_says_it_deletes_the_previous_run(tmp_path, dry_run):
    """A rerun of scripts/quickstart.sh replaces checkpoints/ and tensorboard/ under OUT_DIR:
    it says so for each (python and torchrun are stand-ins; the data is already built). A
    `--dry-run` (passed on to pretrain_gpt.py) deletes nothing and prints no closing lines
    about checkpoints it did not write (it deleted the previous run's, then `cat` failed)."""
    bindir, out_dir = tmp_path / "bin", tmp_path / "out"
    bindir.mkdir()
    (bindir / "python").write_text('#!/usr/bin/env bash\n[ "$1" = "-c" ] && echo 0\nexit 0\n')
    (bindir / "python").chmod(0o755)
    for sub in ("data", "checkpoints", "tensorboard"):
        (out_dir / sub).mkdir(parents=True)
    (out_dir / "data" / "stdlib_text_document.idx").touch()
    (out_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("300")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", OUT_DIR=str(out_dir))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")]
                          + (["--dry-run"] if dry_run else []), env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if dry_run:
        assert "deleting" not in proc.stdout and "checkpoints:" not in proc.stdout
        assert (out_dir / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
        assert (out_dir / "tensorboard").exists()
        return
    for sub in ("checkpoints", "tensorboard"):
        assert f"note: deleting the previous run's {out_dir / sub} " in proc.stdout
        assert not (out_dir / sub).exists()
    assert (out_dir / "data" / "stdlib_text_document.idx").exists()


@pytest.mark.parametrize("train_iters, warmup", [(None, 20), ("10", 1), ("4", 0)])
def test_quickstart_short_run_shortens_the_warmup(tmp_path, train_iters, warmup):
    """TRAIN_ITERS below 200 takes a tenth as warmup: a fixed 20 made TRAIN_ITERS=10 fail
    validation (warmup longer than the decay) after deleting the previous run."""
    bindir, out_dir, argv = tmp_path / "bin", tmp_path / "out", tmp_path / "argv"
    bindir.mkdir()
    (bindir / "python").write_text(f'#!/usr/bin/env bash\n[ "$1" = "-c" ] && echo 0 && exit 0\n'
                                   f'echo "$@" >> {argv}\nexit 0\n')
    (bindir / "python").chmod(0o755)
    (out_dir / "data").mkdir(parents=True)
    (out_dir / "data" / "stdlib_text_document.idx").touch()
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", OUT_DIR=str(out_dir))
    if train_iters is not None:
        env["TRAIN_ITERS"] = train_iters
    subprocess.run(["bash", str(ROOT / "scripts" / "quickstart.sh")], env=env,
                   capture_output=True, text=True)
    (launch,) = [line for line in argv.read_text().splitlines() if "pretrain_gpt.py" in line]
    assert f" --lr-warmup-iters {warmup} " in launch
    assert f" --train-iters {train_iters or 300} " in launch
