"""Optimizer parameter groups: weight decay on for matrices, off for biases and norms.

Each group carries `wd_mult` and `lr_mult`; the lr scheduler multiplies its values by
them (`group["weight_decay"] = wd * wd_mult`). Group order follows Megatron: decayed
parameters first, then the rest; empty groups are left out.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

ParamCond = Callable[[str, torch.nn.Parameter], bool]


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Biases and every 1-D parameter (layer-norm weights and biases) skip weight decay."""
    return name.endswith(".bias") or name == "bias" or param.dim() == 1


def get_param_groups(
    model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    no_weight_decay_cond: Optional[ParamCond] = None,
    scale_lr_cond: Optional[ParamCond] = None,
    lr_mult: float = 1.0,
) -> List[Dict]:
    """Split the trainable parameters of all model chunks into optimizer groups.

    Args:
        model_chunks: one module or a list (virtual pipeline chunks).
        no_weight_decay_cond: `(name, param) -> bool`, True to exclude from weight decay;
            default excludes biases and 1-D parameters.
        scale_lr_cond: `(name, param) -> bool`, True to give the parameter `lr_mult`.
        lr_mult: learning-rate multiplier for parameters selected by `scale_lr_cond`.

    Returns a list of dicts `{"params": [...], "wd_mult": 0.0|1.0, "lr_mult": ...}`.
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    no_wd_cond = no_weight_decay_cond or default_no_weight_decay
    # (no_wd, scale_lr) -> params, in Megatron's order
    buckets: Dict[tuple, List[torch.nn.Parameter]] = {
        (False, False): [], (False, True): [], (True, False): [], (True, True): []
    }
    seen = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            no_wd = bool(no_wd_cond(name, param))
            scale_lr = bool(scale_lr_cond(name, param)) if scale_lr_cond is not None else False
            buckets[(no_wd, scale_lr)].append(param)
    groups = []
    for (no_wd, scale_lr), params in buckets.items():
        if params:
            groups.append({
                "params": params,
                "wd_mult": 0.0 if no_wd else 1.0,
                "lr_mult": lr_mult if scale_lr else 1.0,
            })
    return groups
