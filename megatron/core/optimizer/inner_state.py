"""Loading a torch optimizer's own state from a checkpoint (the inner optimizer of the
mixed-precision and distributed optimizers)."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

# Implementation switches that belong to this process, not to the checkpoint.
LOCAL_GROUP_KEYS = ("fused", "foreach", "capturable", "differentiable")
# Hyper-parameters the command line sets: this run's values are kept over a checkpoint's
# (torch's load_state_dict, like apex's under Megatron-LM, would silently restore the saved
# ones). lr and weight_decay need no entry: the scheduler rewrites them at every step.
RUN_GROUP_KEYS = {"betas": "--adam-beta1/--adam-beta2", "eps": "--adam-eps",
                  "momentum": "--sgd-momentum"}
# A group key that only one optimizer kind has, and that kind's --optimizer value.
_KIND_KEYS = (("betas", "adam"), ("momentum", "sgd"))


def _kind(group: Dict) -> str:
    return next((kind for key, kind in _KIND_KEYS if key in group), "unknown")


def settle_groups(saved_groups: List[Dict], current_groups: List[Dict]
                  ) -> Tuple[List[Dict], List[str]]:
    """The saved parameter groups with this process's implementation switches and
    command-line hyper-parameters (`RUN_GROUP_KEYS`) put back, and one note per
    hyper-parameter whose saved value this run replaces. ValueError when the checkpoint
    holds another optimizer kind's state (Adam's in an SGD run, or the reverse)."""
    groups, notes = [], {}
    for saved, current in zip(saved_groups, current_groups):
        if "unknown" not in (_kind(saved), _kind(current)) and _kind(saved) != _kind(current):
            raise ValueError(
                f"the checkpoint's optimizer state is --optimizer {_kind(saved)}'s but this "
                f"run uses --optimizer {_kind(current)}: resume with --optimizer "
                f"{_kind(saved)}, or pass --no-load-optim to start the {_kind(current)} "
                "optimizer fresh from the loaded weights")
        saved = dict(saved)
        for key in LOCAL_GROUP_KEYS + tuple(RUN_GROUP_KEYS):
            if key not in current:
                continue
            if key in RUN_GROUP_KEYS and key in saved and key not in notes \
                    and _values(saved[key]) != _values(current[key]):
                notes[key] = (f"{RUN_GROUP_KEYS[key]}: using the command line's "
                              f"{_shown(current[key])}, not the checkpoint's "
                              f"{_shown(saved[key])}")
            saved[key] = current[key]
        groups.append(saved)
    return groups, list(notes.values())


def _values(value) -> tuple:
    return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else (float(value),)


def _shown(value) -> str:
    return " ".join(f"{v:g}" for v in _values(value))


_MISMATCH_FIX = ("the checkpoint was saved with another split of the parameters into groups "
                 "(which skip weight decay, which get an lr multiplier) or another model; "
                 "pass --no-load-optim to start the optimizer fresh from the loaded weights")


def check_saved_layout(saved_groups: List[Dict], saved_state: Dict,
                       current_groups: List[Dict]) -> None:
    """ValueError unless the saved groups hold as many parameters as this optimizer's, and
    every saved per-parameter tensor (Adam's moments, ...) has its parameter's shape: the
    state is matched to the parameters by position (torch's load_state_dict checks only
    the group sizes, and a moment of another shape fails later inside the step, or
    broadcasts)."""
    saved = [len(g["params"]) for g in saved_groups]
    current = [len(g["params"]) for g in current_groups]
    if saved != current:
        raise ValueError(
            f"the checkpoint's optimizer has parameter groups of {saved} parameters, this run's "
            f"of {current} (weight-decayed parameters first, then biases and 1-D ones): "
            + _MISMATCH_FIX)
    for g, (saved_group, group) in enumerate(zip(saved_groups, current_groups)):
        for i, (idx, param) in enumerate(zip(saved_group["params"], group["params"])):
            for key, value in saved_state.get(idx, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(
                        f"the checkpoint's optimizer state {key!r} of parameter {i} in group "
                        f"{g} has shape {tuple(value.shape)}, this run's parameter there has "
                        f"{tuple(param.shape)}: " + _MISMATCH_FIX)


def load_inner_state(optimizer: torch.optim.Optimizer, state_dict: Dict) -> List[str]:
    """`optimizer.load_state_dict`, tolerating apex-style state (step kept in the group)
    and keeping this process's implementation switches (fused/foreach) and command-line
    hyper-parameters (`settle_groups`, whose notes it returns)."""
    if "state" not in state_dict:
        raise ValueError(
            "the checkpoint's optimizer state holds no per-parameter state: it was saved with "
            "--use-distributed-optimizer (the state is in distrib_optim.pt); resume with that "
            "flag, or pass --no-load-optim to start the optimizer fresh from the loaded weights")
    check_saved_layout(state_dict["param_groups"], state_dict["state"], optimizer.param_groups)
    groups, notes = settle_groups(state_dict["param_groups"], optimizer.param_groups)
    state = {}
    for idx, param_state in state_dict["state"].items():
        param_state = dict(param_state)
        if "step" not in param_state and "exp_avg" in param_state:
            group = next((g for g in groups if idx in g["params"]), {})
            param_state["step"] = torch.tensor(float(group.get("step", 0)))
        state[idx] = param_state
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return notes


__all__ = ["LOCAL_GROUP_KEYS", "RUN_GROUP_KEYS", "check_saved_layout", "load_inner_state",
           "settle_groups"]
