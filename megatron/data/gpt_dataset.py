"""Megatron-LM's `megatron.data.gpt_dataset` (dataset providers for custom scripts) is not
offered: importing it raises one ImportError that says so (megatron/custom_script_api.py). The
datasets live in megatron.core.datasets and are built from the command line's flags."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.data.gpt_dataset")
