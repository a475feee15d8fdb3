"""The library: models, layers, parallel state, optimizer, datasets (see README.md).

`mpu` is Megatron-LM's legacy name of `parallel_state` (`from megatron.core import mpu`,
`mpu.get_tensor_model_parallel_rank()` in ported code). Like Megatron-LM 23.05's package,
`megatron.core.parallel_state`, `.tensor_parallel`, `.utils` and `.enums` are attributes
after a plain `import megatron.core`; each is imported on first use, so importing this
package stays cheap.
"""
import importlib

_SUBMODULES = ("parallel_state", "tensor_parallel", "pipeline_parallel", "utils", "enums")


def __getattr__(name: str):
    if name == "mpu":
        name = "parallel_state"
    elif name not in _SUBMODULES:
        raise AttributeError(f"module 'megatron.core' has no attribute {name!r}")
    return importlib.import_module(f"megatron.core.{name}")
