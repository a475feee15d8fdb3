"""Megatron-LM 23.05 names this project does not have: one clear ImportError each.

A script written against Megatron-LM's library -- a modified copy of its `pretrain_gpt.py`,
a fine-tuning loop calling `megatron.core.pipeline_parallel.get_forward_backward_func()` --
gets `custom_script_api_error`, naming the missing piece, this project's nearest
equivalent and MIGRATING.md, "Known gaps", instead of a bare "cannot import name". The
driver's stand-ins (megatron/custom_script_api.py) use the same error; this module holds
the `megatron.core` names, since the library imports nothing outside megatron/core.
"""
from __future__ import annotations

_SCHEDULES = ("this project's pipeline schedules are data: "
              "megatron.core.pipeline_parallel.build_schedule(pp_size, num_microbatches, "
              "vpp_size) run by ScheduleExecutor (megatron/core/pipeline_parallel/README.md); "
              "pretrain_gpt.py picks the schedule from --pipeline-model-parallel-size and "
              "--num-layers-per-virtual-pipeline-stage as Megatron-LM does")

# Megatron-LM 23.05's megatron.core names (in modules this project has too, with its own
# contents) a custom script imports, each with this project's nearest equivalent
MEGATRON_CORE_NAMES = {
    "megatron.core.pipeline_parallel": {
        "get_forward_backward_func": _SCHEDULES,
        "p2p_communication": "this project's point-to-point transfers are "
                             "megatron.core.pipeline_parallel.p2p (P2PCommunicator)",
    },
    "megatron.core.pipeline_parallel.schedules": dict.fromkeys((
        "get_forward_backward_func", "forward_backward_no_pipelining",
        "forward_backward_pipelining_with_interleaving",
        "forward_backward_pipelining_without_interleaving"), _SCHEDULES),
}


def custom_script_api_error(name: str, instead: str = "") -> ImportError:
    """The error for `name`, a piece of Megatron-LM's custom-script API; `instead` names
    this project's nearest equivalent, where it has one."""
    return ImportError(
        f"{name} is part of Megatron-LM's custom-script API, which this project does not offer: it "
        "runs Megatron-LM 23.05's command lines (same flags, data files and checkpoints) "
        "with its own pretrain_gpt.py, not scripts written against Megatron's library "
        "(megatron.training.pretrain(providers...), the megatron.get_args() globals, "
        "megatron.model). Run your command line with this project's pretrain_gpt.py "
        f"instead{'; ' + instead if instead else ''}; see MIGRATING.md, \"Known gaps\".")


def names_getattr(module: str, names):
    """A module-level `__getattr__` for `module`: its Megatron-LM names (`names`: a set,
    or a dict of name -> this project's equivalent) raise the error; any other missing
    name stays an AttributeError, so probes (hasattr, inspect) are unaffected."""
    instead = names if isinstance(names, dict) else dict.fromkeys(names, "")

    def __getattr__(name: str):
        if name in instead:
            raise custom_script_api_error(f"{module}.{name}", instead[name])
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__


def core_getattr(module: str):
    """The module-level `__getattr__` of `module`, one of MEGATRON_CORE_NAMES' modules."""
    return names_getattr(module, MEGATRON_CORE_NAMES[module])
