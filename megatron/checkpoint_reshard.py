"""Resharding checkpoints between parallel layouts (the driver side of checkpointing).

A checkpoint saved with one layout -- tensor-parallel size tp, pipeline size pp, vpp
model chunks per pipeline rank, and one of three optimizer payloads -- is opened shard by
shard (memory-mapped, nothing is read until asked for), and any parameter comes back as
its full (tp = pp = 1) tensor: the model weight, the fp32 main weight and the optimizer
state (Adam's exp_avg / exp_avg_sq, the step). Full tensors are then cut for any other
layout; for one target rank only the shard files holding parts of its slices are read
(`needed_tp_ranks`, the stage map), the rest of a full tensor is left zero:

    src = SourceCheckpoint(iter_dir)               the shards of one saved iteration
    plan = plan_rank(chunks, offsets, tp, rank)    what one target rank holds (its modules)
    payload = build_rank_payload(src, plan, kind)  that rank's model_optim_rng.pt contents
                                                   (+ distrib_optim.pt for the distributed
                                                   optimizer)

Names: a parameter's *global name* is its key in the one-process model
(`language_model.encoder.layers.<global index>...`); the last pipeline stage's tied copy
`word_embeddings_for_head.weight` is the same parameter as the input word embedding
(both copies take identical optimizer steps, so either copy gives the other's state: a
target's tied copy is read from the saved last stage's copy, when there is one).

Optimizer payloads (megatron/core/optimizer):
  fp32         the torch state_dict {"state": {idx: {step, exp_avg, ...}}, "param_groups"}
  mixed        {"optimizer": <torch state_dict>, "grad_scaler", "fp32_from_fp16_params"}
  distributed  {"optimizer": {"param_groups": [... with "step"]}, "grad_scaler"}, and
               distrib_optim.pt {chunk: {grad_dtype: {"param", "exp_avg", ...}}}: flat
               fp32 tensors, a chunk's parameters back to back in reverse module order.
`idx` counts parameters in get_param_groups order over the rank's chunks (decayed
parameters first, then biases and 1-D parameters), which is recomputed here from the
saved state dicts. A vocabulary padded for another tp size is cut, or padded with copies
of its last row (the extra rows are padding tokens; see `_fit_vocab`). RNG states are per
rank: they are kept only when tp and pp are unchanged.

The layout of a saved iteration (tp, pp, chunks, optimizer kind) is read by
megatron/checkpoint_layout.py, whose functions are re-exported here. The source side
(`SourceCheckpoint`, the tp merge, global names) is megatron/checkpoint_source.py; this
module holds the target side (`plan_rank`, `build_rank_payload`) and finds a checkpoint.

Used by megatron/trainer_checkpoint.py (resharding on load), `tools/checkpoint_convert.py
reshard` (offline), `tools/generate.py` and megatron/hf_convert.py (one-process model), and
megatron/arguments_checkpoint.py (`--use-checkpoint-args`).
"""
from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from megatron.checkpoint_dirs import malformed_tracker_message, missing_iteration_dir_message
from megatron.checkpoint_files import complete_saved_args
from megatron.checkpoint_foreign import deepspeed_message
from megatron.checkpoint_layout import (  # noqa: F401 (the layout functions re-exported)
    DISTRIB_FILENAME,
    Layout,
    inspect_checkpoint,
    live_optimizer_kind,
    load_shard,
    model_keys,
    needs_resharding,
    optimizer_kind,
    read_layout,
    scan_layout,
)
from megatron.checkpoint_source import (
    _HALF,
    EMBEDDING,
    OptimizerStateError,
    ParamKey,
    Partition,
    SourceCheckpoint,
    Target,
    global_name,
)
from megatron.checkpointing import (
    iteration_dir_name,
    list_checkpoints,
    missing_tracker_message,
    read_tracker,
    tracker_path,
)
from megatron.core.optimizer.param_groups import get_param_groups
from megatron.core.tensor_parallel.layers import shard_of_full_weight

VOCAB_PARAMS = (EMBEDDING, "language_model.output_layer.weight")


# -------------------------------------------------------------------------- the target
@dataclass
class RankPlan:
    """What one rank of the target layout holds, read off its model chunks."""

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    chunks: List[List[Tuple[str, str]]]  # per chunk: (local name, global name), module order
    partition: Dict[str, Partition]  # global name -> how tp splits it
    full_shapes: Dict[str, Tuple[int, ...]]  # global name -> shape at tp 1
    dtypes: Dict[ParamKey, torch.dtype]  # model parameter dtypes
    groups: List[Tuple[Tuple[float, float], List[ParamKey]]]  # get_param_groups order
    buffers: List[Dict[torch.dtype, List[str]]]  # per chunk: grad dtype -> buffer order

    @property
    def num_params(self) -> int:
        return sum(len(c) for c in self.chunks)


def plan_rank(modules: Sequence[torch.nn.Module], layer_offsets: Sequence[int], tp_size: int,
              tp_rank: int, pp: Tuple[int, int] = (1, 0), module_tp_size: Optional[int] = None,
              grad_dtype_of: Optional[Callable[[torch.Tensor], torch.dtype]] = None) -> RankPlan:
    """The plan of one target rank from its model chunks: live modules (built with
    `module_tp_size`, default `tp_size`) or modules built on the meta device with tp 1.
    `pp` is (pp_size, pp_rank); `grad_dtype_of(param)` gives the dtype of the grad buffer a
    parameter sits in (distributed optimizer; default: the parameter's dtype)."""
    module_tp = tp_size if module_tp_size is None else module_tp_size
    grad_dtype_of = grad_dtype_of or (lambda prm: prm.dtype)
    chunks, partition, shapes, dtypes, buffers, where = [], {}, {}, {}, [], {}
    for c, (module, offset) in enumerate(zip(modules, layer_offsets)):
        params = [(n, q) for n, q in module.named_parameters() if q.requires_grad]
        chunks.append([(local, global_name(local, offset)) for local, _ in params])
        for (local, prm), (_, name) in zip(params, chunks[-1]):
            split = None
            if getattr(prm, "tensor_model_parallel", False):
                split = (int(prm.partition_dim), int(getattr(prm, "partition_stride", 1)))
            shape = list(prm.shape)
            if split is not None:
                shape[split[0]] *= module_tp
            partition[name], shapes[name] = split, tuple(shape)
            dtypes[c, local] = prm.dtype
            where[id(prm)] = (c, local)
        by_dtype: Dict[torch.dtype, List[str]] = {}
        for local, prm in reversed(params):
            by_dtype.setdefault(grad_dtype_of(prm), []).append(local)
        buffers.append(by_dtype)
    groups = [((float(g["wd_mult"]), float(g["lr_mult"])), [where[id(q)] for q in g["params"]])
              for g in get_param_groups(list(modules))]
    return RankPlan(tp_size, tp_rank, pp[0], pp[1], chunks, partition, shapes, dtypes, groups,
                    buffers)


def _fit_vocab(name: str, full: torch.Tensor, shape: Tuple[int, ...], notes: Set[str],
               weights: bool = True):
    """`full` cut or padded along the vocabulary rows to `shape` (embedding and output
    layer only: the rows past the tokenizer's vocabulary are padding). ValueError for any
    other shape difference.

    Added rows of `weights` (the model's, the optimizer's main copy) repeat the last row,
    as Megatron-LM's tools/checkpoint_util.py pads: the padding rows enter the softmax of
    the training and validation loss, and a zero row scores every hidden state 0, which
    can outweigh a trained model's logits -- the loss would jump on a load at another tp
    size. The last row is a trained padding row whenever the checkpoint had padding; its
    logits were pushed down by training. Other tensors (Adam's moments) get zero rows."""
    if tuple(full.shape) == tuple(shape):
        return full
    if name in VOCAB_PARAMS and full.dim() == len(shape) and full.shape[1:] == shape[1:]:
        rows = shape[0]
        notes.add(f"padded vocabulary {full.shape[0]} -> {rows} rows")
        if full.shape[0] > rows:
            return full[:rows]
        extra = (rows - full.shape[0], *full.shape[1:])
        fill = full[-1:].expand(extra) if weights else full.new_zeros(extra)
        return torch.cat([full, fill])
    raise ValueError(f"parameter {name}: the checkpoint holds shape {tuple(full.shape)} but this "
                     f"model needs {tuple(shape)} (at tensor-parallel size 1); the model flags "
                     "differ from the saved run's (--use-checkpoint-args copies them)")


def _cut(plan: RankPlan, name: str, full: torch.Tensor, notes: Set[str],
         weights: bool = True) -> torch.Tensor:
    """This rank's own copy of its tensor-parallel slice of a full tensor (`weights`:
    a parameter, not an optimizer moment: see `_fit_vocab`)."""
    full = _fit_vocab(name, full, plan.full_shapes[name], notes, weights)
    split = plan.partition[name]
    if split is None or plan.tp_size == 1:
        return full.clone()
    return shard_of_full_weight(full, split[0], split[1], plan.tp_rank, plan.tp_size)


def _target(plan: RankPlan, name: str) -> Target:
    """What `SourceCheckpoint.model` needs to read only this rank's parts of `name`."""
    return plan.tp_rank, plan.tp_size, plan.full_shapes[name]


def _shard_shape(plan: RankPlan, name: str) -> Tuple[int, ...]:
    """The shape of this rank's slice of parameter `name` (what `_cut` returns)."""
    shape = list(plan.full_shapes[name])
    split = plan.partition[name]
    if split is not None and plan.tp_size > 1:
        shape[split[0]] //= plan.tp_size
    return tuple(shape)


def _hyper(src: SourceCheckpoint, key: Tuple[float, float]) -> dict:
    """Saved hyper-parameters of the optimizer group with (wd_mult, lr_mult) `key`."""
    if key in src.group_hypers:
        return dict(src.group_hypers[key])
    if not src.group_hypers:
        raise OptimizerStateError(f"{src.iter_dir}: the optimizer state has no parameter groups")
    hyper = dict(next(iter(src.group_hypers.values())))
    hyper["wd_mult"], hyper["lr_mult"] = key
    return hyper


def build_rank_payload(src: SourceCheckpoint, plan: RankPlan, optimizer: Optional[str],
                       notes: Optional[Set[str]] = None) -> Tuple[dict, Optional[dict]]:
    """(model_optim_rng.pt payload, distrib_optim.pt payload or None) of one target rank.

    The payload holds the model chunks (cast to the plan's dtypes), the optimizer in the
    `optimizer` kind ("fp32" | "mixed" | "distributed"; None or a source without optimizer
    state: left out), RNG states when tp and pp are unchanged, and everything else of the
    source's first file (args, iteration, counters, scheduler). Conversions that changed
    values (vocabulary padding) are added to `notes`."""
    notes = set() if notes is None else notes
    models = []
    for c, names in enumerate(plan.chunks):
        models.append({local: _cut(plan, name, src.model(name, plan.partition[name],
                                                          _target(plan, name), local), notes)
                       .to(plan.dtypes[c, local]) for local, name in names})
    first = src.first
    skip = set(model_keys(first)) | {"optimizer", "rng_state"}
    payload = {k: v for k, v in first.items() if k not in skip}
    payload.update({"model": models[0]} if len(models) == 1 else
                   {f"model{i}": m for i, m in enumerate(models)})
    if (src.layout.tp, src.layout.pp) == (plan.tp_size, plan.pp_size):
        rng = src.rank_file(plan.tp_rank, plan.pp_rank).get("rng_state")
        if rng is not None:
            payload["rng_state"] = rng
    distrib = None
    if optimizer is not None and src.layout.optimizer is not None:
        payload["optimizer"], distrib = _optimizer_payload(src, plan, optimizer, notes, models)
    return payload, distrib


def _optimizer_payload(src: SourceCheckpoint, plan: RankPlan, kind: str, notes: Set[str],
                       models: List[dict]) -> Tuple[dict, Optional[dict]]:
    """The optimizer payloads; an fp32 parameter of `models` whose checkpoint weight was
    bf16/fp16 takes the saved fp32 main weight instead (what the optimizer state belongs
    to: a run that drops --bf16 goes on from the weights, not their rounded copy)."""
    per_param: Dict[ParamKey, Dict[str, torch.Tensor]] = {}
    shapes: Dict[ParamKey, Tuple[int, ...]] = {}
    for c, names in enumerate(plan.chunks):
        for local, name in names:
            full = src.optimizer_state(name, plan.partition[name], _target(plan, name), local)
            if "param" in full and plan.dtypes[c, local] == torch.float32 and \
                    src.model_dtype(name, _target(plan, name), local) in _HALF:
                models[c][local] = _cut(plan, name, full["param"], notes)
            if kind == "fp32":  # the model weights are the main weights: no copy of them
                full.pop("param", None)
            per_param[c, local] = {k: _cut(plan, name, v, notes, weights=k == "param")
                                   for k, v in full.items()}
            shapes[c, local] = _shard_shape(plan, name)
    keys = sorted({k for entry in per_param.values() for k in entry if k != "param"})
    for key, entry in per_param.items():  # a parameter without state (never stepped): zeros
        for k in keys:
            entry.setdefault(k, torch.zeros(shapes[key], dtype=torch.float32))
    hypers = [_hyper(src, key) for key, _ in plan.groups]
    step = src.step or 0
    scaler = {} if src.grad_scaler is None or kind == "fp32" else {"grad_scaler": src.grad_scaler}
    if kind == "distributed":
        groups = [dict(h, step=step) for h in hypers]
        return {"optimizer": {"param_groups": groups}, **scaler}, \
            _flat_buffers(plan, per_param, ["param"] + keys)
    state, groups, idx = {}, [], 0
    for hyper, (_, members) in zip(hypers, plan.groups):
        ids = list(range(idx, idx + len(members)))
        for i, key in zip(ids, members):
            entry = {k: per_param[key][k] for k in keys}
            if "exp_avg" in entry:
                entry["step"] = torch.tensor(float(step))
            if entry:
                state[i] = entry
        groups.append(dict(hyper, params=ids))
        idx += len(members)
    torch_state = {"state": state, "param_groups": groups}
    if kind == "fp32":
        return torch_state, None
    mains = [[per_param[k]["param"] for k in members if plan.dtypes[k] in _HALF]
             for _, members in plan.groups]
    return {"optimizer": torch_state, **scaler, "fp32_from_fp16_params": mains}, None


def _flat_buffers(plan: RankPlan, per_param: Dict[ParamKey, Dict[str, torch.Tensor]],
                  keys: List[str]) -> dict:
    """distrib_optim.pt: per chunk and grad dtype, the parameters back to back in buffer
    order (no padding: it loads with any data-parallel size)."""
    out = {}
    for c, by_dtype in enumerate(plan.buffers):
        out[c] = {dtype: {k: torch.cat([per_param[c, local][k].reshape(-1) for local in names])
                          for k in keys}
                  for dtype, names in by_dtype.items()}
    return out


# ----------------------------------------------------------------------- finding and args
def locate_iteration(load: str, iteration: Optional[int] = None,
                     note: Callable[[str], None] = print) -> Tuple[str, int, bool]:
    """(iteration directory, iteration, release) under `load`: the tracker's iteration
    unless `iteration` is given. SystemExit naming the path when there is none. When only
    its `.old` copy is there (a re-save or `reshard --overwrite` interrupted between moving
    the old directory aside and the new one into place), that complete copy is the
    directory, read where it is (`note` says so; a training run's --load renames it back)."""
    release, given = False, iteration is not None
    if iteration is None:
        try:
            iteration, release = read_tracker(load)
        except ValueError as exc:
            raise SystemExit(malformed_tracker_message(load, exc)) from None
        if iteration is None:
            raise SystemExit(f"error: {missing_tracker_message(load)}")
    iter_dir = os.path.join(load, iteration_dir_name(iteration, release))
    if not os.path.isdir(iter_dir) and os.path.isdir(iter_dir + ".old"):
        note(f"note: {iter_dir} is missing but {iter_dir}.old is there (an interrupted save "
             f"that was replacing it): reading that copy; `mv {shlex.quote(iter_dir)}.old "
             f"{shlex.quote(iter_dir)}` puts it back (a training run with --load does it)")
        return iter_dir + ".old", iteration, release
    if not os.path.isdir(iter_dir):
        deepspeed = deepspeed_message(load)
        if deepspeed is not None:  # Megatron-DeepSpeed's tracker names its global_stepN/
            raise SystemExit(missing_iteration_dir_message(load, iteration, release))
        source = "--iteration" if given else tracker_path(load)
        raise SystemExit(f"error: checkpoint directory {iter_dir} (from {source}) does not "
                         f"exist; the checkpoints under {load}: "
                         f"{', '.join(list_checkpoints(load)) or 'none'}")
    return iter_dir, iteration, release


_DTYPES = {"torch.float32": torch.float32, "torch.float16": torch.float16,
           "torch.bfloat16": torch.bfloat16}


def config_from_args(args: dict, **overrides):
    """The run's `Config` rebuilt from a checkpoint's plain `args`, as one process (tp = pp
    = dp = 1, no sequence parallelism, no compile, meta-friendly init) with `overrides`
    (e.g. padded_vocab_size) applied last. The padded vocabulary stays the checkpoint's."""
    from megatron.arguments import build_config

    values = complete_saved_args(args)
    values.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  data_parallel_size=1, world_size=1, sequence_parallel=False,
                  virtual_pipeline_model_parallel_size=None, compile_layers=False,
                  recompute_granularity=None, use_cpu_initialization=False, rank=0)
    values.update(overrides)
    values["params_dtype"] = _DTYPES.get(str(values.get("params_dtype")), torch.float32)
    try:
        return build_config(argparse.Namespace(**values))
    except AttributeError as exc:
        raise SystemExit(f"error: the checkpoint's args lack a value ({exc}); it was written "
                         "by an older or different program") from None


def full_model_state(src: SourceCheckpoint, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict of a one-process `model` (tp 1, any device, meta included) merged from
    every shard of `src`, using each parameter's partition_dim / partition_stride.
    SystemExit when the checkpoint does not hold exactly the model's parameters."""
    plan = plan_rank([model], [0], 1, 0)
    names = {name for _, name in plan.chunks[0]}
    saved = set(src.names)
    missing = [n for n in names if n not in saved]
    unexpected = [n for n in src.names if n not in names]
    if missing or unexpected:
        raise SystemExit(f"error: checkpoint does not match the model its args describe; "
                         f"missing: {sorted(missing)[:5]}, unexpected: {unexpected[:5]}")
    return {local: src.model(name, plan.partition[name]).clone()
            for local, name in plan.chunks[0]}
