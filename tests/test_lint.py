"""Lint and size budgets run with the tests (STYLE.md habits 9 and 15)."""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_check_is_clean():
    """Committed files only, so work in progress beside them does not fail the suite."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = listed.stdout.split() if listed.returncode == 0 and listed.stdout.strip() else ["."]
    proc = subprocess.run(["ruff", "check", *files], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_size_budgets():
    """No function over 100 lines, no file over 1,000 lines outside tests/."""
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"tests", ".git"} or any(p.startswith(".") for p in rel.parts):
            continue
        text = path.read_text(encoding="utf-8")
        if text.count("\n") + 1 > 1000:
            over.append(f"{rel}: {text.count(chr(10)) + 1} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    over.append(f"{rel}:{node.lineno} {node.name}() has {n} lines")
    assert not over, "\n".join(over)
