"""Reading checkpoint files: this framework's own, and those Megatron-LM itself wrote.

Every checkpoint file is read with `torch.load(..., weights_only=True)`: tensors and plain
Python data only, never arbitrary code. This framework's files need nothing more. Files
written by Megatron-LM 23.05 pickle three kinds of objects besides: the `args` entry is an
`argparse.Namespace` (holding `model_type`, a `ModelType` enum member of Megatron's), and
the RNG state holds numpy's `np.random.get_state()` (a numpy array). Those, and only those,
are allowed on a second attempt (`MEGATRON_GLOBALS`); the enum is read into a stand-in of
the same name, so Megatron need not be installed.

`normalize_payload` then turns a Megatron-LM payload into the one this framework writes:
`args` as a dict of plain values (completed with the flags Megatron-LM 23.05 does not
have, at the values that are its behaviour: `complete_saved_args`), the nested model state (`language_model` ->
`embedding` / `encoder` / `output_layer`) as flat parameter names, and the counters that
Megatron keeps in `args` (consumed samples) as `train_state`. A payload of this framework's
own passes through unchanged. `megatron_payload` is the inverse, for
`tools/checkpoint_convert.py to-megatron`.
"""
from __future__ import annotations

import argparse
import copy
import functools
import pickle
import re
from typing import Dict, List, Optional

import numpy as np
import torch

from megatron.checkpoint_foreign import later_megatron_fix, later_megatron_names_message
from megatron.checkpoint_identity import split_distrib_identity
from megatron.checkpoint_plain import args_to_plain
from megatron.core.enums import ModelType  # the class 23.05 pickles, under its name

# Checkpoint versions whose QKV rows are per-head [q|k|v] blocks (Megatron-LM reorders
# the rows of versions 0 and 1 on load; this framework does not).
MIN_CHECKPOINT_VERSION = 2.0


def _numpy_globals() -> List[tuple]:
    """numpy's array-reconstruction globals under both module names numpy has used
    (`numpy.core` before 2.0, `numpy._core` since), so files of either load."""
    try:
        reconstruct = np._core.multiarray._reconstruct  # numpy >= 2
    except AttributeError:  # pragma: no cover - numpy 1.x
        reconstruct = np.core.multiarray._reconstruct
    out = [(reconstruct, f"{root}.multiarray._reconstruct")
           for root in ("numpy.core", "numpy._core")]
    out += [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    out += [(type(np.dtype(t)), f"numpy.dtypes.{type(np.dtype(t)).__name__}")
            for t in (np.uint32, np.int64, np.float64)]
    return out


def megatron_globals() -> List[tuple]:
    """The (object, pickled name) pairs a Megatron-LM 23.05 checkpoint file needs beyond
    weights_only's defaults: argparse.Namespace, ModelType (in either of the modules
    Megatron has kept it in), numpy's array reconstruction (the numpy RNG state)."""
    pairs = [(argparse.Namespace, "argparse.Namespace")]
    pairs += [(ModelType, f"{mod}.ModelType")
              for mod in ("megatron.core.enums", "megatron.model.enums")]
    return pairs + _numpy_globals()


def _torch_load(path: str, mmap: bool):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except RuntimeError as exc:
        if not mmap or "mmap" not in str(exc):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # legacy format


# torch's weights_only refusals of a pickled global: one that is not allow-listed
# ("Unsupported global: GLOBAL argparse.Namespace was not an allowed global by default")
# and one of a module never allowed ("Trying to load unsupported GLOBAL posix.system whose
# module posix is blocked": sys, os, posix, nt -- what a payload that runs commands pickles)
_UNSUPPORTED_RE = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_BLOCKED_RE = re.compile(r"unsupported GLOBAL ([\w.]+) whose module [\w.]+ is blocked")
# pickled globals that only later Megatron-LM releases put in a checkpoint file
_LATER_MEGATRON_GLOBALS = ("megatron.", "transformer_engine.", "_io.BytesIO")
_TORCH_BOILERPLATE = ("Weights only load failed", "Check the documentation",
                      "Please file an issue", "WeightsUnpickler error")


def torch_reason(exc: pickle.UnpicklingError) -> str:
    """torch's reason for refusing a weights_only load, without its advice around it
    (which is to load the file with weights_only=False: to run whatever it pickles)."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.strip().startswith(_TORCH_BOILERPLATE)]
    return lines[0] if lines else str(exc)


def refused_object(exc: pickle.UnpicklingError) -> str:
    """What a weights_only load refused: the pickled global's name ('posix.system'), else
    'object (torch's reason)'."""
    found = _UNSUPPORTED_RE.search(str(exc)) or _BLOCKED_RE.search(str(exc))
    return found.group(1) if found else f"object ({torch_reason(exc)})"


def _not_plain_data(path: str, exc: pickle.UnpicklingError) -> SystemExit:
    name = refused_object(exc)
    text = (f"error: checkpoint file {path} holds a pickled {name}, which is not plain data; "
            "checkpoint files are read without running pickled code (tensors, plain Python "
            "data and, from Megatron-LM 23.05, its argparse.Namespace, ModelType and numpy "
            "RNG state)")
    if name.startswith(_LATER_MEGATRON_GLOBALS):
        return SystemExit(
            f"{text}, and {name} is not in Megatron-LM 23.05's checkpoints: the file was "
            "written by a later release (Megatron-Core; _io.BytesIO is Transformer Engine's "
            "_extra_state), whose checkpoints this framework does not read. To use its "
            f"weights, {later_megatron_fix(None)}")
    return SystemExit(
        f"{text}, and unpickling this object could run any code. Re-save the file without "
        "that object, or do not use a file whose origin you do not trust.")


def _old_torch_message(path: str) -> str:
    return (f"error: checkpoint file {path} was written by Megatron-LM; reading it without "
            f"running pickled code takes torch >= 2.6 (torch.serialization.safe_globals with "
            f"(object, name) pairs), and this is torch {torch.__version__}: upgrade torch "
            "(requirements.txt)")


def _megatron_allowlist(path: str):
    """torch.serialization.safe_globals(megatron_globals()); SystemExit naming the torch
    version where this torch has no such context (2.4)."""
    allow = getattr(torch.serialization, "safe_globals", None)
    if allow is None:
        raise SystemExit(_old_torch_message(path))
    return allow(megatron_globals())


def load_checkpoint_file(path: str, mmap: bool = False):
    """One checkpoint file (model_optim_rng.pt, distrib_optim.pt), weights_only, read
    memory-mapped when `mmap` and the file allows. A file written by Megatron-LM is read
    with `megatron_globals()` allowed and normalised (`normalize_payload`).

    SystemExit naming the file and the object when it pickles anything else."""
    try:
        return _refuse_later_names(path, normalize_payload(_torch_load(path, mmap)))
    except pickle.UnpicklingError as exc:
        if _BLOCKED_RE.search(str(exc)):  # never allowed: no second attempt
            raise _not_plain_data(path, exc) from None
        if _UNSUPPORTED_RE.search(str(exc)) is None:
            raise
    try:
        with _megatron_allowlist(path):
            state = _torch_load(path, mmap)
    except AttributeError as exc:  # torch 2.5: the allowlist takes no (object, name) pairs
        if "'tuple' object" not in str(exc):
            raise
        raise SystemExit(_old_torch_message(path)) from None
    except pickle.UnpicklingError as exc:
        raise _not_plain_data(path, exc) from None
    return _refuse_later_names(path, normalize_payload(state))


def _refuse_later_names(path: str, state):
    """`state`, unless its model has the parameter names of a Megatron-LM release after
    23.05 (Megatron-Core's, later MoE's, the later legacy model's norms): SystemExit naming
    them and the way to the weights (megatron/checkpoint_foreign.py)."""
    if isinstance(state, dict):
        for key in [k for k in state if isinstance(k, str) and _is_model_key(k)
                    and isinstance(state[k], dict)]:
            message = later_megatron_names_message(path, state[key])
            if message is not None:
                raise SystemExit(message)
    return state


def flat_model_state(tree: dict, prefix: str = "") -> Dict[str, object]:
    """Megatron-LM's nested model state ({'language_model': {'embedding': {...}}}) as
    flat parameter names; a flat state comes back as it is. Non-tensor leaves are kept."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_model_state(value, name + "."))
        else:
            out[name] = value
    return out


def _is_model_key(key: str) -> bool:
    return key == "model" or re.fullmatch(r"model\d+", key) is not None


def _train_state_from_args(state: dict, args: dict) -> dict:
    """Megatron-LM keeps the consumed-sample counters in `args`; this framework in
    `train_state` (with the iteration)."""
    iteration = state.get("iteration", state.get("total_iters", 0))
    return {"iteration": int(iteration),
            "consumed_train_samples": int(args.get("consumed_train_samples") or 0),
            "consumed_valid_samples": int(args.get("consumed_valid_samples") or 0)}


def normalize_payload(state):
    """A model_optim_rng.pt payload written by Megatron-LM (its `args` an argparse
    Namespace) in this framework's form (see the module docstring). Anything else --
    this framework's payloads, distrib_optim.pt payloads -- comes back unchanged.
    SystemExit for a Megatron-LM checkpoint version older than 2.0."""
    if not isinstance(state, dict) or not isinstance(state.get("args"), argparse.Namespace):
        return state
    version = state.get("checkpoint_version", 0)
    if isinstance(version, (int, float)) and version < MIN_CHECKPOINT_VERSION:
        raise SystemExit(
            f"error: checkpoint version {version} stores the attention's query/key/value "
            f"rows in an older order; only versions >= {MIN_CHECKPOINT_VERSION} load here. "
            "Load and re-save it with Megatron-LM (any release from 2021 on) first.")
    state["args"] = complete_saved_args(args_to_plain(state["args"]))
    for key in [k for k in state if _is_model_key(k)]:
        state[key] = flat_model_state(state[key])
    if "iteration" not in state and "total_iters" in state:
        state["iteration"] = state["total_iters"]
    if "train_state" not in state:
        state["train_state"] = _train_state_from_args(state, state["args"])
    return state


def complete_saved_args(args: Dict) -> Dict:
    """A checkpoint's `args` with what Megatron-LM 23.05's own lack filled in, so that the
    model can be rebuilt from them (`megatron.checkpoint_reshard.config_from_args`): this
    framework's flags it never had take their defaults (which are Megatron-LM 23.05's
    behaviour: LayerNorm, no query groups, rotary base 10000, ...), and the values that
    validation derives (the position embedding type, the MLP activation, with its fused
    tanh GeLU) are derived the same way. This framework's own args come back unchanged."""
    from megatron.arguments_validate import activation_of
    from megatron.core.config import position_embedding_type_for

    out = dict(args)
    if "position_embedding_type" not in out and "add_position_embedding" in out:
        out["position_embedding_type"] = position_embedding_type_for(
            bool(out.get("use_rotary_position_embeddings")), bool(out["add_position_embedding"]))
    for key, value in _flag_defaults().items():
        out.setdefault(key, copy.deepcopy(value))
    if "activation" not in out:
        out["activation"] = activation_of(argparse.Namespace(**out))
    return out


@functools.lru_cache(maxsize=1)
def _flag_defaults() -> Dict[str, object]:
    from megatron.arguments import build_parser

    return args_to_plain(vars(build_parser().parse_args([])))


# ---------------------------------------------------------------- to Megatron-LM's form
def nest_model_state(flat: Dict[str, object]) -> dict:
    """Flat parameter names -> Megatron-LM's nested model state: `language_model` ->
    `embedding` -> `word_embeddings` -> `weight`, `encoder` -> flat names `layers.<i>...`
    and `final_layernorm.*`, `output_layer` -> `weight`; `word_embeddings_for_head` ->
    `weight`. The inverse of `flat_model_state`."""
    out: dict = {}
    for name, value in flat.items():
        parts = name.split(".")
        if parts[:2] == ["language_model", "encoder"]:
            out.setdefault("language_model", {}).setdefault("encoder", {})[
                ".".join(parts[2:])] = value
            continue
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def _dtype_from_name(value):
    if isinstance(value, str) and value.startswith("torch.") and \
            isinstance(getattr(torch, value[6:], None), torch.dtype):
        return getattr(torch, value[6:])
    return value


def _group_step(group: dict, per_param: Optional[dict]) -> Optional[int]:
    """The Adam step count of one saved group: its parameters' (torch keeps one per
    parameter), else the group's own (apex's, and the distributed optimizer's)."""
    if per_param is not None:
        steps = [int(per_param[i]["step"]) for i in group.get("params", ())
                 if "step" in per_param.get(i, {})]
        if steps:
            return max(steps)
    return int(group["step"]) if "step" in group else None


def apex_optimizer_state(opt: dict) -> dict:
    """An `optimizer` checkpoint entry (fp32, mixed or distributed: see
    megatron/checkpoint_reshard.py) with what Megatron-LM 23.05's Adam, apex FusedAdam,
    reads from each parameter group: "bias_correction" (a KeyError without it) and the
    step count as "step" (apex does not read torch's per-parameter step; without the
    group's its bias correction would start again from step 1). SGD groups are left as
    they are. The input is not modified."""
    opt = dict(opt)
    key = None if "state" in opt else next(
        (k for k in ("optimizer", "optimizer_state_dict") if isinstance(opt.get(k), dict)), None)
    inner = dict(opt if key is None else opt[key])
    if not isinstance(inner.get("param_groups"), list):
        return opt
    per_param = inner.get("state")
    groups = []
    for group in inner["param_groups"]:
        group = dict(group)
        if "betas" in group:
            step = _group_step(group, per_param)
            group.setdefault("bias_correction", True)
            if step:
                group["step"] = step
        groups.append(group)
    inner["param_groups"] = groups
    if key is None:
        return inner
    opt[key] = inner
    return opt


# Data-parallel sizes up to this one can load a distrib_optim.pt `megatron_distrib_payload`
# wrote (elements of padding it appends to every flat tensor, plus one).
MEGATRON_MAX_DP = 16384


def megatron_distrib_payload(state: dict) -> dict:
    """A distrib_optim.pt payload that Megatron-LM 23.05 loads with any data-parallel size
    up to MEGATRON_MAX_DP. Megatron-LM scatters each flat tensor in dp pieces of its own
    padded grad-buffer shard (the buffer rounded up to a multiple of its dp), so a tensor
    padded for another dp (this framework pads to the saving run's; `reshard` not at all)
    can be too short for it ("dp 3 needs 10027 each"); zeros are appended (padding is never
    read). The input is not modified; its identity record (checkpoint_identity.py), which
    Megatron-LM has no use for, is left out."""
    out = {}
    for chunk, by_dtype in split_distrib_identity(state)[0].items():
        out[chunk] = {dtype: {key: torch.cat([flat, flat.new_zeros(MEGATRON_MAX_DP - 1)])
                              for key, flat in flats.items()}
                      for dtype, flats in by_dtype.items()}
    return out


def megatron_payload(state: dict) -> dict:
    """This framework's model_optim_rng.pt payload as Megatron-LM 23.05 writes it: `args`
    an argparse.Namespace (dtype names as torch dtypes, the consumed-sample counters from
    `train_state`), the model state nested, the numpy RNG state with a numpy array, no
    `train_state`, the optimizer's groups as apex reads them (`apex_optimizer_state`).
    Everything it pickles loads without this framework installed."""
    out = {k: v for k, v in state.items() if k != "train_state"}
    args = {k: _dtype_from_name(v) for k, v in (state.get("args") or {}).items()}
    counters = state.get("train_state", {})
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        if key in counters:
            args[key] = int(counters[key])
    out["args"] = argparse.Namespace(**args)
    for key in [k for k in out if _is_model_key(k)]:
        out[key] = nest_model_state(out[key])
    if isinstance(out.get("optimizer"), dict):
        out["optimizer"] = apex_optimizer_state(out["optimizer"])
    if "rng_state" in out:
        out["rng_state"] = [dict(rng) for rng in out["rng_state"]]
        for rng in out["rng_state"]:
            name, keys, pos, has_gauss, cached = rng["np_rng_state"]
            keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
            rng["np_rng_state"] = (str(name), keys.astype(np.uint32), int(pos), int(has_gauss),
                                   float(cached))
    return out


__all__ = ["ModelType", "MIN_CHECKPOINT_VERSION", "megatron_globals", "load_checkpoint_file",
           "refused_object", "torch_reason",
           "flat_model_state", "normalize_payload", "complete_saved_args", "nest_model_state", "megatron_payload",
           "apex_optimizer_state", "megatron_distrib_payload", "MEGATRON_MAX_DP"]
