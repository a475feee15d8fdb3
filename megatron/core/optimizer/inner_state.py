"""Loading a torch optimizer's own state from a checkpoint (the inner optimizer of the
mixed-precision and distributed optimizers)."""
from __future__ import annotations

from typing import Dict

import torch

# Implementation switches that belong to this process, not to the checkpoint.
LOCAL_GROUP_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_inner_state(optimizer: torch.optim.Optimizer, state_dict: Dict) -> None:
    """`optimizer.load_state_dict`, tolerating apex-style state (step kept in the group)
    and keeping this process's implementation switches (fused/foreach)."""
    if "state" not in state_dict:
        raise ValueError(
            "the checkpoint's optimizer state holds no per-parameter state: it was saved with "
            "--use-distributed-optimizer (the state is in distrib_optim.pt); resume with that "
            "flag, or pass --no-load-optim to start the optimizer fresh from the loaded weights")
    groups = []
    for saved, current in zip(state_dict["param_groups"], optimizer.param_groups):
        saved = dict(saved)
        for key in LOCAL_GROUP_KEYS:
            if key in current:
                saved[key] = current[key]
        groups.append(saved)
    state = {}
    for idx, param_state in state_dict["state"].items():
        param_state = dict(param_state)
        if "step" not in param_state and "exp_avg" in param_state:
            group = next((g for g in groups if idx in g["params"]), {})
            param_state["step"] = torch.tensor(float(group.get("step", 0)))
        state[idx] = param_state
    optimizer.load_state_dict({"state": state, "param_groups": groups})


__all__ = ["LOCAL_GROUP_KEYS", "load_inner_state"]
