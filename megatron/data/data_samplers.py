"""Megatron-LM's `megatron.data.data_samplers` (build_pretraining_data_loader) is not
offered: importing it raises one ImportError that says so
(megatron/custom_script_api.py)."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.data.data_samplers",
                              "the samplers are megatron.core.datasets.samplers")
