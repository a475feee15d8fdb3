"""Megatron-LM's `megatron.text_generation` (generate_and_post_process,
beam_search_and_post_process) is not offered: importing it raises one ImportError that
says so (megatron/custom_script_api.py)."""
from megatron.custom_script_api import custom_script_api_error

raise custom_script_api_error("megatron.text_generation",
                              "text generation runs from tools/generate.py and tools/run_text_generation_server.py")
