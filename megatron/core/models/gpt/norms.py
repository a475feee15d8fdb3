"""Normalisation layers of the GPT model: LayerNorm (optionally 1p), RMSNorm, build_norm.

The norms keep the fp32 residual stream in fp32 (`--fp32-residual-connection`) and, with
gradient-accumulation fusion, route their parameters' grads straight into `main_grad`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config import ModelConfig
from megatron.core.tensor_parallel.grad_accumulation import grad_into_main_grad


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with Megatron's two options.

    `one_p` (--apply-layernorm-1p): the weight is stored as (gamma - 1), zero-initialised.
    `fp32_input` (--fp32-residual-connection): the input is the fp32 residual stream; it is
    normalised in fp32 (the fp16/bf16 weights upcast) and the output comes back in the
    weights' dtype, the dtype the following layer computes in.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, one_p: bool = False,
                 fp32_input: bool = False) -> None:
        self.one_p = one_p
        self.fp32_input = fp32_input
        self.grad_into_main_grad = False  # build_norm: gradient-accumulation fusion
        super().__init__(size, eps=eps, dtype=dtype)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.one_p and self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = grad_into_main_grad(self.weight, self.grad_into_main_grad)
        bias = grad_into_main_grad(self.bias, self.grad_into_main_grad)
        weight = weight + 1 if self.one_p else weight
        if not self.fp32_input:
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        out = F.layer_norm(x.float(), self.normalized_shape, weight.float(), bias.float(),
                           self.eps)
        return out.to(self.weight.dtype)


class LayerNorm1P(LayerNorm):
    """LayerNorm whose weight is stored as (gamma - 1) (`--apply-layernorm-1p`)."""

    def __init__(self, size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 fp32_input: bool = False) -> None:
        super().__init__(size, eps, dtype, one_p=True, fp32_input=fp32_input)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm; with `fp32_input` computed in fp32 on the fp32 residual stream and
    returned in the weights' dtype (see LayerNorm)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, fp32_input: bool = False):
        super().__init__(size, eps=eps, dtype=dtype)
        self.fp32_input = fp32_input
        self.grad_into_main_grad = False  # build_norm: gradient-accumulation fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = grad_into_main_grad(self.weight, self.grad_into_main_grad)
        if not self.fp32_input:
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)
        out = F.rms_norm(x.float(), self.normalized_shape, weight.float(), self.eps)
        return out.to(self.weight.dtype)


def build_norm(config: ModelConfig, hidden_size: Optional[int] = None) -> nn.Module:
    """LayerNorm or RMSNorm per config. With sequence parallelism the norm sees only s/tp
    tokens, so its grads are partial sums: `param.sequence_parallel` tells the trainer to
    all-reduce them over the tensor-parallel group."""
    size = hidden_size or config.hidden_size
    fp32_input = config.fp32_residual_connection and config.params_dtype != torch.float32
    if config.normalization == "RMSNorm":
        norm = RMSNorm(size, config.layernorm_epsilon, config.params_dtype, fp32_input)
    else:
        norm = LayerNorm(size, config.layernorm_epsilon, config.params_dtype,
                         one_p=config.apply_layernorm_1p, fp32_input=fp32_input)
    # Like the linears' weights, the norm parameters' grads go straight into main_grad.
    norm.grad_into_main_grad = config.gradient_accumulation_fusion
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
        p.tensor_model_parallel = False
    return norm
