"""MIGRATING.md's flag tables match megatron/arguments_table.py, both ways.

Each `### ...` subsection of MIGRATING.md's section 2 named in SECTIONS holds a table whose
first column names flags in backticks (several per row allowed) or a refused group as
"group: " and the group's name in backticks. The flags named there must be exactly the keys
of the matching table (DEPRECATED_HELP, REMOVED, NO_EFFECT, NOT_SUPPORTED +
NOT_SUPPORTED_GROUPS, EXTRA_GROUP), so moving a flag between lists in the code without
moving it in the doc (or the reverse) fails here. Cheap: no model, no process group.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

from megatron.arguments_common import FLAG_SPECS
from megatron.arguments_table import (
    DEPRECATED_HELP,
    EXTRA_GROUP,
    NO_EFFECT,
    NO_EFFECT_QUIET_VALUES,
    NOT_SUPPORTED,
    NOT_SUPPORTED_GROUPS,
    REMOVED,
)

DOC = Path(__file__).resolve().parents[1] / "MIGRATING.md"

# subsection heading (its start) -> the flags (and "group:<name>" entries) the code lists
SECTIONS = {
    "Deprecated": set(DEPRECATED_HELP),
    "Removed before 23.05": set(REMOVED),
    "Accepted without effect": set(NO_EFFECT),
    "Refused": set(NOT_SUPPORTED) | {f"group:{g}" for g in NOT_SUPPORTED_GROUPS},
    "Extensions": {row[0] for row in EXTRA_GROUP[1]},
}

_FLAG = re.compile(r"`(--[A-Za-z0-9_-]+)`")
_GROUP = re.compile(r"^group:\s*`([^`]+)`")


def table_entries(text: str) -> Dict[str, Set[str]]:
    """{subsection heading: flags named in the first column of its table's rows}."""
    out: Dict[str, Set[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("### "):
            current = line[4:].strip()
            out[current] = set()
        elif line.startswith("## "):
            current = None
        elif current is not None and line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1].strip()
            group = _GROUP.match(first)
            if group:
                out[current].add(f"group:{group.group(1)}")
            else:
                out[current].update(_FLAG.findall(first))
    return out


def section_mismatches(text: str) -> Dict[str, str]:
    """{section: what differs} for every section of SECTIONS whose table disagrees with
    the code's (empty when the doc is honest)."""
    found = table_entries(text)
    problems = {}
    for start, expected in SECTIONS.items():
        heads = [h for h in found if h.startswith(start)]
        if len(heads) != 1:
            problems[start] = f"expected one '### {start}...' subsection, found {heads}"
            continue
        doc = found[heads[0]]
        if doc != expected:
            problems[start] = (f"only in MIGRATING.md: {sorted(doc - expected)}; only in "
                               f"arguments_table.py: {sorted(expected - doc)}")
    return problems


def test_flag_tables_match_arguments_table():
    assert section_mismatches(DOC.read_text(encoding="utf-8")) == {}


def test_every_flag_accepted_without_effect_has_a_value_that_warns():
    """The section's heading promises one warning each: a flag whose every accepted value
    is its default or a quiet one (NO_EFFECT_QUIET_VALUES) could never give it."""
    silent = []
    for flag in NO_EFFECT:
        spec = FLAG_SPECS[flag]
        if spec.choices is not None and not set(spec.choices) - {spec.default} - set(
                NO_EFFECT_QUIET_VALUES.get(flag, ())):
            silent.append(flag)
    assert silent == []


def test_removed_rows_give_the_tables_modern_spelling():
    """Each REMOVED row of the doc names the replacement the error message gives."""
    text = DOC.read_text(encoding="utf-8")
    for flag, modern in REMOVED.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{flag}` |"))
        assert f"`{modern}`" in row, (flag, row)


def test_checker_notices_a_drift():
    """The comparison fails when the doc loses a row or the table gains a flag."""
    text = DOC.read_text(encoding="utf-8")
    dropped = "\n".join(line for line in text.splitlines()
                        if not line.startswith("| `--mmap-warmup` |"))
    assert set(section_mismatches(dropped)) == {"Accepted without effect"}
    SECTIONS["Refused"].add("--made-up-flag")
    try:
        assert set(section_mismatches(text)) == {"Refused"}
    finally:
        SECTIONS["Refused"].discard("--made-up-flag")
    moved = text.replace("| group: `retro` |", "| group: `retroo` |")
    assert "group:retro" in section_mismatches(moved)["Refused"]


def test_recompute_method_with_selective_is_documented_as_refused():
    """The tuning-flags bullet of section 2 lists what is only warned; --recompute-method
    with --recompute-granularity selective is refused (Megatron-LM 23.05 asserts), so the
    doc must say so rather than count it among the warned flags."""
    from tests.args_helpers import error_of

    message = error_of("--recompute-granularity selective --recompute-method uniform")
    assert "only applies to --recompute-granularity full" in message
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    assert ("`--recompute-method` with `selective` is an error, as Megatron asserts" in text)
