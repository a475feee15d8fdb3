"""`pretrain_gpt.py --help`: every flag has a text (megatron/arguments_help.py), the
deprecated spellings name what they become, refused and ignored flags say so, and the
output fits a terminal."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.arguments import apply_deprecated, build_parser, parse_args
from megatron.arguments_common import FLAG_SPECS, flag_for_dest
from megatron.arguments_help import MEGATRON_HELP
from megatron.arguments_table import (
    ALLOWED_IN_REJECTED_GROUPS,
    DEPRECATED_HELP,
    EXTRA_GROUP,
    EXTRA_HELP,
    NO_EFFECT,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
)

ROOT = Path(__file__).resolve().parents[1]


def _helps():
    """{option string: help text} of every option of the parser."""
    return {opt: action.help for action in build_parser()._actions
            for opt in action.option_strings}


def test_every_option_has_a_help_text():
    missing = sorted(opt for opt, text in _helps().items() if not (text or "").strip())
    assert not missing, f"options without a --help text: {missing}"


def test_each_flag_has_its_text_in_one_table():
    """Megatron's flags in MEGATRON_HELP (the deprecated ones in DEPRECATED_HELP), the
    extensions in EXTRA_HELP: a new flag without a text, or a text left for a flag that is
    gone, fails here."""
    extensions = {row[0] for row in EXTRA_GROUP[1]}
    megatron = set(FLAG_SPECS) - extensions
    assert set(MEGATRON_HELP) == megatron - set(DEPRECATED_HELP)
    assert set(EXTRA_HELP) == extensions
    assert set(DEPRECATED_HELP) <= megatron


# A deprecated flag and values that exercise each of its mappings.
DEPRECATED_USES = {
    "--model-parallel-size": [["2"]],
    "--batch-size": [["4"]],
    "--warmup": [["0.1"], ["5"]],  # a fraction, and a number of iterations
    "--checkpoint-activations": [[]],
}


@pytest.mark.parametrize("flag", sorted(DEPRECATED_USES))
def test_deprecated_help_names_the_flags_it_maps_to(flag):
    """The text names every flag that `apply_deprecated` actually sets from it."""
    text = _helps()[flag]
    assert text.startswith("deprecated"), text
    for values in DEPRECATED_USES[flag]:
        ns, explicit = parse_args([flag, *values])
        origins = apply_deprecated(ns, explicit)
        targets = {flag_for_dest(dest) for dest, old in origins.items() if old == flag}
        assert targets, f"{flag} {values} mapped to nothing"
        for target in targets:
            assert target in text, f"{flag}'s help does not name {target}: {text!r}"


def test_every_deprecated_flag_is_covered():
    # --distributed-backend is accepted and ignored, not mapped: its text says so
    assert set(DEPRECATED_USES) | {"--distributed-backend"} == set(DEPRECATED_HELP)
    assert "ignored" in _helps()["--distributed-backend"]


def test_refused_and_ignored_flags_say_so():
    helps = _helps()
    for flag, spec in FLAG_SPECS.items():
        refused = flag in NOT_SUPPORTED or (spec.group in NOT_SUPPORTED_GROUPS
                                            and flag not in ALLOWED_IN_REJECTED_GROUPS)
        if refused:
            assert "refused unless left at its default" in helps[flag], flag
        if flag in NOT_SUPPORTED:
            assert NOT_SUPPORTED[flag] in helps[flag], flag
        if flag in NO_EFFECT:
            assert f"no effect here: {NO_EFFECT[flag]}" in helps[flag], flag
    text = build_parser().format_help()
    for group, reason in NOT_SUPPORTED_GROUPS.items():
        assert reason[1:] in " ".join(text.split()), group


def test_help_shows_useful_defaults():
    helps = _helps()
    assert helps["--log-interval"].endswith("(default: 100)")
    assert helps["--split"].endswith("default '969, 30, 1')")
    assert helps["--profile-ranks"].endswith("(default: 0)")
    assert not any("None" in text for text in helps.values())
    assert "(default" not in helps["--fp16"]  # a switch: nothing to show


def test_help_exits_zero_and_fits_80_columns():
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    too_wide = [line for line in lines if len(line) > 80]
    assert not too_wide, f"{len(too_wide)} lines wider than 80 columns: {too_wide[:3]}"
    assert lines[0].startswith("usage: pretrain_gpt.py") and lines[1] == ""  # one line
    assert "--tensor-model-parallel-size N" in out.stdout
    assert "MIGRATING.md" in out.stdout
