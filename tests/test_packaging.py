"""requirements.txt, the README's install line and the Dockerfile agree: the torch floor
(what megatron/checkpoint_files.py needs to read Megatron-LM's checkpoints), a base image
that ships such a torch, no required apex / Transformer Engine, and no run outputs copied
into the image."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# NVIDIA's PyTorch container release -> the torch it ships (its release notes): 24.05 had
# 2.4.0a0, 25.01 a 2.6.0a0 pre-release, 25.02 on 2.7.0a0 builds and later.
FIRST_NGC_WITH_TORCH_2_6 = (25, 2)


def _requirement_lines(name: str):
    lines = (ROOT / name).read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def _torch_floor() -> tuple:
    (spec,) = [ln for ln in _requirement_lines("requirements.txt") if ln.startswith("torch")]
    found = re.fullmatch(r"torch>=(\d+)\.(\d+)", spec)
    assert found, spec
    return int(found.group(1)), int(found.group(2))


def test_torch_floor_reads_megatron_lm_checkpoints_and_the_readme_says_it():
    """The Megatron-LM checkpoint reader needs torch.serialization.safe_globals with
    (object, name) pairs: torch 2.6 (requirements.txt said 2.4)."""
    assert _torch_floor() >= (2, 6)
    major, minor = _torch_floor()
    assert f"a CUDA build of torch >= {major}.{minor}" in (ROOT / "README.md").read_text()


def test_no_apex_or_transformer_engine_required():
    names = [re.split(r"[<>=!;\[ ]", ln)[0].lower().replace("_", "-")
             for f in ("requirements.txt", "requirements-dev.txt") for ln in _requirement_lines(f)]
    assert not {"apex", "transformer-engine"} & set(names), names


def test_dockerfile_base_image_ships_the_torch_floor():
    text = (ROOT / "Dockerfile").read_text()
    found = re.search(r"^FROM nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3$", text, re.M)
    assert found, "the base image is NVIDIA's PyTorch container"
    assert (int(found.group(1)), int(found.group(2))) >= FIRST_NGC_WITH_TORCH_2_6
    # the image's torch is kept: requirements.txt is installed without its torch line
    assert "grep -v '^torch' requirements.txt" in text


def test_readme_docker_section_matches_the_dockerfile():
    """The README's `docker run` lines mount runs/ under the image's WORKDIR (checkpoints
    written elsewhere are lost with the container) and name its base image and entry point."""
    docker = (ROOT / "Dockerfile").read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    workdir = re.search(r"^WORKDIR (\S+)$", docker, re.M).group(1)
    base = re.search(r"^FROM (\S+)$", docker, re.M).group(1)
    entry = " ".join(json.loads(re.search(r"^ENTRYPOINT (.+)$", docker, re.M).group(1)))
    assert f'-v "$PWD/runs:{workdir}/runs" megatron-gpt' in readme
    assert f"`{workdir}`" in readme and f"(`{base}`:" in readme
    assert f"`{entry}`" in readme


def test_dockerignore_keeps_run_outputs_and_git_out_of_the_image():
    """`COPY . .` after scripts/quickstart.sh copied its runs/ (checkpoints, corpus) and
    .git into the image."""
    ignored = set(_requirement_lines(".dockerignore"))
    assert {".git", "runs/", "checkpoints/"} <= ignored


def test_pip_install_builds_a_wheel_of_megatron_with_its_data_and_requirements(tmp_path):
    """`pip install .` (as in a Megatron-LM checkout) failed in setuptools' discovery:
    'Multiple top-level packages discovered in a flat-layout: ['configs', 'megatron']'.
    The wheel holds megatron (its namespace sub-packages and GEMM tables included) and
    pretrain_gpt (`pretrain_gpt.main(argv)`), not the repository's other folders, and
    requires what requirements.txt lists."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "runs", "checkpoints", "build", "*.egg-info", "__pycache__", ".*_cache"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = {ln.split(":", 1)[1].strip() for ln in zf.read(metadata).decode().splitlines()
                    if ln.startswith("Requires-Dist:")}
    assert {"pretrain_gpt.py", "megatron/__init__.py", "megatron/core/models/gpt/gpt_model.py",
            "megatron/gemm_tables/h200-gpt2-124m.json"} <= names
    assert {n.split("/")[0] for n in names if not n.endswith(".py") or "/" in n} == {
        "megatron", metadata.split("/")[0]}, sorted(names)[:20]
    assert requires == set(_requirement_lines("requirements.txt"))
