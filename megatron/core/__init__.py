"""The library: models, layers, parallel state, optimizer, datasets (see README.md).

`mpu` is Megatron-LM's legacy name of `parallel_state` (`from megatron.core import mpu`,
`mpu.get_tensor_model_parallel_rank()` in ported code); it is imported on first use, so
importing this package stays cheap.
"""


def __getattr__(name: str):
    if name == "mpu":
        from megatron.core import parallel_state

        return parallel_state
    raise AttributeError(f"module 'megatron.core' has no attribute {name!r}")
