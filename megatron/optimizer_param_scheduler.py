"""Megatron-LM's `megatron.optimizer_param_scheduler` is not offered: importing it raises
one ImportError that says so (megatron/custom_script_api.py)."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.optimizer_param_scheduler",
                              "the scheduler is megatron.core.optimizer.OptimizerParamScheduler")
