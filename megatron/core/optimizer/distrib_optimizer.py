"""The distributed optimizer: fp32 main parameters and optimizer state sharded over the
data-parallel (DP) ranks (ZeRO stage 1/2, Megatron's `--use-distributed-optimizer`).

It works on the grad buffers of `megatron.core.distributed.DistributedDataParallel` built
with `use_distributed_optimizer=True`. Each bucket of a buffer is padded to a multiple of
dp_size; DP rank r owns shard r of every bucket (`Bucket.shard_range`). For every model
parameter that intersects this rank's shard the optimizer holds one fp32 main parameter
for the intersection only (a view of the bucket's fp32 `main_data`; for fp32 model
parameters `main_data` is the shard of the bucket's `param_data` itself, so no copy).
Optimizer state (Adam's exp_avg / exp_avg_sq) exists only for those shards: about
12 / dp bytes per parameter instead of 12.

One step, and its collectives:
  1. (DDP.finish_grad_sync, before the step) reduce-scatter of every bucket over DP:
     this rank's shard holds the DP-averaged gradient.
  2. main grads = views of the shard of the fp32 grad buffer (a copy when it is fp16/bf16).
  3. with a loss scaler: unscale, found-inf flag all-reduced (MAX) over the whole world;
     an overflow skips the step.
  4. clip: the squared norms of this rank's shards (TP duplicates and shared copies left
     out, see clip_grads) are all-reduced (SUM) over the whole world, so every element of
     every replica-distinct parameter counts exactly once. Zero counting likewise.
  5. inner step on the shards; fp16/bf16 shards are copied into the bucket's
     `param_data`; 6. all-gather of every bucket's `param_data` over DP (asynchronous
     with `overlap_param_gather`: the next forward waits per module).

With the Triton AdamW kernel (`--adam-kernel auto|triton`, multi_tensor_adam.py; CUDA, or
the CPU interpreter in tests) steps 2-5 are `MixedPrecisionOptimizer._buffer_step`: the
kernel reads each shard's gradient where the reduce-scatter left it (the fp32 buffer, or
the 16-bit one: no fp32 copy), and writes each updated main shard both to `main_data`
and, in the same pass, to its slice of the bucket's 16-bit `param_data` shard (no copy
pass; an fp32 model's `main_data` is that shard already). The grad norm is reduced over
the whole world as in step 4; with a loss scaler the found-inf flag is that world-reduced
norm being non-finite (one all-reduce instead of two; any rank's inf or NaN makes the
sum non-finite everywhere), the loss scale and the clip coefficient fold into the
kernel's divisor, and an overflow skips the step on every rank before anything is
written. Then step 6 as above. Every rank must take the same path (the two reduce
different things), so the kernel is used only when the decision cannot differ between
ranks: one grad-buffer dtype. `--adam-kernel torch` keeps the steps above.

Checkpoint: `state_dict()` holds what is not sharded (param groups without their
parameters, with the step count; the grad scaler) and goes into `model_optim_rng.pt`
under 'optimizer'. `get_parameter_state()` gathers the shards onto DP rank 0 as
`{chunk_idx: {grad_dtype: {"param", "exp_avg", "exp_avg_sq"}}}` (Megatron's
`distrib_optim.pt`): flat fp32 CPU tensors, the parameters of that grad buffer back to back
in buffer order (the model's parameters reversed), zero padded at the end to a multiple of
the saving run's dp_size. The layout does not depend on dp_size or the bucket size, so a
checkpoint saved with one dp_size loads with another (`load_parameter_state`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.optimizer.grad_scaler import MegatronGradScaler, load_scaler_state
from megatron.core.optimizer.inner_state import (
    LOCAL_GROUP_KEYS,
    load_inner_state,
    settle_groups,
)
from megatron.core.optimizer.optimizer import (
    _COPIED_ATTRIBUTES,
    MixedPrecisionOptimizer,
    StepResult,
)
from megatron.core.timing import TimerHook, timed

# Per-parameter state tensors (shaped like the parameter) that distrib_optim.pt holds.
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
# Elements per rank in one gather message when the state is collected for a checkpoint.
GATHER_CHUNK = 1 << 24


class _ShardEntry:
    """One model parameter's part of this rank's shard of a bucket."""

    __slots__ = ("param", "main", "start", "end", "canonical_start")

    def __init__(self, param, main, start: int, end: int, canonical_start: int) -> None:
        self.param = param                      # the model parameter
        self.main = main                        # fp32 main parameter (1-D view of main_data)
        self.start, self.end = start, end       # in main_data (shard-relative)
        self.canonical_start = canonical_start  # of main[0] in the checkpoint layout


class _BucketShard:
    """This rank's shard of one bucket: fp32 main data and its parameter entries."""

    def __init__(self, bucket, canonical_offset: int) -> None:
        self.bucket = bucket
        lo, hi = bucket.shard_range
        self.numel = hi - lo
        shard = bucket.shard(bucket.param_data)
        self.model_shard = shard                       # this rank's part of param_data
        self.grad_shard = bucket.shard(bucket.grad_data)
        self.aliased = shard.dtype == torch.float32
        self.main_data = shard if self.aliased else shard.detach().float()
        self.entries: List[_ShardEntry] = []
        self.canonical_start = canonical_offset
        canonical = canonical_offset
        for p in bucket.params:
            start, end = bucket.param_ranges[p]
            a, b = max(start, lo), min(end, hi)
            if a < b:
                main = torch.nn.Parameter(self.main_data[a - lo:b - lo])
                for attr in _COPIED_ATTRIBUTES:
                    if hasattr(p, attr):
                        setattr(main, attr, getattr(p, attr))
                self.entries.append(_ShardEntry(p, main, a - lo, b - lo, canonical + a - start))
            canonical += end - start
        self.canonical_end = canonical

    def set_main_grads(self) -> None:
        grad = self.grad_shard
        if grad.dtype != torch.float32:
            grad = grad.float()
        for e in self.entries:
            e.main.grad = grad[e.start:e.end]

    def flat_state(self, optimizer: torch.optim.Optimizer, key: str) -> torch.Tensor:
        """This shard's `key` ("param" or a state key) as one flat fp32 tensor."""
        if key == "param":
            return self.main_data.detach().float()
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.main_data.device)
        for e in self.entries:
            value = optimizer.state.get(e.main, {}).get(key)
            if value is not None:
                flat[e.start:e.end] = value.reshape(-1)
        return flat


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Mixed-precision optimizer whose main parameters and state are DP-sharded.

    Args:
        param_groups: the model's groups (`get_param_groups`, lr / weight_decay set).
        chunk_buckets: per model chunk, `{grad_dtype: [buckets in buffer order]}` of the
            DDP wrappers built with `use_distributed_optimizer=True`.
        build_inner: builds the torch optimizer from groups of main (shard) parameters.
        clip_grad, log_num_zeros_in_grad: as for the other wrappers.
        grad_group: group the grad norm, zero count and found-inf flag are reduced over;
            the whole world (None for a single process).
        tp_rank: for the "count TP-replicated parameters once" rule.
        grad_scaler: loss scaler or None.
    """

    def __init__(self, param_groups: List[Dict], chunk_buckets: List[Dict[torch.dtype, list]],
                 build_inner: Callable[[List[Dict]], torch.optim.Optimizer], clip_grad: float,
                 log_num_zeros_in_grad: bool, grad_group=None, tp_rank: int = 0,
                 grad_scaler: Optional[MegatronGradScaler] = None) -> None:
        self.chunk_shards: List[Dict[torch.dtype, List[_BucketShard]]] = []
        self.buffer_numel: List[Dict[torch.dtype, int]] = []
        for buckets_by_dtype in chunk_buckets:
            shards, sizes = {}, {}
            for dtype, buckets in buckets_by_dtype.items():
                shards[dtype], offset = [], 0
                for bucket in buckets:
                    shards[dtype].append(_BucketShard(bucket, offset))
                    offset = shards[dtype][-1].canonical_end
                sizes[dtype] = offset
            self.chunk_shards.append(shards)
            self.buffer_numel.append(sizes)
        self.shards = [s for c in self.chunk_shards for ss in c.values() for s in ss]
        first = next(iter(self.shards), None)
        self.dp_group = first.bucket.dp_group if first is not None else None
        self.dp_size = first.bucket.dp_size if first is not None else 1
        self._comm_device = first.bucket.grad_data.device if first else torch.device("cpu")
        inner = build_inner(self._shard_groups(param_groups))
        super().__init__(inner, clip_grad, log_num_zeros_in_grad, grad_group, tp_rank,
                         grad_scaler)
        self._loaded_step: Optional[int] = None
        self._views_checked = False
        self._grad_views: List[torch.Tensor] = []  # per main shard, for the Triton kernel

    def _shard_groups(self, param_groups: List[Dict]) -> List[Dict]:
        """The model's groups with each parameter replaced by its shard(s) on this rank
        (groups may be empty; all ranks keep the same groups)."""
        main_of = {}
        for shard in self.shards:
            for e in shard.entries:
                main_of[e.param] = e.main
        in_buckets = {p for s in self.shards for p in s.bucket.params}
        groups = []
        for group in param_groups:
            missing = [tuple(p.shape) for p in group["params"] if p not in in_buckets]
            if missing:
                raise ValueError(
                    f"parameters of shapes {missing} are not in a grad buffer of a "
                    "DistributedDataParallel built with use_distributed_optimizer=True; wrap "
                    "every model chunk in it before building the optimizer")
            mains = [main_of[p] for p in group["params"] if p in main_of]
            groups.append({**group, "params": mains})
        return groups

    # --- step ----------------------------------------------------------------------------
    def _finish_param_sync(self) -> None:
        for shard in self.shards:
            shard.bucket.finish_param_sync()

    def _copy_model_grads_to_main_grads(self) -> List[torch.Tensor]:
        for shard in self.shards:
            shard.set_main_grads()
        return self.get_parameters()

    # --- the Triton AdamW kernel (see the module doc) -------------------------------------
    def _single_grad_dtype(self) -> bool:
        return len({dtype for chunk in self.chunk_shards for dtype in chunk}) <= 1

    def _no_copies_reason(self) -> str:
        return ("the distributed optimizer's grad buffers have several dtypes (a param group "
                "could mix them on some ranks only)")

    def _model_copies(self):
        """Per inner param group, the slice of its bucket's 16-bit `param_data` shard that
        the kernel writes each main shard to (None where `main_data` is that shard)."""
        if not self._single_grad_dtype():
            return None
        out_of = {e.main: None if s.aliased else s.model_shard[e.start:e.end]
                  for s in self.shards for e in s.entries}
        return [[out_of[p] for p in g["params"]] for g in self.optimizer.param_groups]

    def _shard_grads(self) -> List[List[torch.Tensor]]:
        """Per inner param group, each main shard's gradient: its slice of the bucket's
        reduce-scattered grad shard, in the buffer's dtype."""
        grad_of = {e.main: s.grad_shard[e.start:e.end] for s in self.shards for e in s.entries}
        return [[grad_of[p] for p in g["params"]] for g in self.optimizer.param_groups]

    def _kernel_grads(self):
        grads = self._shard_grads()  # views of the grad buffers: the same tensors every step
        self._grad_views = [g for group in grads for g in group]
        return lambda: grads

    def _buffer_step(self, multi, timers: Optional[TimerHook] = None) -> StepResult:
        """`MixedPrecisionOptimizer._buffer_step` on the shards: the norm, zero count and
        overflow check read each shard's gradient where it lives (`main_grad`, set for the
        step only: torch's path reads the fp32 copies in `.grad`), reduced over the world."""
        mains = self.get_parameters()
        for p, g in zip(mains, self._grad_views):
            p.main_grad = g
        try:
            return super()._buffer_step(multi, timers)
        finally:
            for p in mains:
                del p.main_grad

    def graph_capture_reason(self) -> Optional[str]:
        """With one data-parallel rank there is nothing to reduce-scatter or all-gather
        (the buckets have no DP group): the step is the one-GPU step on views of the
        buffers, and a whole-step graph records it like any other."""
        if any(shard.bucket.dp_group is not None for shard in self.shards):
            return ("--use-distributed-optimizer all-gathers the parameters over "
                    "data-parallel ranks after its step (not captured, so far)")
        return super().graph_capture_reason()

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated shards into `param_data` (torch's kernels); `step()` then
        all-gathers them."""
        for shard in self.shards:
            if not shard.aliased:
                shard.model_shard.copy_(shard.main_data)

    def _start_param_gather(self, timers: Optional[TimerHook] = None) -> None:
        """All-gather every bucket's `param_data` over DP (buckets in forward order: the
        last one of each buffer first). Timed as Megatron's level-1 `params-all-gather`;
        with `overlap_param_gather` that is only the launch (the forward waits)."""
        with timed(timers, "params-all-gather"):
            for shards in (s for c in self.chunk_shards for s in c.values()):
                for shard in reversed(shards):
                    shard.bucket.start_param_sync()

    @torch.no_grad()
    def step(self, timers: Optional[TimerHook] = None) -> StepResult:
        """Main grads from the reduce-scattered shards; unscale and check for overflow
        over the world (skip on overflow); clip over the world; inner step on the shards;
        copy to `param_data` and all-gather the parameters over DP. With the Triton kernel
        the gradients are read in place and `param_data` is written by the kernel (see
        the module doc); the all-gather follows an update either way. `timers`: the
        phases of `MixedPrecisionOptimizer.step` and `params-all-gather` (see
        megatron/core/timing.py; None: untimed)."""
        self._finish_param_sync()
        if not self._views_checked:
            _check_param_views(self.shards)
            self._views_checked = True
        self._model_params_written = False
        multi = self._multi_tensor()
        if multi is not None and self.mp_group is not None and not multi.ready():
            # the kernel's step and torch's reduce different things over the world: a rank
            # that fell back alone would leave the others waiting in a collective
            raise RuntimeError(
                "the Triton AdamW kernel cannot step this rank's shards (their parameters "
                "are at different Adam step counts); every rank must take the same path: "
                "run with --adam-kernel torch")
        try:
            result = super().step(timers)
        finally:
            for p in self.get_parameters():
                p.grad = None
        if result[0]:  # param_data's shards are written (by the copy pass or the kernel)
            self._start_param_gather(timers)
        return result

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main shards from the model parameters."""
        self._finish_param_sync()
        for shard in self.shards:
            if not shard.aliased:
                shard.main_data.copy_(shard.bucket.shard(shard.bucket.param_data))

    def _device(self) -> torch.device:
        return self._comm_device

    # --- checkpoint: the unsharded part (model_optim_rng.pt 'optimizer') -----------------
    def _current_step(self) -> int:
        steps = [int(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        if steps:
            return max(steps)
        return self._loaded_step or 0

    def state_dict(self) -> Dict:
        """Megatron's shape: {optimizer: {param_groups (no "params", with "step")},
        grad_scaler (if any)}; the sharded tensors come from `get_parameter_state()`."""
        step = self._current_step()
        groups = []
        for group in self.optimizer.state_dict()["param_groups"]:
            group = {k: v for k, v in group.items() if k != "params"}
            group["step"] = step
            groups.append(group)
        state_dict = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: Dict) -> List[str]:
        """Restore group hyper-parameters (the command line's --adam-beta1/2, --adam-eps,
        --sgd-momentum kept: the returned notes), the step count and the grad scaler; the
        shards follow with `load_parameter_state()`."""
        inner = state_dict.get("optimizer")
        if not isinstance(inner, dict) or "state" in inner or "param_groups" not in inner:
            raise ValueError(
                "the checkpoint's optimizer state was saved without --use-distributed-optimizer"
                "; resume with the same setting, or pass --no-load-optim to start the "
                "optimizer fresh from the loaded weights")
        saved = inner["param_groups"]
        if len(saved) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(saved)} optimizer parameter groups, this "
                             f"model has {len(self.optimizer.param_groups)}; the model or the "
                             f"weight-decay / lr-scaling rules differ from the saved run")
        settled, notes = settle_groups(saved, self.optimizer.param_groups)
        for current, group in zip(self.optimizer.param_groups, settled):
            for key, value in group.items():
                if key not in ("params", "step") and key not in LOCAL_GROUP_KEYS:
                    current[key] = value
        self._loaded_step = int(saved[0].get("step", 0)) if saved else 0
        load_scaler_state(self.grad_scaler, state_dict)
        return notes

    # --- checkpoint: the sharded part (distrib_optim.pt) ---------------------------------
    def _agreed_state_keys(self) -> List[str]:
        """State keys present on any DP rank. Collective: all-reduce MAX over DP."""
        present = torch.tensor(
            [float(any(k in s for s in self.optimizer.state.values())) for k in STATE_KEYS],
            device=self._comm_device)
        if self.dp_group is not None:
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.dp_group)
        return [k for k, flag in zip(STATE_KEYS, present.tolist()) if flag > 0]

    def _gather_shard(self, shard: _BucketShard, local: torch.Tensor, dst: int,
                      is_dst: bool) -> Optional[torch.Tensor]:
        """The whole (padded) bucket on DP rank 0 from every rank's shard, on CPU.
        Collective: gathers over DP in pieces of at most GATHER_CHUNK elements."""
        if self.dp_group is None:
            return local.cpu()
        out = torch.empty(shard.numel * self.dp_size, dtype=torch.float32) if is_dst else None
        for k in range(0, shard.numel, GATHER_CHUNK):
            piece = local[k:k + GATHER_CHUNK].contiguous()
            recv = [torch.empty_like(piece) for _ in range(self.dp_size)] if is_dst else None
            dist.gather(piece, recv, dst=dst, group=self.dp_group)
            if is_dst:
                for q, r in enumerate(recv):
                    out[q * shard.numel + k:q * shard.numel + k + r.numel()] = r.cpu()
        return out

    @torch.no_grad()
    def get_parameter_state(self) -> Optional[Dict]:
        """Gather the fp32 main parameters and optimizer state onto DP rank 0 in the
        `distrib_optim.pt` layout (see the module doc). Collective over the DP group:
        every DP rank must call it; returns the dict on DP rank 0, None elsewhere."""
        self._finish_param_sync()
        keys = ["param"] + self._agreed_state_keys()
        dst = dist.get_global_rank(self.dp_group, 0) if self.dp_group is not None else 0
        is_dst = self.dp_group is None or dist.get_rank(self.dp_group) == 0
        result: Dict = {}
        for chunk_idx, shards_by_dtype in enumerate(self.chunk_shards):
            result[chunk_idx] = {}
            for dtype, shards in shards_by_dtype.items():
                numel = self.buffer_numel[chunk_idx][dtype]
                padded = -(-numel // self.dp_size) * self.dp_size
                flats = {k: torch.zeros(padded, dtype=torch.float32) if is_dst else None
                         for k in keys}
                for shard in shards:
                    for key in keys:
                        whole = self._gather_shard(shard, shard.flat_state(self.optimizer, key),
                                                   dst, is_dst)
                        if is_dst:
                            _bucket_to_canonical(shard, whole, flats[key])
                result[chunk_idx][dtype] = flats
        return result if is_dst else None

    @torch.no_grad()
    def load_parameter_state(self, state: Dict) -> None:
        """Take this rank's shard of main parameters and optimizer state from a
        `get_parameter_state()` dict (saved with any dp_size). No communication.

        An fp32 model's buffers take every shard's main parameters, not only this rank's:
        its model weights are those main parameters, and a model loaded from a bf16/fp16
        checkpoint held their rounded copy elsewhere -- other weights on each DP rank
        until the first step's all-gather."""
        self._finish_param_sync()
        step = self._current_step() if self._loaded_step is None else self._loaded_step
        index = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                index.setdefault(p, len(index))
        inner_state: Dict[int, Dict] = {}
        for chunk_idx, shards_by_dtype in enumerate(self.chunk_shards):
            for dtype, shards in shards_by_dtype.items():
                flats = _saved_entry(state, chunk_idx, dtype, self.buffer_numel[chunk_idx][dtype])
                keys = [k for k in STATE_KEYS if k in flats]
                for shard in shards:
                    for e in shard.entries:
                        n = e.end - e.start
                        src = slice(e.canonical_start, e.canonical_start + n)
                        e.main.copy_(flats["param"][src])
                        if keys:
                            entry = {k: flats[k][src].clone() for k in keys}
                            if "exp_avg" in entry:
                                entry["step"] = torch.tensor(float(step))
                            inner_state[index[e.main]] = entry
                    if shard.aliased:
                        _canonical_to_bucket(shard, flats["param"], shard.bucket.param_data)
        groups = self.optimizer.state_dict()["param_groups"]
        load_inner_state(self.optimizer, {"state": inner_state, "param_groups": groups})


def _check_param_views(shards: List[_BucketShard]) -> None:
    """Every model parameter must still be a view of its bucket's `param_data` (the
    all-gather writes there)."""
    for shard in shards:
        bucket = shard.bucket
        for p in bucket.params:
            start, _ = bucket.param_ranges[p]
            if p.numel() and p.data_ptr() != bucket.param_data[start:].data_ptr():
                raise RuntimeError(
                    "a model parameter no longer lives in its grad bucket's param_data: its "
                    "`.data` was replaced after the model was wrapped in DistributedDataParallel"
                    " (e.g. by .to() or load_state_dict(assign=True)); move and load the model "
                    "before wrapping it")


def _bucket_to_canonical(shard: _BucketShard, whole: torch.Tensor, out: torch.Tensor) -> None:
    """Copy each parameter's elements of a gathered (padded) bucket into the checkpoint
    layout (parameters back to back in buffer order)."""
    canonical = shard.canonical_start
    for p in shard.bucket.params:
        start, end = shard.bucket.param_ranges[p]
        out[canonical:canonical + end - start] = whole[start:end]
        canonical += end - start


def _canonical_to_bucket(shard: _BucketShard, flat: torch.Tensor, out: torch.Tensor) -> None:
    """Copy each parameter's elements of the checkpoint layout into its place in the
    bucket's (padded) `out` (the inverse of `_bucket_to_canonical`)."""
    canonical = shard.canonical_start
    for p in shard.bucket.params:
        start, end = shard.bucket.param_ranges[p]
        out[start:end].copy_(flat[canonical:canonical + end - start])
        canonical += end - start


def _saved_entry(state: Dict, chunk_idx: int, dtype: torch.dtype, numel: int) -> Dict:
    """`state[chunk_idx][dtype]`, checked against this model's grad buffer."""
    chunk = state.get(chunk_idx)
    if chunk is None or dtype not in chunk:
        have = {c: sorted(str(d) for d in v) for c, v in state.items()}
        raise ValueError(
            f"distrib_optim.pt has no entry for model chunk {chunk_idx} with grad dtype "
            f"{dtype} (it has {have}); the checkpoint was saved with a different model, "
            "precision or virtual-pipeline layout; pass --no-load-optim to start the optimizer "
            "fresh from the loaded weights")
    flats = chunk[dtype]
    if "param" not in flats or flats["param"].numel() < numel:
        size = flats["param"].numel() if "param" in flats else 0
        raise ValueError(
            f"distrib_optim.pt chunk {chunk_idx} {dtype}: {size} elements saved, this model's "
            f"grad buffer holds {numel}; the model differs from the saved one")
    return flats
