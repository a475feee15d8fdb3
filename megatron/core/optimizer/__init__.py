"""Optimizer stack: parameter groups, mixed-precision wrappers, loss scaling, gradient
clipping and the learning-rate / weight-decay schedule (see each module's docstring)."""
from megatron.core.optimizer.build import (
    build_base_optimizer,
    build_grad_scaler,
    build_optimizer,
)
from megatron.core.optimizer.clip_grads import (
    clip_grad_norm,
    count_zeros,
    get_grad_norm,
    get_params_norm,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.core.optimizer.optimizer import (
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.core.optimizer.param_groups import get_param_groups

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerParamScheduler",
    "build_base_optimizer",
    "build_grad_scaler",
    "build_optimizer",
    "clip_grad_norm",
    "count_zeros",
    "get_grad_norm",
    "get_params_norm",
    "get_param_groups",
]
