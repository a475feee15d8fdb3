"""A script written against Megatron-LM's custom-script API (a modified copy of its
pretrain_gpt.py) gets one clear error naming the missing piece and MIGRATING.md's "Known
gaps", at import or call time; probes (hasattr, inspect) and the real pretrain() path are
unaffected. Cheap: no model, no process group."""
from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import megatron
from megatron import training
from megatron.core.megatron_names import MEGATRON_CORE_NAMES
from megatron.custom_script_api import MEGATRON_GLOBALS, MEGATRON_MODULE_NAMES

REPO = Path(__file__).resolve().parents[1]
DOC_SECTION = '"Known gaps"'


def _assert_clear(message: str, name: str) -> None:
    assert name in message
    assert "custom-script API" in message and "pretrain_gpt.py" in message
    assert "MIGRATING.md" in message and DOC_SECTION in message


def _known_gaps_text() -> str:
    text = (REPO / "MIGRATING.md").read_text(encoding="utf-8")
    return text.split("## 5. Known gaps", 1)[1]


@pytest.mark.parametrize("name", sorted(MEGATRON_GLOBALS))
def test_megatron_global_accessors_raise_one_clear_import_error(name):
    with pytest.raises(ImportError) as info:
        exec(f"from megatron import {name}", {})
    _assert_clear(str(info.value), f"megatron.{name}")


@pytest.mark.parametrize("module", ["megatron.model", "megatron.model.enums",
                                    "megatron.utils", "megatron.data.gpt_dataset",
                                    "megatron.global_vars", "megatron.timers",
                                    "megatron.optimizer", "megatron.optimizer_param_scheduler",
                                    "megatron.text_generation", "megatron.data.data_samplers"])
def test_megatron_script_modules_raise_one_clear_import_error(module):
    with pytest.raises(ImportError) as info:
        importlib.import_module(module)
    _assert_clear(str(info.value), module.replace(".enums", ""))
    assert module not in sys.modules  # a failed import leaves nothing half-built


@pytest.mark.parametrize("module,name", sorted(
    (module, name) for module, names in MEGATRON_MODULE_NAMES.items() for name in names))
def test_megatron_names_in_this_projects_modules_raise_one_clear_import_error(module, name):
    """`from megatron.initialize import initialize_megatron` and the like: the module is
    this project's, the name Megatron-LM's; the error says so instead of "cannot import"."""
    with pytest.raises(ImportError) as info:
        exec(f"from {module} import {name}", {})
    _assert_clear(str(info.value), f"{module}.{name}")
    mod = importlib.import_module(module)
    assert not hasattr(mod, "no_such_name")  # other names stay AttributeErrors


@pytest.mark.parametrize("module,name", sorted(
    (module, name) for module, names in MEGATRON_CORE_NAMES.items() for name in names))
def test_megatron_core_names_this_project_lacks_raise_one_clear_import_error(module, name):
    """`from megatron.core.pipeline_parallel import get_forward_backward_func` (a 23.05
    custom script's import): the error names the piece and this project's equivalent."""
    mod = importlib.import_module(module)
    assert name not in vars(mod)  # never shadows a name this project has
    with pytest.raises(ImportError) as info:
        exec(f"from {module} import {name}", {})
    _assert_clear(str(info.value), f"{module}.{name}")
    assert "instead; this project's" in str(info.value)
    assert not hasattr(mod, "no_such_name")  # other names stay AttributeErrors


def test_core_names_point_at_real_equivalents():
    from megatron.core.pipeline_parallel import ScheduleExecutor, build_schedule, p2p
    assert callable(build_schedule) and ScheduleExecutor and p2p.P2PCommunicator
    with pytest.raises(ImportError, match="build_schedule.*ScheduleExecutor"):
        from megatron.core.pipeline_parallel.schedules import (  # noqa: F401
            forward_backward_pipelining_with_interleaving,
        )


def test_stand_ins_name_this_projects_equivalent():
    for module, instead in (("megatron.optimizer", "megatron.core.optimizer"),
                            ("megatron.optimizer_param_scheduler", "megatron.core.optimizer"),
                            ("megatron.data.data_samplers", "megatron.core.datasets.samplers")):
        with pytest.raises(ImportError, match=f"instead; .*{instead}"):
            importlib.import_module(module)
        importlib.import_module(instead)  # the equivalent named is real
    from megatron.core.optimizer import OptimizerParamScheduler, build_optimizer  # noqa: F401
    with pytest.raises(ImportError, match="instead; .*--timing-log-level"):
        importlib.import_module("megatron.timers")


def test_probes_still_see_attribute_errors():
    assert not hasattr(megatron, "no_such_name")
    assert not hasattr(megatron, "__wrapped__")
    with pytest.raises(AttributeError):
        megatron.__no_such_dunder__
    inspect.getmembers(megatron)  # no ImportError from a probe
    from megatron import data_loading, initialize  # noqa: F401 (submodules still import)


@pytest.mark.parametrize("kwargs", [{}, {"args_defaults": {"tokenizer_type": "GPT2BPETokenizer"}}])
def test_pretrain_called_megatrons_way_is_a_clear_type_error(kwargs):
    def provider(*args):
        return None

    with pytest.raises(TypeError) as info:
        training.pretrain(provider, provider, 1, provider, **kwargs)
    _assert_clear(str(info.value), "megatron.training.pretrain(")
    assert "takes (config, rt" in str(info.value)


def test_pretrain_keeps_its_own_signature():
    params = list(inspect.signature(training.pretrain).parameters)
    assert params[:2] == ["config", "rt"]


def test_known_gaps_names_the_custom_script_api():
    gaps = _known_gaps_text()
    for name in ("custom-script API", "megatron.get_args()", "megatron.model",
                 "megatron.training.pretrain", "megatron/custom_script_api.py",
                 "megatron.initialize.initialize_megatron", "megatron.timers"):
        assert name in gaps


def test_a_modified_megatron_pretrain_script_stops_with_one_clear_error(tmp_path):
    """The import header of a Megatron-LM 23.05 style pretrain script, run as a user would
    (the package on PYTHONPATH): one ImportError, no traceback through library internals."""
    script = tmp_path / "my_pretrain_gpt.py"
    script.write_text(textwrap.dedent("""\
        from megatron import get_args, print_rank_0, get_timers, get_tokenizer
        from megatron.core import tensor_parallel
        from megatron.core.enums import ModelType
        from megatron.model import GPTModel
        from megatron.training import pretrain
        raise SystemExit("reached the end: the imports did not stop the script")
        """))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: megatron.get_args is part of")
    _assert_clear(last, "megatron.get_args")
    assert proc.stderr.count("Error") == 1
