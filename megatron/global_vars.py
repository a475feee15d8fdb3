"""Megatron-LM's `megatron.global_vars` (the get_args(), get_timers(), get_tokenizer()
globals) is not offered: importing it raises one ImportError that says so
(megatron/custom_script_api.py)."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.global_vars")
