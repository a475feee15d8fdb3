"""Megatron-LM 23.05's optimizer checkpoint state, written out independently of the
framework (for tests/test_megatron_optim_state.py).

What Megatron-LM 23.05 writes for GPT pretraining with its default Adam (apex FusedAdam,
AdamW mode), per (tp, pp) rank file, from its code:

* parameter groups (`get_param_groups`): weight-decayed parameters first, then those named
  `*.bias` or 1-D (norms); each group `{lr, bias_correction: True, betas, eps,
  weight_decay, wd_mult, lr_mult, step, params}` -- apex keeps the step count in the
  group, not in the per-parameter state, which holds only `exp_avg` / `exp_avg_sq`. The
  parameters in each group follow `model.named_parameters()` (language_model ->
  embedding, encoder layers, final norm, output layer; then the last stage's
  `word_embeddings` copy); the torch state dict numbers them 0.. across the groups.
* fp16/bf16 (`Float16OptimizerWithFloat16Params.state_dict`): `{optimizer: <that state
  dict>, grad_scaler: {scale, growth_tracker, hysteresis_tracker} (fp16 only),
  fp32_from_fp16_params: per group, the fp32 main copies of its 16-bit parameters}`.
* fp32 (`FP32Optimizer`): the state dict itself.
* `--use-distributed-optimizer`: `{optimizer: {param_groups: the groups without "params"},
  grad_scaler}` in model_optim_rng.pt, and distrib_optim.pt `{0: {grad_dtype: {"param",
  "exp_avg", "exp_avg_sq"}}}`: flat fp32 tensors laid out as the grad buffer is -- its
  parameters placed from the end backwards in `parameters()` order (so the last
  parameter first), then padding (uninitialised: `torch.empty`) up to a multiple of the
  data-parallel size.

Every state tensor here is distinguishable per parameter: `state_values` makes them from
the parameter's index in the one-process model.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

COLUMN_DIM0 = ("word_embeddings.weight", "query_key_value.weight", "query_key_value.bias",
               "dense_h_to_4h.weight", "dense_h_to_4h.bias", "output_layer.weight")
ROW_DIM1 = ("self_attention.dense.weight", "dense_4h_to_h.weight")


def tp_dim(name: str) -> Optional[int]:
    """The dimension Megatron-LM 23.05 splits `name` along over tensor-parallel ranks."""
    if name.endswith(COLUMN_DIM0):
        return 0
    if name.endswith(ROW_DIM1):
        return 1
    return None


def no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".bias") or tensor.dim() == 1


def state_values(names: List[str], full: Dict[str, torch.Tensor]
                 ) -> Dict[str, Dict[str, torch.Tensor]]:
    """Per parameter name, its (tp 1) main weight and Adam moments, each made from the
    parameter's index so that a state given to the wrong parameter shows."""
    out = {}
    for i, name in enumerate(names):
        w = full[name].float()
        ramp = torch.arange(w.numel(), dtype=torch.float32, device=w.device)
        ramp = ramp.reshape(w.shape) / w.numel()
        out[name] = {"param": w + 1e-3 * (i + 1) * (1 + ramp),
                     "exp_avg": 1e-3 * (i + 1) * (1 - ramp),
                     "exp_avg_sq": 1e-6 * (i + 1) * (1 + ramp)}
    return out


def shard(tensor: torch.Tensor, name: str, tp: int, rank: int) -> torch.Tensor:
    dim = tp_dim(name)
    return tensor if dim is None or tp == 1 else tensor.chunk(tp, dim=dim)[rank].clone()


def adam_groups(names: List[str], shapes: Dict[str, torch.Tensor], hyper: dict, step: int
                ) -> Tuple[List[List[str]], List[dict]]:
    """(names per group, apex FusedAdam groups without "params") of one rank."""
    decayed = [n for n in names if not no_weight_decay(n, shapes[n])]
    plain = [n for n in names if no_weight_decay(n, shapes[n])]
    members, groups = [], []
    for group, wd_mult in ((decayed, 1.0), (plain, 0.0)):
        if group:
            members.append(group)
            groups.append({"lr": hyper["lr"], "bias_correction": True,
                           "betas": (hyper["beta1"], hyper["beta2"]), "eps": hyper["eps"],
                           "weight_decay": hyper["weight_decay"] * wd_mult,
                           "wd_mult": wd_mult, "lr_mult": 1.0, "step": step})
    return members, groups


def indexed_optimizer(names: List[str], local: Dict[str, Dict[str, torch.Tensor]],
                      weights: Dict[str, torch.Tensor], hyper: dict, step: int,
                      scaler: Optional[dict]) -> dict:
    """The `optimizer` entry of one rank file without the distributed optimizer: `local`
    holds each parameter's (this rank's shard of) main weight and moments."""
    members, groups = adam_groups(names, weights, hyper, step)
    state, idx = {}, 0
    for group, names_in in zip(groups, members):
        group["params"] = list(range(idx, idx + len(names_in)))
        for n in names_in:
            state[idx] = {"exp_avg": local[n]["exp_avg"], "exp_avg_sq": local[n]["exp_avg_sq"]}
            idx += 1
    inner = {"state": state, "param_groups": groups}
    if all(w.dtype == torch.float32 for w in weights.values()):
        return inner
    out = {"optimizer": inner}
    if scaler is not None:
        out["grad_scaler"] = scaler
    out["fp32_from_fp16_params"] = [[local[n]["param"] for n in names_in
                                     if weights[n].dtype != torch.float32]
                                    for names_in in members]
    return out


def distributed_optimizer(names: List[str], local: Dict[str, Dict[str, torch.Tensor]],
                          weights: Dict[str, torch.Tensor], hyper: dict, step: int,
                          scaler: Optional[dict], grad_dtype: torch.dtype, dp: int
                          ) -> Tuple[dict, dict]:
    """(`optimizer` entry, distrib_optim.pt payload) of one rank file."""
    _, groups = adam_groups(names, weights, hyper, step)
    entry = {"optimizer": {"param_groups": groups}}
    if scaler is not None:
        entry["grad_scaler"] = scaler
    numel = sum(weights[n].numel() for n in names)
    padded = dp * int(math.ceil(numel / dp))
    flats = {k: torch.full((padded,), float("nan")) for k in ("param", "exp_avg", "exp_avg_sq")}
    end = numel
    for n in names:  # the grad buffer: the first parameter at the end
        start = end - weights[n].numel()
        for k, flat in flats.items():
            flat[start:end] = local[n][k].reshape(-1)
        end = start
    return entry, {0: {grad_dtype: flats}}


def scheduler_state(max_lr: float, min_lr: float, warmup: int, decay: int, num_steps: int,
                    wd: float, style: str = "cosine") -> dict:
    return {"max_lr": max_lr, "lr_warmup_steps": warmup, "num_steps": num_steps,
            "lr_decay_style": style, "lr_decay_steps": decay, "min_lr": min_lr,
            "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant", "wd_incr_steps": decay}


def megatron_lr(s: dict) -> float:
    """Megatron-LM 23.05's OptimizerParamScheduler.get_lr at the state's num_steps."""
    n, warm, decay = s["num_steps"], s["lr_warmup_steps"], s["lr_decay_steps"]
    if warm > 0 and n <= warm:
        return s["max_lr"] * n / warm
    if s["lr_decay_style"] == "constant":
        return s["max_lr"]
    if n > decay:
        return s["min_lr"]
    ratio = (n - warm) / (decay - warm)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if s["lr_decay_style"] == "cosine" \
        else 1.0 - ratio
    return s["min_lr"] + coeff * (s["max_lr"] - s["min_lr"])


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
               lr: float, wd: float, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """apex FusedAdam (adam_w_mode, bias correction) on one parameter, fp64 on CPU:
    `step` is the count after this update."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps) + wd * p
    return p - lr * update


# ------------------------------------------------- what Megatron-LM 23.05 does on load
class ApexFusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam (adam_w_mode) as Megatron-LM 23.05 runs it, in Python:
    the step count lives in each parameter group (`group["step"]`, 1 when absent) and the
    update reads `group["bias_correction"]`; per-parameter state is exp_avg, exp_avg_sq."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, bias_correction=True, betas=betas, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            group["step"] = group["step"] + 1 if "step" in group else 1
            t = group["step"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                c1 = 1 - beta1 ** t if bias_correction else 1.0
                c2 = 1 - beta2 ** t if bias_correction else 1.0
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                p.sub_(group["lr"] * (update + group["weight_decay"] * p))


def megatron_param_groups(params: Dict[str, torch.Tensor]) -> List[dict]:
    """Megatron-LM 23.05's get_param_groups over named parameters (module order)."""
    decayed = [p for n, p in params.items() if not no_weight_decay(n, p)]
    plain = [p for n, p in params.items() if no_weight_decay(n, p)]
    return [g for g in ({"params": decayed, "wd_mult": 1.0, "lr_mult": 1.0},
                        {"params": plain, "wd_mult": 0.0, "lr_mult": 1.0}) if g["params"]]


def megatron_load_indexed(entry: dict, params: Dict[str, torch.Tensor]) -> ApexFusedAdam:
    """Float16OptimizerWithFloat16Params.load_state_dict (or FP32Optimizer's) on fp32
    main parameters `params` (name -> tensor, module order), as Megatron-LM 23.05 runs it."""
    opt = ApexFusedAdam(megatron_param_groups(params), lr=0.0, weight_decay=0.0)
    if "fp32_from_fp16_params" not in entry:  # fp32: the state dict itself
        opt.load_state_dict(entry)
        return opt
    opt.load_state_dict(entry["optimizer"])
    with torch.no_grad():
        for group, saved in zip(opt.param_groups, entry["fp32_from_fp16_params"]):
            for current, value in zip(group["params"], saved):
                current.copy_(value)
    return opt


def megatron_load_distributed(entry: dict, distrib: dict, params: Dict[str, torch.Tensor],
                              dp_size: int) -> ApexFusedAdam:
    """DistributedOptimizer.load_state_dict + load_parameter_state of Megatron-LM 23.05
    at data-parallel size `dp_size`, gathered back into one process: the groups without
    "params" go through torch's load_state_dict; DP rank 0 cuts each flat tensor of
    distrib_optim.pt into dp_size pieces of its padded grad buffer's shard size (a
    scatter: every piece must have that size) and each rank copies its parameters' parts."""
    opt = ApexFusedAdam(megatron_param_groups(params), lr=0.0, weight_decay=0.0)
    inner = opt.state_dict()
    groups = [{**g, "params": inner["param_groups"][i]["params"]}
              for i, g in enumerate(entry["optimizer"]["param_groups"])]
    state = {i: {"exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0)}
             for g in groups for i in g["params"]}
    opt.load_state_dict({"state": state, "param_groups": groups})
    ((_, flats),) = distrib[0].items()
    numel = sum(p.numel() for p in params.values())
    padded = dp_size * int(math.ceil(numel / dp_size))
    local = padded // dp_size
    for key, world in flats.items():
        pieces = [world[i:i + local] for i in range(0, padded, local)]
        if any(piece.numel() != local for piece in pieces):
            raise RuntimeError(f"scatter of {key}: pieces of {[p.numel() for p in pieces]} "
                               f"elements, dp {dp_size} needs {local} each")
        whole = torch.cat(pieces)
        end = numel
        for p in params.values():  # the grad buffer: the first parameter at the end
            start = end - p.numel()
            value = whole[start:end].view(p.shape)
            with torch.no_grad():
                if key == "param":
                    p.copy_(value)
                else:
                    opt.state[p][key] = value.clone()
            end = start
    return opt
