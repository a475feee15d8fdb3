"""Reading a saved checkpoint for resharding: `SourceCheckpoint` opens the shards of one
saved iteration (memory-mapped, when first needed) and gives any parameter's full (tp = pp
= 1) model tensor and optimizer state, reading for one target rank only the shard files
that hold parts of its slices (`needed_tp_ranks`, the stage map). The names, the optimizer
payloads it reads, and the target side that cuts the full tensors for another layout are
in megatron/checkpoint_reshard.py.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint_dirs import incomplete_checkpoint_message, model_file
from megatron.checkpoint_files import flat_model_state
from megatron.checkpoint_identity import (
    distrib_file_problem,
    file_identity,
    rank_file_problem,
    split_distrib_identity,
)
from megatron.checkpoint_layout import (
    DISTRIB_FILENAME,
    Layout,
    load_shard,
    model_keys,
    optimizer_kind,
    scan_layout,
)
from megatron.checkpointing import rank_dir_name
from megatron.core.models.gpt.stages import stage_layout
from megatron.core.optimizer.param_groups import default_no_weight_decay

EMBEDDING = "language_model.embedding.word_embeddings.weight"
TIED_COPY = "word_embeddings_for_head.weight"
_HALF = (torch.float16, torch.bfloat16)
_LAYER_RE = re.compile(r"^(language_model\.encoder\.layers\.)(\d+)(\..*)$")

Partition = Optional[Tuple[int, int]]  # (partition_dim, partition_stride); None: replicated
Target = Tuple[int, int, Tuple[int, ...]]  # (tp rank, tp size, full shape at tp 1)
ParamKey = Tuple[int, str]  # (chunk index, local name)


class OptimizerStateError(ValueError):
    """A checkpoint's optimizer state cannot be matched to the model's parameters.
    `problem` says why; str() adds the fix for a training run's load (the offline tools
    name their own: they write the model without it)."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; load it with its own layout, or with --no-load-optim")
        self.problem = problem


# -------------------------------------------------------------------------- tensor math
def merge_tp(shards: Sequence[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of the tensor-parallel split: each shard holds `stride` blocks along `dim`;
    the full tensor is block 0 of every rank, then block 1 of every rank, ..."""
    if len(shards) == 1:
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][b] for b in range(stride) for r in range(len(shards))], dim=dim)


def needed_tp_ranks(held: int, src_tp: int, full: int, rank: int, tp: int,
                    stride: int = 1) -> List[int]:
    """The source tp ranks (each holding `held` along the split dimension, `stride`
    blocks) with a part of target rank `rank`'s slice of a tensor `full` long there (tp
    `tp`). The split is the same within each of the `stride` blocks (a fused [gate; up]
    or interleaved layout), so the ranks are those of one block. Rows past the source's
    length (a vocabulary padded for more rows) repeat its last row: the last rank then.
    Sizes that do not divide: every rank (the cut reports them)."""
    if held % stride or full % (stride * tp):
        return list(range(src_tp))
    piece, want = held // stride, full // stride // tp
    lo, hi = rank * want, (rank + 1) * want
    end = min(hi, piece * src_tp)
    ranks = {s for s in range(src_tp) if s * piece < end and (s + 1) * piece > lo}
    if hi > piece * src_tp:
        ranks.add(src_tp - 1)
    return sorted(ranks)


def _merge(parts: Dict[int, torch.Tensor], tp: int, partition: Partition) -> torch.Tensor:
    """The full tensor from the tp shards in `parts` (rank -> shard), zeros (not stored:
    an expanded scalar) in place of those left out; a replicated tensor: its one copy."""
    if partition is None:
        return next(iter(parts.values()))
    ref = next(iter(parts.values()))
    zeros = ref.new_zeros(()).expand(ref.shape)
    return merge_tp([parts.get(t, zeros) for t in range(tp)], *partition)


def _layer_count(chunks: List[Dict[str, torch.Tensor]], c: int, iter_dir: str, p: int,
                 vpp: int) -> int:
    """The number of transformer layers in chunk `c` of a source file's chunks."""
    if c >= len(chunks):
        raise SystemExit(f"error: {iter_dir}: pipeline rank {p} holds {len(chunks)} model "
                         f"chunks, rank 0 holds {vpp}")
    return len({int(m.group(2)) for m in map(_LAYER_RE.match, chunks[c]) if m})


def global_name(local: str, layer_offset: int) -> str:
    """A chunk's parameter name in the one-process model (layers renumbered, the tied
    output copy named as the embedding)."""
    m = _LAYER_RE.match(local)
    if m:
        return f"{m.group(1)}{int(m.group(2)) + layer_offset}{m.group(3)}"
    return EMBEDDING if local == TIED_COPY else local


def flatten_state(tree: dict) -> Dict[str, torch.Tensor]:
    """Megatron's nested {'language_model': {'embedding': ...}} or flat keys -> flat keys
    (tensors only)."""
    return {k: v for k, v in flat_model_state(tree).items() if isinstance(v, torch.Tensor)}


def param_group_order(chunks: Sequence[Dict[str, torch.Tensor]]) -> List[List[ParamKey]]:
    """The parameters of saved chunk state dicts grouped as `get_param_groups` groups the
    live modules (default rules: decayed first, then biases and 1-D; empty groups left out)."""
    decayed, plain = [], []
    for c, sd in enumerate(chunks):
        for name, tensor in sd.items():
            (plain if default_no_weight_decay(name, tensor) else decayed).append((c, name))
    return [g for g in (decayed, plain) if g]


# -------------------------------------------------------------------------- the source
class SourceCheckpoint:
    """The shards of one saved iteration, memory-mapped when first needed; full tensors on
    demand.

    `model(name, partition)` and `optimizer_state(name, partition)` merge the tensor-
    parallel shards of one global parameter; given `target` (tp rank, tp size, full shape
    of the rank that wants it) they read only the shard files that hold part of that rank's
    slice (`needed_tp_ranks`) and leave zeros elsewhere, so a rank of another layout opens
    the files of its own layers and slices, not all tp x pp of them (at scale every rank
    opening every file was a start-up storm on the shared file system). Which pipeline
    stage holds a layer is computed from the saved arguments (`stage_layout`), checked
    against each file as it is opened.

    Attributes: `layout`, `args` (the saved arguments, {} when absent), `files[(tp_rank,
    pp_rank)]` (the raw payloads of the files opened so far), `num_layers`, `names` (global
    names in one-process module order: reads the first tp rank of every stage), `step`,
    `grad_scaler`. The optimizer state is read when first asked for (`optimizer_state`,
    `step`, ...), so a checkpoint whose optimizer state cannot be mapped (its files
    missing, another group split) still gives its model (--no-load-optim, --finetune, the
    tools). `layout` and `args`, when the caller has them (a training run's rank 0 read
    them), spare the first rank's file; `identity` is then that file's `file_identity`.
    Every file opened is checked against it (else against the first file opened), and
    each distrib_optim.pt against its model file when its optimizer state is read:
    SystemExit naming a file copied in from another checkpoint.
    """

    def __init__(self, iter_dir: str, layout: Optional[Layout] = None,
                 args: Optional[dict] = None, identity: Optional[dict] = None) -> None:
        self.iter_dir = iter_dir
        self._identity = identity  # what every file must share (checkpoint_identity.py)
        self.files: Dict[Tuple[int, int], dict] = {}
        self.param_files: Dict[Tuple[int, int], dict] = {}
        self._flat: Dict[Tuple[int, int], List[Dict[str, torch.Tensor]]] = {}
        if layout is None:
            tp, pp = scan_layout(iter_dir)
            self._tp, self._pp = tp, pp
            first = self.rank_file(0, 0)
            self.args = first.get("args") if isinstance(first.get("args"), dict) else {}
            # none missing of the sizes it was saved with, which stray directories leave
            tp, pp = scan_layout(iter_dir, self.args)
            self._tp, self._pp = tp, pp
            kind = optimizer_kind(first.get("optimizer"), (0, 0) in self.param_files)
            layout = Layout(tp, pp, max(len(self.chunks(0, 0)), 1), kind)
        else:
            self.args = args if isinstance(args, dict) else {}
            self._tp, self._pp = layout.tp, layout.pp
        self.layout = layout
        self._stages = self._stage_map()
        for (t, p), chunks in self._flat.items():
            self._check_stage(t, p, chunks)
        self.num_layers = sum(count for _, count in self._stages)
        self._rank_optim: Dict[Tuple[int, int], Dict[ParamKey, Dict[str, torch.Tensor]]] = {}
        self._common: Optional[Tuple[Optional[int], object, Dict[Tuple[float, float], dict]]] \
            = None
        self._names: Optional[List[str]] = None

    @property
    def step(self) -> Optional[int]:
        """The optimizer's step count (None: no optimizer state, or no step taken)."""
        return self._optimizer_common()[0]

    @property
    def grad_scaler(self):
        """The saved loss-scaler state (None: none saved)."""
        return self._optimizer_common()[1]

    @property
    def group_hypers(self) -> Dict[Tuple[float, float], dict]:
        """Saved group hyper-parameters by (wd_mult, lr_mult)."""
        return self._optimizer_common()[2]

    def check_complete(self) -> None:
        """SystemExit naming every source rank file that is missing (checked before a
        conversion announces its output; the files themselves are opened when needed)."""
        paths = [model_file(os.path.join(self.iter_dir, rank_dir_name(t, p, self._pp)))
                 for p in range(self._pp) for t in range(self._tp)]
        missing = [os.path.relpath(x, self.iter_dir) for x in paths if not os.path.isfile(x)]
        if missing:
            raise SystemExit(incomplete_checkpoint_message(
                self.iter_dir, missing, f"the directories say tp {self._tp} x pp {self._pp}"))

    # --- files, opened when first needed ---------------------------------------------------
    def rank_file(self, t: int, p: int) -> dict:
        """The payload of source rank (t, p) (and its distrib_optim.pt, when there is one)."""
        if (t, p) not in self.files:
            rank_dir = os.path.join(self.iter_dir, rank_dir_name(t, p, self._pp))
            path = model_file(rank_dir)
            if not os.path.isfile(path):
                raise SystemExit(incomplete_checkpoint_message(
                    self.iter_dir, [os.path.relpath(path, self.iter_dir)],
                    f"the directories say tp {self._tp} x pp {self._pp}"))
            state = load_shard(path)
            problem = rank_file_problem(state, path, self._identity)
            if problem:  # a file of another checkpoint: a model of mixed steps otherwise
                raise SystemExit(problem)
            if self._identity is None:
                self._identity = file_identity(state, path)
            self.files[t, p] = state
            extra = os.path.join(rank_dir, DISTRIB_FILENAME)
            if os.path.isfile(extra):  # checked against its model file when read
                self.param_files[t, p] = load_shard(extra)
        return self.files[t, p]

    def chunks(self, t: int, p: int) -> List[Dict[str, torch.Tensor]]:
        """The flat model state dicts of source rank (t, p), one per chunk (checked against
        the stage map once it is known)."""
        if (t, p) not in self._flat:
            state = self.rank_file(t, p)
            chunks = [flatten_state(state[m]) for m in model_keys(state)]
            if hasattr(self, "_stages"):
                self._check_stage(t, p, chunks)
            self._flat[t, p] = chunks
        return self._flat[t, p]

    @property
    def first(self) -> dict:
        """The payload of the first source rank opened so far (its non-model entries --
        iteration, counters, scheduler, loss scaler -- are those of every rank), with the
        arguments given to the constructor (the first rank's)."""
        if not self.files:
            self.rank_file(0, 0)
        state = self.files[min(self.files, key=lambda k: (k[1], k[0]))]
        if "args" in state and self.args:
            state = dict(state, args=self.args)
        return state

    def _stage_map(self) -> List[Tuple[int, int]]:
        """(first global layer, layer count) of each virtual stage s = chunk * pp + pp rank:
        from the saved arguments (Megatron splits the layers evenly), else read off the
        first tp rank of every stage."""
        pp, vpp, a = self.layout.pp, self.layout.vpp, self.args
        if isinstance(a.get("num_layers"), int):
            try:
                specs = [spec for p in range(pp) for spec in stage_layout(
                    a["num_layers"], pp, p, vpp if vpp > 1 else None,
                    bool(a.get("standalone_embedding_stage")))]
            except ValueError:
                specs = []
            if len(specs) == pp * vpp:
                specs.sort(key=lambda spec: spec.virtual_stage)
                return [(spec.layer_offset, spec.num_layers) for spec in specs]
        stages, offset = [], 0
        for s in range(pp * vpp):
            c, p = divmod(s, pp)
            count = _layer_count(self.chunks(0, p), c, self.iter_dir, p, vpp)
            stages.append((offset, count))
            offset += count
        return stages

    def _check_stage(self, t: int, p: int, chunks: List[Dict[str, torch.Tensor]]) -> None:
        """SystemExit when a file's chunks do not hold the layers the stage map gives them."""
        for c, (_, count) in enumerate(self._stages[p::self.layout.pp]):
            held = _layer_count(chunks, c, self.iter_dir, p, self.layout.vpp)
            if held != count:
                raise SystemExit(f"error: {self.iter_dir}: rank (tp {t}, pp {p}) chunk {c} "
                                 f"holds {held} layers, its arguments give the stage {count}")

    @property
    def names(self) -> List[str]:
        """Global names in one-process module order (opens the first tp rank of every
        pipeline stage)."""
        if self._names is None:
            names, pp = [], self.layout.pp
            for s, (offset, _) in enumerate(self._stages):
                c, p = divmod(s, pp)
                names += [global_name(local, offset) for local in self.chunks(0, p)[c]
                          if local != TIED_COPY]
            self._names = names
        return self._names

    def _locate(self, name: str, local_name: Optional[str] = None, t: int = 0
                ) -> Tuple[int, int, str]:
        """(pp rank, chunk, local name) of global parameter `name` in the source, checked in
        the file of source tp rank `t`. A target's tied output copy (`local_name`
        TIED_COPY) is read from the source's own copy on its last stage when it has one
        (both copies take the same steps), sparing the last stage the first one's files."""
        pp, last = self.layout.pp, len(self._stages) - 1
        m = _LAYER_RE.match(name)
        if m:
            g = int(m.group(2))
            s = next((s for s, (o, n) in enumerate(self._stages) if o <= g < o + n), None)
            found = None if s is None else \
                (s % pp, s // pp, f"{m.group(1)}{g - self._stages[s][0]}{m.group(3)}")
        elif local_name == TIED_COPY and last > 0 and \
                TIED_COPY in self.chunks(t, last % pp)[last // pp]:
            return last % pp, last // pp, TIED_COPY
        else:
            s = 0 if name.startswith("language_model.embedding.") else last
            found = (s % pp, s // pp, name)
        if found is not None and found[2] in self.chunks(t, found[0])[found[1]]:
            return found
        raise ValueError(f"the checkpoint in {self.iter_dir} has no parameter {name}; the "
                         "model flags differ from the saved run's (--use-checkpoint-args "
                         "copies them)")

    def _sources(self, name: str, partition: Partition, target: Optional[Target],
                 local_name: Optional[str]) -> Tuple[int, int, str, List[int]]:
        """(pp rank, chunk, local name, the source tp ranks to read) of `name` for `target`
        (None: every rank; a replicated parameter: the target's home rank alone, tp rank 0
        without a target -- Megatron keeps the copies equal over tp)."""
        tp = self.layout.tp
        home = 0 if target is None else target[0] * tp // target[1]
        p, c, local = self._locate(name, local_name, home)
        if partition is None:
            return p, c, local, [home]
        if target is None:
            return p, c, local, list(range(tp))
        dim, stride = partition
        held = self.chunks(home, p)[c][local].shape[dim]
        return p, c, local, needed_tp_ranks(held, tp, target[2][dim], target[0], target[1],
                                            stride)

    def model(self, name: str, partition: Partition, target: Optional[Target] = None,
              local_name: Optional[str] = None) -> torch.Tensor:
        """The full model tensor of global parameter `name` (the checkpoint's dtype); with
        `target` (tp rank, tp size, full shape), only the parts of that rank's slice are
        read, the rest is zeros. `local_name`: the target's name of it (see `_locate`)."""
        p, c, local, ranks = self._sources(name, partition, target, local_name)
        parts = {t: self.chunks(t, p)[c][local] for t in ranks}
        return _merge(parts, self.layout.tp, partition)

    def model_dtype(self, name: str, target: Optional[Target] = None,
                    local_name: Optional[str] = None) -> torch.dtype:
        """The dtype the checkpoint holds model parameter `name` in (`target`,
        `local_name`: as for `model`)."""
        p, c, local, ranks = self._sources(name, None, target, local_name)
        return self.chunks(ranks[0], p)[c][local].dtype

    def optimizer_state(self, name: str, partition: Partition, target: Optional[Target] = None,
                        local_name: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """{"param": full fp32 main weight, <state key>: full fp32 tensor} of `name`; the
        state keys are those the optimizer had created (none before the first step).
        `target`, `local_name`: as for `model`."""
        p, c, local, ranks = self._sources(name, partition, target, local_name)
        per_rank = {t: self._optimizer_of(t, p)[c, local] for t in ranks}
        return {key: _merge({t: e[key].float() for t, e in per_rank.items()}, self.layout.tp,
                            partition)
                for key in per_rank[ranks[0]] if key != "step"}

    # --- optimizer payloads --------------------------------------------------------------
    def _groups_of(self, t: int, p: int) -> List[dict]:
        opt = self.rank_file(t, p)["optimizer"]
        if self.layout.optimizer == "fp32":
            return opt["param_groups"]
        return opt.get("optimizer", opt.get("optimizer_state_dict"))["param_groups"]

    def _optimizer_common(self):
        """(step count, grad scaler, group hyper-parameters by (wd_mult, lr_mult)), read
        from every rank's optimizer state on first use; (None, None, {}) without one."""
        if self._common is not None:
            return self._common
        steps, hypers, scaler = [], {}, None
        if self.layout.optimizer is not None:
            for (t, p) in list(self.files):  # those opened: a target rank's own
                for group in self._groups_of(t, p):
                    hyper = {k: v for k, v in group.items() if k not in ("params", "step")}
                    hypers.setdefault(_group_key(group), hyper)
                    if "step" in group:
                        steps.append(int(group["step"]))
                for entry in self._optimizer_of(t, p).values():
                    if "step" in entry:
                        steps.append(int(entry["step"]))
            if self.layout.optimizer != "fp32":
                scaler = self.first["optimizer"].get("grad_scaler")
        self._common = (max(steps) if steps else None, scaler, hypers)
        return self._common

    def _optimizer_of(self, t: int, p: int) -> Dict[ParamKey, Dict[str, torch.Tensor]]:
        """(chunk, local name) -> {"param", state keys, maybe "step"} of source rank (t, p)."""
        if (t, p) not in self._rank_optim:
            kind = self.layout.optimizer
            if kind == "distributed":
                self._rank_optim[t, p] = self._distributed_entries(t, p)
            else:
                self._rank_optim[t, p] = self._indexed_entries(t, p, kind == "mixed")
        return self._rank_optim[t, p]

    def _indexed_entries(self, t: int, p: int, mixed: bool) -> Dict[ParamKey, dict]:
        chunks, opt = self.chunks(t, p), self.rank_file(t, p)["optimizer"]
        inner = opt.get("optimizer", opt.get("optimizer_state_dict")) if mixed else opt
        order, saved = param_group_order(chunks), inner["param_groups"]
        if [len(g) for g in order] != [len(g["params"]) for g in saved]:
            raise OptimizerStateError(
                f"{self.iter_dir} rank (tp {t}, pp {p}): optimizer groups of sizes "
                f"{[len(g['params']) for g in saved]} do not match the model's parameters "
                f"{[len(g) for g in order]} (custom weight-decay or lr-scaling rules?)")
        mains = (opt.get("fp32_from_fp16_params", opt.get("fp32_from_fp16")) if mixed else None)
        out = {}
        for g, (keys, group) in enumerate(zip(order, saved)):
            halves = iter(mains[g]) if mixed else iter(())
            for key, idx in zip(keys, group["params"]):
                weight = chunks[key[0]][key[1]]
                entry = dict(inner["state"].get(idx, {}))
                main = next(halves) if weight.dtype in _HALF else weight
                entry["param"] = main
                shapes = {k: tuple(v.shape) for k, v in entry.items()
                          if isinstance(v, torch.Tensor) and v.dim() > 0}
                if any(shape != tuple(weight.shape) for shape in shapes.values()):
                    raise OptimizerStateError(
                        f"{self.iter_dir} rank (tp {t}, pp {p}): the optimizer state "
                        f"{shapes} matched by position to {key[1]} does not have its shape "
                        f"{tuple(weight.shape)}: its groups hold other parameters than "
                        "Megatron's weight-decay split (custom weight-decay or lr-scaling "
                        "rules?)")
                out[key] = entry
        return out

    def _distributed_entries(self, t: int, p: int) -> Dict[ParamKey, dict]:
        self.rank_file(t, p)
        if (t, p) not in self.param_files:
            raise SystemExit(f"error: {self.iter_dir}: {DISTRIB_FILENAME} of rank (tp {t}, "
                             f"pp {p}) is missing; load with --no-load-optim")
        chunks = self.chunks(t, p)
        saved, record = split_distrib_identity(self.param_files[t, p])
        rank_dir = os.path.join(self.iter_dir, rank_dir_name(t, p, self._pp))
        problem = distrib_file_problem(record, os.path.join(rank_dir, DISTRIB_FILENAME),
                                       self.files[t, p], model_file(rank_dir))
        if problem:  # the optimizer state of another step
            raise SystemExit(problem)
        out = {}
        for c, sd in enumerate(chunks):
            flats_by_dtype = saved[c]
            offsets = dict.fromkeys(flats_by_dtype, 0)
            for local, weight in reversed(list(sd.items())):
                dtype = next(iter(offsets)) if len(offsets) == 1 else weight.dtype
                if dtype not in offsets:
                    raise OptimizerStateError(f"{self.iter_dir}: {DISTRIB_FILENAME} of rank "
                                              f"(tp {t}, pp {p}) chunk {c} has no {dtype} "
                                              f"buffer for {local}")
                start, n = offsets[dtype], weight.numel()
                out[c, local] = {k: v[start:start + n].view(weight.shape)
                                 for k, v in flats_by_dtype[dtype].items()}
                offsets[dtype] = start + n
        return out


def _group_key(group: dict) -> Tuple[float, float]:
    return float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0))
