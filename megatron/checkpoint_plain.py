"""Plain data for checkpoint files: RNG states and arguments that load with
`torch.load(..., weights_only=True)` (no numpy arrays, no argparse Namespace, no dtypes).

megatron/checkpointing.py re-exports these; it writes and reads the files.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import random
from pathlib import PurePath
from typing import Dict, Optional

import numpy as np
import torch


# ---------------------------------------------------------------------------------------
# RNG state (plain data only, so that it loads with weights_only=True)
def _numpy_state_to_plain(state) -> tuple:
    """np.random.get_state() with the key array as an int64 tensor (numpy arrays are not
    allowed by weights_only loading)."""
    name, keys, pos, has_gauss, cached = state
    return (str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()), int(pos),
            int(has_gauss), float(cached))


def _numpy_state_from_plain(state) -> tuple:
    name, keys, pos, has_gauss, cached = state
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy()
    return (name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))


def get_rng_state(tracker=None) -> Dict[str, object]:
    """This process's RNG states, Megatron's keys, as weights_only-loadable data.

    `tracker` is anything with `get_states()` (e.g. the CUDA RNG tracker of
    megatron.core.tensor_parallel.random); `cuda_rng_state` is None without CUDA.
    """
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": _numpy_state_to_plain(np.random.get_state()),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tracker.get_states() if tracker is not None else {},
    }


def _generator_kind(num_bytes: int) -> str:
    return {16: "CUDA", 5056: "CPU"}.get(num_bytes, f"{num_bytes}-byte")


def _runs_on_cuda(tracker) -> bool:
    """Whether this run draws its dropout masks on a CUDA generator: the tracker's device
    when it has one (a CPU run on a GPU host has a CPU tracker), else CUDA's presence."""
    device = getattr(tracker, "device", None)
    return device == "cuda" if device is not None else torch.cuda.is_available()


def set_rng_state(state: Dict[str, object], tracker=None) -> Optional[str]:
    """Restore states saved by `get_rng_state` (numpy arrays are accepted as well).

    The tracker (anything with `get_states()` / `set_states()`) is restored when the saved
    states are not empty and are states of its generator's kind: a checkpoint saved on
    GPUs (Megatron-LM's) holds CUDA generator states, which a CPU run's generator cannot
    take (nor a GPU run a CPU run's); those streams then keep their seeded states, as they
    do when the saved streams are empty (which Megatron-LM counts as missing). A CUDA
    state is restored only when CUDA is available; a CUDA run given a checkpoint without
    one (a CPU run's) keeps its CUDA generator's seeded state. Returns a note naming the
    states not restored, None when all were.
    """
    rs = state["random_rng_state"]
    random.setstate((rs[0], tuple(rs[1]), rs[2]))
    np.random.set_state(_numpy_state_from_plain(state["np_rng_state"]))
    torch.set_rng_state(state["torch_rng_state"])
    notes = []
    cuda_state = state.get("cuda_rng_state")
    if cuda_state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_state)
    elif cuda_state is None and _runs_on_cuda(tracker):
        notes.append("the checkpoint holds no CUDA generator state (saved by a CPU run): "
                     "this run's CUDA generator, which draws the dropout masks outside "
                     "tensor-parallel regions, is not restored and goes on from --seed")
    tracker_states = state.get("rng_tracker_states")
    if tracker is not None and tracker_states:
        notes.extend(_set_tracker_states(tracker, tracker_states))
    elif tracker is not None and tracker.get_states():  # Megatron-LM refuses these
        notes.append("the checkpoint holds no tensor-parallel RNG streams (empty "
                     "rng_tracker_states): this run's streams start from --seed (dropout inside "
                     "tensor-parallel regions draws other masks than the saving run's)")
    if not notes:
        return None
    return "; ".join(notes) + "; the other RNG states are restored"


def _set_tracker_states(tracker, tracker_states: Dict[str, torch.Tensor]) -> list:
    """Give the tracker the saved streams when they are its generator's kind; else leave
    it and return the note that says so ([] when restored)."""
    current = {name: s.numel() for name, s in tracker.get_states().items()}
    other = {name: s.numel() for name, s in tracker_states.items()
             if name in current and s.numel() != current[name]}
    if not other:
        tracker.set_states(tracker_states)
        return []
    saved, run = _generator_kind(next(iter(other.values()))), _generator_kind(
        current[next(iter(other))])
    return [f"the checkpoint's tensor-parallel RNG streams ({', '.join(sorted(other))}) "
            f"are {saved} generator states, which this run's {run} generator cannot "
            "take: they start from --seed (dropout inside tensor-parallel regions draws "
            "other masks than the saving run would have)"]


# ---------------------------------------------------------------------------------------
# Arguments as plain data
def args_to_plain(obj):
    """Recursively convert arguments to JSON-like data that loads with weights_only=True.

    dicts keep their keys (as str), tuples/lists/sets become lists, torch.dtype becomes
    its name (`"torch.bfloat16"`), paths become str, enums their value, dataclasses and
    argparse Namespaces dicts; other unknown objects become `str(obj)`.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): args_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [args_to_plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((args_to_plain(v) for v in obj), key=repr)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return args_to_plain(obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: args_to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, argparse.Namespace):
        return args_to_plain(vars(obj))
    return str(obj)


__all__ = ["get_rng_state", "set_rng_state", "args_to_plain"]
