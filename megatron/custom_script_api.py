"""Megatron-LM's custom-script API, which this project does not offer: one clear error.

This project runs Megatron-LM 23.05's command lines with its own `pretrain_gpt.py`. A
script written against Megatron's library -- a modified copy of its `pretrain_gpt.py`
calling `megatron.training.pretrain(providers...)`, reading the `megatron.get_args()`
globals, building `megatron.model.GPTModel` -- gets one error naming the missing piece
and MIGRATING.md, "Known gaps", instead of a bare "cannot import name" or a TypeError
about arguments. Used by megatron/__init__.py (the package-level names), the
`megatron.model`, `megatron.utils`, `megatron.global_vars`, `megatron.timers`,
`megatron.optimizer`, `megatron.text_generation` and `megatron.data.gpt_dataset` stand-ins,
`megatron.training.pretrain`, and the Megatron names of `megatron.initialize`,
`megatron.arguments` and `megatron.training` (MEGATRON_MODULE_NAMES). The error itself
is megatron/core/megatron_names.py's, which also covers Megatron's `megatron.core` names.
"""
from __future__ import annotations

import functools

from megatron.core.megatron_names import custom_script_api_error, names_getattr

# Megatron-LM 23.05's package-level names: its global state and rank-printing helpers
MEGATRON_GLOBALS = frozenset((
    "get_args", "get_retro_args", "get_current_global_batch_size", "get_num_microbatches",
    "get_signal_handler", "update_num_microbatches", "get_tokenizer",
    "get_tensorboard_writer", "get_adlr_autoresume", "get_timers", "initialize_megatron",
    "print_rank_0", "print_rank_last", "is_last_rank",
))

# Megatron-LM 23.05's custom-script names inside modules this project has too (with its
# own contents): `from megatron.training import get_model` gets the error, not a bare
# "cannot import name"
MEGATRON_MODULE_NAMES = {
    "megatron.initialize": frozenset(("initialize_megatron", "set_jit_fusion_options")),
    "megatron.arguments": frozenset(("core_transformer_config_from_args",)),
    "megatron.training": frozenset((
        "get_model", "setup_model_and_optimizer", "get_optimizer_param_scheduler",
        "build_train_valid_test_datasets", "build_train_valid_test_data_loaders",
        "build_train_valid_test_data_iterators", "evaluate_and_print_results",
        "training_log", "save_checkpoint_and_time", "update_train_iters",
    )),
}

# keyword arguments only Megatron-LM's pretrain(providers...) takes
MEGATRON_PRETRAIN_KWARGS = frozenset((
    "train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func",
    "process_non_loss_data_func", "extra_args_provider", "args_defaults",
))


def module_getattr(module: str):
    """A module-level `__getattr__` for `module`: its Megatron-LM names in
    MEGATRON_MODULE_NAMES raise the error; any other missing name stays an AttributeError."""
    return names_getattr(module, MEGATRON_MODULE_NAMES[module])


def refuse_megatron_call(func):
    """Decorate this project's `pretrain(config, rt, ...)`: called Megatron-LM's way (a
    provider function first, or one of its keyword arguments) it raises one TypeError
    that says so."""
    @functools.wraps(func)
    def checked(*args, **kwargs):
        if (args and callable(args[0])) or MEGATRON_PRETRAIN_KWARGS.intersection(kwargs):
            text = str(custom_script_api_error(
                "megatron.training.pretrain(train_valid_test_dataset_provider, "
                "model_provider, model_type, forward_step_func, ...)"))
            raise TypeError(f"{text} This project's {func.__name__}() takes (config, rt, "
                            "...), built by its pretrain_gpt.py.")
        return func(*args, **kwargs)
    return checked
