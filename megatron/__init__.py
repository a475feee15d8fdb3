"""Megatron-LM 23.05 compatible GPT pretraining (see README.md).

Megatron-LM's package-level names (`get_args`, `get_timers`, `print_rank_0`, ...) belong
to its custom-script API, which this project does not offer: asked for here they raise
one ImportError saying so (megatron/custom_script_api.py), which `from megatron import
get_args` shows as it is. Any other missing name stays an AttributeError, so hasattr()
and inspect probes keep working.
"""


def __getattr__(name: str):
    if not name.startswith("__"):
        from megatron.custom_script_api import MEGATRON_GLOBALS, custom_script_api_error

        if name in MEGATRON_GLOBALS:
            raise custom_script_api_error(f"megatron.{name}")
    raise AttributeError(f"module 'megatron' has no attribute {name!r}")
