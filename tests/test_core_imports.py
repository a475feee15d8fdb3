"""The library (megatron/core) imports nothing from the driver and reads no environment.

Every module under megatron/core is parsed (not imported) and each import is resolved to
an absolute module name, relative ones included. A module may import the standard
library, third-party packages and megatron.core.*, but nothing else under megatron
(megatron.arguments, megatron.training, megatron.config, ...). Library code also must not
touch os.environ / os.getenv (STYLE.md habit 13: configuration is passed in).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = REPO / "megatron" / "core"
DRIVER_MODULES = (
    "megatron.arguments", "megatron.training", "megatron.logging_utils",
    "megatron.checkpointing", "megatron.config", "megatron.initialize",
)
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """Absolute name of `from <level dots><target> import ...` written in `module`."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imported_modules(source: str, module: str, is_package: bool) -> Iterator[Tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, including the
    `from pkg import name` form (yields pkg.name, which may be a submodule) and
    importlib.import_module / __import__ calls with a constant name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            yield node.lineno, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str):
                    yield node.lineno, arg.value


def forbidden_import(name: str) -> bool:
    """True for anything under megatron that is not megatron.core (the driver)."""
    if name.startswith("megatron.core.") or name in ("megatron", "megatron.core"):
        return False
    return name.startswith("megatron.")


def environment_reads(source: str) -> List[Tuple[int, str]]:
    """(line, text) for every use of os.environ / os.getenv (also via aliases)."""
    tree = ast.parse(source)
    os_aliases = {"os"}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_aliases |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            hits += [(node.lineno, f"from os import {a.name}") for a in node.names
                     if a.name in ENV_NAMES]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENV_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id in os_aliases
        ):
            hits.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return hits


def _core_files() -> List[Path]:
    return sorted(CORE.rglob("*.py"))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ------------------------------------------------------------ the checkers themselves
@pytest.mark.parametrize(
    "source, module, is_package, bad",
    [
        ("import megatron.training", "megatron.core.x", False, "megatron.training"),
        ("from megatron import arguments", "megatron.core.x", False, "megatron.arguments"),
        ("from megatron.config import TrainingConfig", "megatron.core.x", False,
         "megatron.config"),
        ("from .. import checkpointing", "megatron.core.x", False, "megatron.checkpointing"),
        ("from ..logging_utils import log", "megatron.core.x", False, "megatron.logging_utils"),
        ("from ....initialize import init", "megatron.core.models.gpt", True,
         "megatron.initialize"),
        ("from ....config import DataConfig", "megatron.core.models.gpt.model", False,
         "megatron.config"),
        ("from ..tokenizer import build", "megatron.core.x", False, "megatron.tokenizer"),
        ("importlib.import_module('megatron.training')", "megatron.core.x", False,
         "megatron.training"),
    ],
)
def test_checker_flags_driver_imports(source, module, is_package, bad):
    names = [n for _, n in imported_modules(source, module, is_package)]
    assert bad in names and any(forbidden_import(n) for n in names)


@pytest.mark.parametrize(
    "source, module, is_package",
    [
        ("from megatron.core import parallel_state", "megatron.core.x", False),
        ("from . import mappings", "megatron.core.tensor_parallel.layers", False),
        ("from .. import parallel_state", "megatron.core.tensor_parallel.layers", False),
        ("from ..config import ModelConfig", "megatron.core.models.gpt", True),
        ("from .config import ModelConfig", "megatron.core.parallel_state", False),
        ("import torch, os\nfrom typing import List", "megatron.core.x", False),
    ],
)
def test_checker_allows_library_imports(source, module, is_package):
    names = [n for _, n in imported_modules(source, module, is_package)]
    assert not [n for n in names if forbidden_import(n)], names


def test_checker_finds_environment_reads():
    assert environment_reads("import os\nx = os.environ['A']")[0][0] == 2
    assert environment_reads("import os as o\nx = o.getenv('A')")
    assert environment_reads("from os import environ")
    assert not environment_reads('"""docstring mentioning os.environ"""\nimport os\nos.path')


# --------------------------------------------------------------- the real library
def test_core_exists():
    assert (CORE / "parallel_state.py").is_file()


def test_core_never_imports_the_driver():
    problems = []
    for path in _core_files():
        module = _module_name(path, REPO)
        is_package = path.name == "__init__.py"
        for line, name in imported_modules(_read(path), module, is_package):
            if forbidden_import(name):
                problems.append(f"{path.relative_to(REPO)}:{line}: imports {name}")
    assert not problems, (
        "megatron/core must not import the driver or anything under megatron outside "
        f"megatron.core ({', '.join(DRIVER_MODULES)}, ...):\n" + "\n".join(problems)
    )


def test_core_reads_no_environment_variables():
    problems = [
        f"{path.relative_to(REPO)}:{line}: {text}"
        for path in _core_files()
        for line, text in environment_reads(_read(path))
    ]
    assert not problems, (
        "library code reads no environment variables (STYLE habit 13); pass the value in "
        "through a config dataclass instead:\n" + "\n".join(problems)
    )
