"""README.md and the library READMEs name files that exist and flag choices the CLI has.

Two classes of claim a reader acts on directly: a repository path in backticks or a
command (`benchmarks/moe_dispatch.py`, `configs/gpt3-175b.yaml`, `core/timing.py` from
megatron/core/pipeline_parallel/README.md) must exist, and a `--flag a|b|c` written for a
pretrain_gpt.py flag with fixed choices must list exactly those choices. Cheap: no model,
no process group. (MIGRATING.md's flag tables: tests/test_migrating_doc.py.)
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

from megatron.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "megatron/core/tensor_parallel/README.md",
        "megatron/core/pipeline_parallel/README.md", "megatron/core/datasets/README.md"]
# a relative path with a directory and a file suffix, e.g. tools/plan_layout.py
_PATH = re.compile(r"(?<![\w/.$<-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_-]+\.(?:py|sh|yaml|md|sbatch))\b")
# a bare file name in backticks, e.g. `mappings.py` beside the library README
_FILE = re.compile(r"`([A-Za-z0-9_-]+\.py)`")
_CHOICES = re.compile(r"`(--[A-Za-z0-9-]+) ([A-Za-z0-9_.]+(?:\|[A-Za-z0-9_.]+)+)`")
# example paths of the user's own, not of this repository
_NOT_OURS = {"examples/evaluate_zeroshot_gpt.sh"}


def missing_paths(doc: str, text: str) -> List[str]:
    """Paths named in `text` (the README at `doc`) found neither from the repository root,
    nor beside the README, nor under megatron/, megatron/core/ (the library READMEs say
    `core/...`, `models/...`) or tools/ (`generate.py`)."""
    bases = [ROOT, (ROOT / doc).parent, ROOT / "megatron", ROOT / "megatron" / "core",
             ROOT / "tools"]
    named = set(_PATH.findall(text)) | set(_FILE.findall(text))
    return sorted({p for p in named
                   if p not in _NOT_OURS and not any((b / p).exists() for b in bases)})


def wrong_choices(text: str) -> List[str]:
    """`--flag a|b|c` spans whose flag is a pretrain_gpt.py flag with choices that differ."""
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    out = []
    for flag, listed in _CHOICES.findall(" ".join(text.split())):
        action = actions.get(flag)
        if action is not None and action.choices is not None:
            if listed.split("|") != [str(c) for c in action.choices]:
                out.append(f"{flag} {listed} (the CLI: {'|'.join(map(str, action.choices))})")
    return out


def test_every_path_the_readmes_name_exists():
    problems = {doc: missing_paths(doc, (ROOT / doc).read_text(encoding="utf-8"))
                for doc in DOCS}
    assert {doc: found for doc, found in problems.items() if found} == {}


def test_readme_flag_choices_match_the_cli():
    assert wrong_choices((ROOT / "README.md").read_text(encoding="utf-8")) == []


def test_checks_notice_a_drift():
    assert missing_paths("README.md", "run `tools/no_such_tool.py` or benchmarks/x_probe.py") \
        == ["benchmarks/x_probe.py", "tools/no_such_tool.py"]
    assert missing_paths("megatron/core/pipeline_parallel/README.md", "(`core/timing.py`)") == []
    assert missing_paths("megatron/core/tensor_parallel/README.md", "`layers.py`, `lay.py`") \
        == ["lay.py"]
    assert wrong_choices("`--nan-loss-policy stop|skip`, `--DDP-impl local|torch`") == [
        "--nan-loss-policy stop|skip (the CLI: stop|skip|rollback)"]


def test_readme_gives_the_removed_recompute_flags_fix_the_error_gives():
    """README's line on Megatron's zero-shot script said to drop a removed
    `--activations-checkpoint-method uniform`, while the error names its 23.05 spelling
    (the facts' modern equivalent): the README now gives the error's replacement."""
    from megatron.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError) as err:
        parse_args(["--activations-checkpoint-method", "uniform"])
    fix = str(err.value).rsplit("; use ", 1)[1]
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    said = readme[readme.index("`--activations-checkpoint-method uniform`"):][:300]
    assert fix == "--recompute-granularity full --recompute-method uniform"
    assert f"`{fix}`" in said, said
