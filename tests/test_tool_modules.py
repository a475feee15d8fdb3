"""The library modules in tools/ (beam search, the layout planner's cost model, the server's
request handling, ...), run as scripts: one line naming the command to run instead, not a
ModuleNotFoundError traceback (or, for those that import no package, silence)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_MAIN = 'if __name__ == "__main__":'
_GUARD = 'raise SystemExit("tools/'  # what a library module's main block does


def _library_modules():
    """tools/*.py whose main block only says which command to run, or that have none."""
    out = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        parts = path.read_text().split(_MAIN, 1)
        if path.name != "__init__.py" and (len(parts) == 1 or parts[1].lstrip().startswith(_GUARD)):
            out.append(path.name)
    return out


def test_the_known_library_modules_are_found():
    assert {"beam_search.py", "layout_cost.py", "layout_report.py",
            "text_generation_api.py"} <= set(_library_modules())


@pytest.mark.parametrize("name", _library_modules())
def test_a_library_module_run_as_a_script_names_the_command(name):
    proc = subprocess.run([sys.executable, f"tools/{name}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    text = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert text.startswith(f"tools/{name} is a library module"), text
    commands = re.findall(r"python (tools/\w+\.py)", text)
    assert commands, text
    for command in commands:  # a command that exists and is not a library module itself
        assert (ROOT / command).is_file(), command
        assert Path(command).name not in _library_modules(), command
