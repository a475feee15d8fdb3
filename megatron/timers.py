"""Megatron-LM's `megatron.timers` (its Timers class) is not offered: importing it raises
one ImportError that says so (megatron/custom_script_api.py)."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.timers",
                              "Megatron's timers are printed by --timing-log-level and --log-timers-to-tensorboard")
