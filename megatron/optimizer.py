"""Megatron-LM's `megatron.optimizer` (get_megatron_optimizer) is not offered: importing it
raises one ImportError that says so (megatron/custom_script_api.py)."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.optimizer",
                              "the optimizer is megatron.core.optimizer (build_optimizer)")
