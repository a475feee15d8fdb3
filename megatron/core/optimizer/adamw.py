"""torch's AdamW without the cost of torch._dynamo in runs that compile nothing.

torch keeps its optimizers out of torch.compile by wrapping their methods: the first call
of `add_param_group` (made by the constructor), `zero_grad`, `state_dict` and
`load_state_dict` imports torch._dynamo, and `step` imports it on every call for a graph
break. The import costs 1.5-2.5 s of CPU per process. A GPU run that compiles its layers
imports it anyway; a run that compiles nothing (CPU runs, `--no-compile`) paid it in every
rank for nothing.

`AdamW` is `torch.optim.AdamW` with the four methods unwrapped (torch's own functions,
reached through the wrapper's `__wrapped__`) and a `step` of its own for groups that are
not fused: the same arithmetic in the same order as torch's single-tensor and foreach
kernels, over a group's tensors at once, bit for bit equal to both
(tests/test_adamw.py). Fused groups (CUDA), and options this build never sets (amsgrad,
maximize, capturable, differentiable, a tensor lr, complex parameters), keep torch's
`step`. The state is torch's
(`step`, `exp_avg`, `exp_avg_sq` per parameter, the same param_groups), so checkpoints
load into either class.
"""
from __future__ import annotations

from typing import Callable, List

import torch


def _unwrapped(method: Callable) -> Callable:
    """The function torch's no-compile wrapper calls (`functools.wraps` keeps it), or the
    method itself where a torch release has no wrapper."""
    return getattr(method, "__wrapped__", method)


_TORCH_ONLY = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` that imports torch._dynamo only where torch's fused step runs."""

    add_param_group = _unwrapped(torch.optim.Optimizer.add_param_group)
    zero_grad = _unwrapped(torch.optim.Optimizer.zero_grad)
    state_dict = _unwrapped(torch.optim.Optimizer.state_dict)
    load_state_dict = _unwrapped(torch.optim.Optimizer.load_state_dict)

    def step(self, closure=None):
        if not self._own_step_applies():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _own_step_applies(self) -> bool:
        for group in self.param_groups:
            if any(group.get(name) for name in _TORCH_ONLY) or torch.is_tensor(group["lr"]):
                return False
            if any(torch.is_complex(p) for p in group["params"]):
                return False  # torch's kernels view complex tensors as real
        return True

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # torch's first-step state: a CPU scalar step and zero moments
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=dtype)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _step_group(self, group: dict) -> None:
        params: List[torch.Tensor] = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("AdamW needs dense gradients, and a parameter has a sparse "
                               "one: use torch.optim.SparseAdam for sparse parameters")
        grads = [p.grad for p in params]
        states = [self._state_of(p) for p in params]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        if weight_decay != 0:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [s.item() for s in steps]
        step_sizes = [-(lr / (1 - beta1 ** t)) for t in counts]
        bias_correction2_sqrt = [(1 - beta2 ** t) ** 0.5 for t in counts]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)
