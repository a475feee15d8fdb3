"""Megatron-LM's `megatron.model` (GPTModel and its pieces for custom scripts) is not
offered: importing it, or any module under it, raises one ImportError that says so
(megatron/custom_script_api.py). The model lives in megatron.core.models.gpt."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.model")
