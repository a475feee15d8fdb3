"""Building the optimizer stack from an `OptimizerConfig`.

The wrapper classes (`optimizer.py`, `distrib_optimizer.py`) take live objects and plain
numbers and never read the config; this module is where the config is read once: it makes
the parameter groups, the torch optimizer, the loss scaler, and picks the wrapper -- the
distributed optimizer when the DDP wrapper put the parameters in sharded grad buffers,
mixed precision for fp16/bf16, fp32 otherwise. Kept apart from the classes so that the
distributed optimizer, which subclasses the mixed-precision one, can be imported here
without an import cycle.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.ddp import DistributedDataParallel
from megatron.core.optimizer.adamw import AdamW
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.optimizer import (
    FP32Optimizer,
    MegatronOptimizer,
    MixedPrecisionOptimizer,
)
from megatron.core.optimizer.param_groups import get_param_groups


def build_grad_scaler(config) -> Optional[MegatronGradScaler]:
    """`--loss-scale X` -> constant; else fp16 -> dynamic; else (bf16/fp32) none."""
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
        )
    return None


def build_base_optimizer(config, param_groups: List[Dict]) -> torch.optim.Optimizer:
    """torch AdamW (decoupled weight decay, as apex FusedAdam with adam_w_mode; our
    subclass, which leaves torch._dynamo unimported where nothing is compiled) or SGD.

    Adam is fused when `config.use_fused` is True, or when it is None and every
    parameter is on CUDA.
    """
    if config.optimizer == "adam":
        params = [p for g in param_groups for p in g["params"]]
        fused = config.use_fused
        if fused is None:
            fused = all(p.is_cuda for p in params)
        return AdamW(
            param_groups, lr=config.lr, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            fused=True if fused else None,
        )
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            param_groups, lr=config.lr, weight_decay=config.weight_decay,
            momentum=config.sgd_momentum,
        )
    raise ValueError(f"optimizer {config.optimizer!r} is not supported; use 'adam' or 'sgd'")


def build_optimizer(
    config,
    model_chunks,
    parallel_state,
    no_weight_decay_cond=None,
    scale_lr_cond=None,
    lr_mult: float = 1.0,
) -> MegatronOptimizer:
    """Build the optimizer for `model_chunks` (a module or a list of virtual-pipeline chunks,
    bare or wrapped in `DistributedDataParallel`).

    Groups: weight decay off for biases and 1-D params (`get_param_groups`); each group's
    lr and weight decay start at `config.lr * lr_mult` and `config.weight_decay * wd_mult`
    (the scheduler rewrites them every step). Parameters in the grad buffers of a DDP built
    with `use_distributed_optimizer` -> `DistributedOptimizer` (grad norm, zeros and
    found-inf over the whole world); else fp16/bf16 -> `MixedPrecisionOptimizer` with the
    scaler from `build_grad_scaler`; else `FP32Optimizer`. The model-parallel group and TP
    rank for the grad norm come from `parallel_state`.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    chunks = [c.module if isinstance(c, DistributedDataParallel) else c for c in chunks]
    groups = get_param_groups(chunks, no_weight_decay_cond, scale_lr_cond, lr_mult)
    if not groups:
        raise ValueError("the model has no trainable parameters to optimize")
    for group in groups:
        group["lr"] = config.lr * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
    chunk_buckets = _distributed_buckets(chunks)
    if chunk_buckets is not None:
        world = parallel_state.world_size > 1 and dist.is_available() and dist.is_initialized()
        opt = DistributedOptimizer(
            groups, chunk_buckets, lambda shard_groups: build_base_optimizer(config, shard_groups),
            clip_grad=config.clip_grad, log_num_zeros_in_grad=config.log_num_zeros_in_grad,
            grad_group=dist.group.WORLD if world else None, tp_rank=parallel_state.tp_rank,
            grad_scaler=build_grad_scaler(config))
        opt.adam_kernel = config.adam_kernel
        return opt
    inner = build_base_optimizer(config, groups)
    common = dict(
        clip_grad=config.clip_grad,
        log_num_zeros_in_grad=config.log_num_zeros_in_grad,
        mp_group=parallel_state.mp_group,
        tp_rank=parallel_state.tp_rank,
    )
    if config.fp16 or config.bf16:
        opt = MixedPrecisionOptimizer(inner, grad_scaler=build_grad_scaler(config), **common)
    else:
        opt = FP32Optimizer(inner, **common)
    opt.adam_kernel = config.adam_kernel
    return opt


def _distributed_buckets(chunks) -> Optional[List[Dict[torch.dtype, list]]]:
    """Per chunk `{grad_dtype: [buckets in buffer order]}` when the chunks' parameters sit in
    distributed-optimizer grad buffers (`param.grad_bucket`, set by the DDP wrapper); None
    when none of them does."""
    out, any_distributed = [], False
    for chunk in chunks:
        by_dtype: Dict[torch.dtype, list] = {}
        for p in chunk.parameters():
            bucket = getattr(p, "grad_bucket", None)
            if bucket is None or not bucket.distributed:
                continue
            any_distributed = True
            buckets = by_dtype.setdefault(bucket.grad_data.dtype, [])
            if all(b is not bucket for b in buckets):
                buckets.append(bucket)
        out.append({d: sorted(b, key=lambda x: x.offset) for d, b in by_dtype.items()})
    return out if any_distributed else None
