"""Data-parallel gradient reduction with contiguous grad buffers ("local" DDP), the
sharded layout the distributed optimizer needs, and `--DDP-impl torch`.

Layout: one flat buffer per gradient dtype. Parameters are placed in reverse order (the
last parameter of the model first, as Megatron does), since backward produces gradients
roughly in that order. Every parameter gets `param.main_grad`, a view into the buffer. The
buffer is cut into buckets of about `ddp_bucket_size` elements (a parameter is never split).

Gradient flow: after autograd accumulates a parameter's `.grad`, a post-accumulate-grad
hook adds it into `main_grad` and frees `.grad`, so micro-batches accumulate in the buffer.
With gradient accumulation fusion the layers add their grads into `main_grad` themselves
(linear weights through the GEMM, biases and norm parameters through
`grad_into_main_grad`): autograd gets None, the hook still fires (with `.grad` None) and
only marks the parameter ready. The fused linear weights (`grad_overwrites_stale`) are not
zeroed at the start of an iteration: the first weight-grad product writes over the stale
values (stale_grads.py; the hook copies instead of adding when it is the first writer,
and `finish_grad_sync()` zeroes those that got no gradient). A layer that hands autograd
a placeholder grad instead sets `param.grad_added_to_main_grad = True`, and the hook then
skips the add. With `overlap_grad_reduce`, on the last micro-batch (outside `no_sync()`) a
bucket's asynchronous reduction starts as soon as all its parameters have their gradients.
`finish_grad_sync()` starts whatever has not started and waits for all of them.

Collectives, per bucket over the data-parallel group, of the bucket pre-divided by the
data-parallel size (the average; gloo has no AVG):
  * plain: all-reduce SUM; every rank ends with the whole averaged bucket.
  * distributed optimizer (`use_distributed_optimizer`): every bucket is padded to a
    multiple of dp_size and split into dp_size equal shards; reduce-scatter SUM leaves
    rank r with the averaged shard r only. The bucket also owns `param_data`, a flat tensor
    of the parameters' dtype that the model parameters are views of; after the optimizer
    updated shard r, an all-gather of `param_data` gives every rank the whole updated
    bucket (`start_param_sync`). With `overlap_param_gather` that all-gather runs while
    the next forward starts: a forward pre-hook of every module waits for the buckets of
    the parameters it owns or receives as arguments.
    Buckets also close at a change of parameter dtype, and around a parameter marked
    `shared_embedding` (the tied word embedding, marked on both the first and the last
    pipeline stage): it is then sharded the same way on both stages, and its grads can be
    summed over the embedding group right after the reduce-scatter. An unmarked tied
    embedding still works: `allreduce_embedding_grads` first rebuilds its whole reduced
    grad over DP (one extra all-reduce of that weight).
A `dp_group` of None means a single replica: nothing is communicated.

`--DDP-impl torch` (`ParallelConfig.ddp_impl == "torch"`) wraps the module in
`torch.nn.parallel.DistributedDataParallel` instead: grads stay in `.grad` and are
averaged during the last backward; no grad buffers, `finish_grad_sync()` has nothing to do.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager, nullcontext
from typing import (
    Callable,
    ContextManager,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.config import ParallelConfig
from megatron.core.distributed import stale_grads

DEFAULT_BUCKET_SIZE = 40_000_000

# torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _weak_grad_hook(ddp: "DistributedDataParallel"):
    """The post-accumulate-grad hook, holding its wrapper weakly: torch keeps a tensor's
    hooks where Python's garbage collector cannot see them, so a bound method there would
    keep the wrapper and its grad buffers alive for as long as the parameters live, even
    after every reference to the wrapper is gone."""
    ref = weakref.ref(ddp)

    def hook(param: torch.nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            owner._grad_hook(param)

    return hook


def _remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def _needs_own_bucket(param: torch.Tensor) -> bool:
    return bool(getattr(param, "shared_embedding", False))


class Bucket:
    """A contiguous slice of a grad buffer, reduced as one message.

    `grad_data` is the bucket's (padded) view of the buffer, `offset` its start in the
    buffer, `param_ranges[p] = (start, end)` each parameter's elements relative to the
    bucket. `shard_range` is the part this data-parallel rank owns after the reduction
    (the whole bucket unless `distributed`).
    """

    def __init__(self, params: List[torch.nn.Parameter], grad_data: torch.Tensor, offset: int,
                 param_ranges: Dict[torch.nn.Parameter, Tuple[int, int]], dp_group,
                 dp_size: int, dp_rank: int = 0, distributed: bool = False) -> None:
        self.params = params
        self.grad_data = grad_data
        self.offset = offset
        self.param_ranges = param_ranges
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.distributed = distributed
        self.param_data: Optional[torch.Tensor] = None
        self.overlap_param_gather = False  # set by the DDP wrapper that owns the bucket
        # a context-manager factory each wait for a parameter all-gather in flight runs in
        # (`DistributedDataParallel.watch_param_sync`); None: waits unwatched
        self.param_sync_watch: Optional[Callable[[], ContextManager]] = None
        numel = grad_data.numel()
        if distributed:
            assert numel % dp_size == 0, "distributed bucket not padded to the dp size"
            shard = numel // dp_size
            self.shard_range = (dp_rank * shard, (dp_rank + 1) * shard)
        else:
            self.shard_range = (0, numel)
        self._pending = set(params)
        self._handle = None
        self._started = False
        self._param_handle = None

    @property
    def data(self) -> torch.Tensor:
        """The bucket's grad data (alias of `grad_data`)."""
        return self.grad_data

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a bucket-sized flat tensor (a view)."""
        lo, hi = self.shard_range
        return tensor[lo:hi]

    def reset(self) -> None:
        self._pending = set(self.params)
        self._handle = None
        self._started = False

    # --- gradients ------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch the asynchronous reduction of this bucket: grad / dp_size, then all-reduce
        SUM (plain) or reduce-scatter SUM into this rank's shard (distributed)."""
        assert not self._started, "bucket reduction started twice"
        self._started = True
        if self.dp_group is None:
            return
        self.grad_data.div_(self.dp_size)
        if self.distributed:
            self._handle = _reduce_scatter_single(self.shard(self.grad_data), self.grad_data,
                                                  group=self.dp_group, async_op=True)
        else:
            self._handle = dist.all_reduce(self.grad_data, group=self.dp_group, async_op=True)

    def mark_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Record that `param`'s gradient is final; launch the reduction when all are."""
        if self._started:
            raise RuntimeError(
                "a gradient arrived after its bucket's all-reduce had started; run all but "
                "the last micro-batch inside ddp.no_sync(), and call finish_grad_sync() and "
                "zero_grad_buffer() between iterations"
            )
        self._pending.discard(param)
        if not self._pending:
            self.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Start the reduction if needed and wait for it; then ready for the next round."""
        if not self._started:
            self.start_grad_sync()
        if self._handle is not None:
            self._handle.wait()
        self.reset()

    # --- parameters (distributed optimizer) -----------------------------------------------
    @torch.no_grad()
    def build_param_data(self) -> None:
        """Move the bucket's parameters into one flat tensor (`param_data`, padded like
        `grad_data`); each parameter's `.data` becomes a view of it."""
        dtype = self.params[0].dtype
        assert all(p.dtype == dtype for p in self.params), "mixed parameter dtypes in a bucket"
        self.param_data = torch.zeros(self.grad_data.numel(), dtype=dtype,
                                      device=self.grad_data.device)
        for p in self.params:
            start, end = self.param_ranges[p]
            view = self.param_data[start:end].view(p.shape)
            view.copy_(p.data)
            p.data = view

    def start_param_sync(self, async_op: Optional[bool] = None) -> None:
        """All-gather `param_data` from every rank's shard (collective over the DP group);
        asynchronous when `async_op` (default: `overlap_param_gather`), then a forward
        pre-hook of the DDP wrapper or `finish_param_sync()` waits for it."""
        assert self.param_data is not None, "start_param_sync needs build_param_data()"
        self.finish_param_sync()
        async_op = self.overlap_param_gather if async_op is None else async_op
        if self.dp_group is None:
            return
        self._param_handle = _all_gather_single(self.param_data, self.shard(self.param_data),
                                                group=self.dp_group, async_op=async_op)
        if not async_op:
            self._param_handle = None

    def finish_param_sync(self) -> None:
        """Wait for this bucket's parameter all-gather, if one is in flight (inside
        `param_sync_watch()` when set)."""
        if self._param_handle is not None:
            with self.param_sync_watch() if self.param_sync_watch is not None else nullcontext():
                self._param_handle.wait()
            self._param_handle = None

    @property
    def param_sync_pending(self) -> bool:
        return self._param_handle is not None


def _plan_buckets(params: Iterable[torch.nn.Parameter], bucket_size: Optional[int],
                  split: bool) -> List[List[torch.nn.Parameter]]:
    """Group `params` (in buffer order) into buckets of >= bucket_size elements (the last
    one may be smaller). With `split`, a bucket also closes at a change of parameter dtype
    and around parameters that need a bucket of their own."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and split and (_needs_own_bucket(p) or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
        if (bucket_size is not None and size >= bucket_size) or (split and _needs_own_bucket(p)):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class GradBuffer:
    """One flat gradient tensor for `params` (all of one grad dtype) plus its buckets.

    `numel` counts the parameters' elements, `numel_padded` the buffer (with the
    distributed optimizer's per-bucket padding to a multiple of dp_size).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype,
                 bucket_size: Optional[int], dp_group, dp_size: int, dp_rank: int = 0,
                 distributed: bool = False) -> None:
        devices = {p.device for p in params}
        assert len(devices) == 1, f"grad buffer params on several devices: {devices}"
        self.dtype = dtype
        self.params = list(params)
        self.numel = sum(p.numel() for p in params)
        plan = _plan_buckets(reversed(self.params), bucket_size, distributed)
        sizes = []
        for bucket_params in plan:
            n = sum(p.numel() for p in bucket_params)
            sizes.append(-(-n // dp_size) * dp_size if distributed else n)
        self.numel_padded = sum(sizes)
        self.data = torch.zeros(self.numel_padded, dtype=dtype, device=devices.pop())
        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        offset = 0
        for bucket_params, size in zip(plan, sizes):
            ranges, start = {}, 0
            for p in bucket_params:
                ranges[p] = (start, start + p.numel())
                p.main_grad = self.data[offset + start:offset + start + p.numel()].view(p.shape)
                start += p.numel()
            bucket = Bucket(bucket_params, self.data[offset:offset + size], offset, ranges,
                            dp_group, dp_size, dp_rank, distributed)
            self.buckets.append(bucket)
            for p in bucket_params:
                self.param_to_bucket[p] = bucket
            offset += size
        self._plan_lazy_zero()

    def _plan_lazy_zero(self) -> None:
        """Split the buffer into the main grads that their first write overwrites (weights
        marked `grad_overwrites_stale`, see stale_grads.py) and views of everything else
        (other parameters and padding), which zero() fills."""
        self.stale_grads = [p.main_grad for p in self.params
                            if getattr(p, "grad_overwrites_stale", False)]
        base, size = self.data.data_ptr(), self.data.element_size()
        spans = sorted(((g.data_ptr() - base) // size, g.numel()) for g in self.stale_grads)
        self._zero_views, start = [], 0
        for lo, n in spans + [(self.data.numel(), 0)]:
            if lo > start:
                self._zero_views.append(self.data[start:lo])
            start = lo + n

    def zero(self) -> None:
        """Start a step's accumulation: zero the buffer, except the main grads listed as
        stale, which their first write overwrites."""
        if self.stale_grads:
            if self._zero_views:
                torch._foreach_zero_(self._zero_views)
            stale_grads.mark(self.stale_grads)
        else:
            self.data.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def settle(self) -> None:
        """Zero the stale-listed main grads that no write claimed (no gradient this step)."""
        stale_grads.settle(self.stale_grads)


def _check_impl(config: ParallelConfig) -> None:
    if config.ddp_impl not in ("local", "torch"):
        raise ValueError(f"--DDP-impl {config.ddp_impl!r} is not known; use 'local' or 'torch'")
    if config.ddp_impl == "torch":
        wants = [name for name, on in (
            ("--use-distributed-optimizer", config.use_distributed_optimizer),
            ("--accumulate-allreduce-grads-in-fp32 (or --bf16)",
             config.accumulate_allreduce_grads_in_fp32),
            ("--pipeline-model-parallel-size > 1", config.pp_size > 1)) if on]
        if wants:
            raise ValueError(f"--DDP-impl torch cannot be used with {', '.join(wants)}; "
                             "use --DDP-impl local")
    if config.overlap_param_gather and not config.use_distributed_optimizer:
        raise ValueError("overlap_param_gather needs the distributed optimizer "
                         "(--use-distributed-optimizer)")


class DistributedDataParallel(torch.nn.Module):
    """Wraps a model chunk; its grads accumulate in contiguous buffers (`param.main_grad`)
    and are averaged over the data-parallel group by `finish_grad_sync()`.

    Args:
        module: the model chunk; `forward` delegates to it, `.module` returns it, and
            `state_dict`/`load_state_dict` are the module's own (no "module." prefix).
        parallel_state: gives `dp_group`, `dp_size` and `dp_rank`.
        config: `overlap_grad_reduce`, `ddp_bucket_size` (elements; default 40M with
            overlap, one bucket per buffer without), `accumulate_allreduce_grads_in_fp32`,
            `use_distributed_optimizer` (reduce-scatter, sharded buckets, parameters moved
            into per-bucket `param_data`), `overlap_param_gather`, `ddp_impl`.
        grad_dtype: force every grad buffer to this dtype; None -> fp32 when
            `accumulate_allreduce_grads_in_fp32`, else each parameter's own dtype.

    Use: `zero_grad_buffer()`; all but the last micro-batch inside `no_sync()`;
    `finish_grad_sync()`; optimizer step (it reads `param.main_grad`, or `.grad` with
    `ddp_impl == "torch"`).
    """

    def __init__(self, module: torch.nn.Module, parallel_state, config: ParallelConfig,
                 grad_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_impl(config)
        self.module = module
        self.ddp_impl = config.ddp_impl
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.use_distributed_optimizer = config.use_distributed_optimizer
        self.overlap_param_gather = config.overlap_param_gather
        self.dp_group = parallel_state.dp_group
        self.dp_size = parallel_state.dp_size if self.dp_group is not None else 1
        self.dp_rank = parallel_state.dp_rank if self.dp_group is not None else 0
        self._dp_src_rank = parallel_state.ranks("dp")[0] if self.dp_group is not None else 0
        self.grad_buffers: Dict[torch.dtype, GradBuffer] = {}
        self._param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        self._is_last_microbatch = True
        self._hook_handles = []
        self.torch_ddp = None
        if self.ddp_impl == "torch":
            self._wrap_torch_ddp()
            return
        self._build_grad_buffers(config, grad_dtype)
        hook = _weak_grad_hook(self)
        self._hook_handles = [p.register_post_accumulate_grad_hook(hook)
                              for p in self._param_to_bucket]
        # When the wrapper goes, its grad hooks go with it (the module may live on).
        weakref.finalize(self, _remove_hooks, list(self._hook_handles))
        if self.use_distributed_optimizer:
            for bucket in self.buckets:
                bucket.build_param_data()
                bucket.overlap_param_gather = self.overlap_param_gather
        if self.overlap_param_gather:
            self._register_param_sync_hooks()

    def _build_grad_buffers(self, config: ParallelConfig, grad_dtype) -> None:
        bucket_size = config.ddp_bucket_size
        if bucket_size is None and self.overlap_grad_reduce:
            bucket_size = max(DEFAULT_BUCKET_SIZE, 1_000_000 * self.dp_size)
        if bucket_size is not None and bucket_size <= 0:
            raise ValueError(f"ddp_bucket_size must be > 0 elements, got {bucket_size}")
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for p in self.module.parameters():
            if p.requires_grad:
                dtype = grad_dtype or (
                    torch.float32 if config.accumulate_allreduce_grads_in_fp32 else p.dtype)
                by_dtype.setdefault(dtype, []).append(p)
        for dtype, params in by_dtype.items():
            self.grad_buffers[dtype] = GradBuffer(
                params, dtype, bucket_size, self.dp_group, self.dp_size, self.dp_rank,
                distributed=self.use_distributed_optimizer)
            self._param_to_bucket.update(self.grad_buffers[dtype].param_to_bucket)
        for param, bucket in self._param_to_bucket.items():
            param.grad_bucket = bucket  # how an optimizer given the bare module finds it

    def _wrap_torch_ddp(self) -> None:
        """`--DDP-impl torch`: torch's own DDP over the data-parallel group (none for a
        single replica: there is nothing to reduce)."""
        if self.dp_group is None or self.dp_size == 1:
            return
        device = next(self.module.parameters()).device
        with warnings.catch_warnings():
            # newer torch deprecates broadcast_buffers (every rank warned); its successor's
            # False still broadcasts buffers at init, Megatron-LM's False syncs none
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated",
                                    category=FutureWarning)
            self.torch_ddp = torch.nn.parallel.DistributedDataParallel(
                self.module, device_ids=[device] if device.type == "cuda" else None,
                process_group=self.dp_group, broadcast_buffers=False)

    def forward(self, *args, **kwargs):
        if self.torch_ddp is not None:
            return self.torch_ddp(*args, **kwargs)
        return self.module(*args, **kwargs)

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        """Move the freshly accumulated `.grad` into `main_grad`; maybe start a bucket."""
        if getattr(param, "grad_added_to_main_grad", False):
            param.grad_added_to_main_grad = False  # the layer already added it (fusion)
            param.grad = None
        elif param.grad is not None:
            if stale_grads.take(param.main_grad):
                param.main_grad.copy_(param.grad)
            else:
                param.main_grad.add_(param.grad)
            param.grad = None
        elif stale_grads.pending(param.main_grad):
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} marked grad_overwrites_stale got "
                "its gradient without claiming its stale main_grad (was the weight-grad "
                "operator handed a copy of the buffer?); its gradient would be added to the "
                "previous step's")
        if self.overlap_grad_reduce and self._is_last_microbatch:
            self._param_to_bucket[param].mark_grad_ready(param)

    @property
    def buckets(self) -> List[Bucket]:
        return [b for buffer in self.grad_buffers.values() for b in buffer.buckets]

    @contextmanager
    def no_sync(self):
        """Micro-batches run inside do not start any reduction (grads only accumulate)."""
        ctx = self.torch_ddp.no_sync() if self.torch_ddp is not None else nullcontext()
        self._is_last_microbatch = False
        try:
            with ctx:
                yield
        finally:
            self._is_last_microbatch = True

    def finish_grad_sync(self) -> None:
        """Average every bucket over the data-parallel group (grad/dp, then all-reduce SUM,
        or reduce-scatter SUM with the distributed optimizer).

        Without overlap all buckets are launched here (asynchronously, then waited);
        with overlap the ones already in flight are waited for. Nothing to do with
        `ddp_impl == "torch"` (torch DDP reduced during the last backward)."""
        for buffer in self.grad_buffers.values():
            buffer.settle()
        buckets = self.buckets
        if not self.overlap_grad_reduce:
            for bucket in buckets:
                bucket.start_grad_sync()
        for bucket in buckets:
            bucket.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every `main_grad` (call once per iteration, before the first micro-batch)."""
        for buffer in self.grad_buffers.values():
            buffer.zero()

    # --- parameter all-gather (distributed optimizer) ------------------------------------
    def start_param_sync(self, async_op: Optional[bool] = None) -> None:
        """All-gather every bucket's `param_data` over the DP group (the optimizer calls
        this after its step). Asynchronous when `overlap_param_gather` (default of
        `async_op`); buckets are launched in forward order (last bucket first)."""
        async_op = self.overlap_param_gather if async_op is None else async_op
        for buffer in self.grad_buffers.values():
            for bucket in reversed(buffer.buckets):
                bucket.start_param_sync(async_op)

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (a no-op otherwise)."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def watch_param_sync(self, watch: Optional[Callable[[], ContextManager]]) -> None:
        """Run every wait for a parameter all-gather in flight (`overlap_param_gather`: in
        the next forward's pre-hooks, or wherever `finish_param_sync` comes first) inside
        `watch()`, e.g. the driver's watchdog block naming a rank that never launched its
        all-gather; one block per bucket waited for, none when nothing is in flight."""
        for bucket in self.buckets:
            bucket.param_sync_watch = watch

    def _register_param_sync_hooks(self) -> None:
        """Forward pre-hooks that wait for the buckets of a module's own parameters and
        of parameters passed to it (e.g. a tied output weight); a state_dict / load hook
        waits for all of them."""
        for sub in self.module.modules():
            self._hook_handles.append(
                sub.register_forward_pre_hook(self._param_sync_pre_hook, with_kwargs=True))
        self._hook_handles.append(self.module.register_state_dict_pre_hook(
            lambda *args, **kwargs: self.finish_param_sync()))
        self._hook_handles.append(self.module.register_load_state_dict_pre_hook(
            lambda *args, **kwargs: self.finish_param_sync()))

    def _param_sync_pre_hook(self, module, args, kwargs):
        candidates = list(module._parameters.values()) + list(args) + list(kwargs.values())
        for t in candidates:
            bucket = self._param_to_bucket.get(t) if isinstance(t, torch.nn.Parameter) else None
            if bucket is not None and bucket.param_sync_pending:
                bucket.finish_param_sync()
        return None

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy the parameters of data-parallel rank 0 to the other DP ranks.

        Collective: one broadcast per parameter over the data-parallel group."""
        if self.dp_group is None:
            return
        for p in self.module.parameters():
            dist.broadcast(p.data, src=self._dp_src_rank, group=self.dp_group)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    def state_dict_for_save_checkpoint(self, *args, **kwargs):
        self.finish_param_sync()
        fn = getattr(self.module, "state_dict_for_save_checkpoint", self.module.state_dict)
        return fn(*args, **kwargs)


def _grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def allreduce_grads_coalesced(params: Iterable[torch.Tensor], group) -> None:
    """All-reduce (SUM) the grads of `params` over `group`, one flat message per dtype.

    Reads and writes `param.main_grad` when present, else `param.grad`; params without a
    grad are skipped. `group=None` is a group of one: nothing happens."""
    if group is None:
        return
    by_kind: Dict[tuple, List[torch.Tensor]] = {}
    for p in params:
        g = _grad(p)
        if g is not None:
            by_kind.setdefault((g.dtype, g.device), []).append(g)
    for grads in by_kind.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


def _params_of(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]):
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    for module in modules:
        yield from module.parameters()


def allreduce_sequence_parallel_grads(model, tp_group) -> None:
    """Sum over the tensor-parallel group the grads of params marked `sequence_parallel`
    (layer norms, row-parallel biases: each TP rank saw only its sequence slice).

    Collective: one all-reduce SUM per grad dtype over `tp_group` (coalesced)."""
    params = [p for p in _params_of(model)
              if p.requires_grad and getattr(p, "sequence_parallel", False)]
    allreduce_grads_coalesced(params, tp_group)


def allreduce_embedding_grads(params: Iterable[torch.Tensor], embedding_group) -> None:
    """Sum the grads of the tied word embedding over the first and last pipeline stage.

    The caller passes the embedding weight of its stage (first stage: the input
    embedding, last stage: the output-layer copy) and only when pp_size > 1.
    Collective: one all-reduce SUM over `embedding_group`. With the distributed optimizer
    and a weight not marked `shared_embedding`, first an all-reduce SUM over DP of the
    weight's grad with the elements of other ranks' shards zeroed (after the
    reduce-scatter each rank holds only its shard; the stages may shard it differently)."""
    params = list(params)
    for p in params:
        bucket = getattr(p, "grad_bucket", None)
        if (bucket is not None and bucket.distributed and bucket.dp_group is not None
                and not getattr(p, "shared_embedding", False)):
            _rebuild_reduced_grad(p, bucket)
    allreduce_grads_coalesced(params, embedding_group)


def _rebuild_reduced_grad(param: torch.Tensor, bucket: Bucket) -> None:
    """The whole DP-reduced `param.main_grad` on every DP rank after a reduce-scatter.
    Collective: all-reduce SUM over the bucket's DP group."""
    start, end = bucket.param_ranges[param]
    lo, hi = bucket.shard_range
    flat = param.main_grad.view(-1)
    a, b = min(max(lo - start, 0), end - start), min(max(hi - start, 0), end - start)
    flat[:a].zero_()
    flat[b:].zero_()
    dist.all_reduce(flat, group=bucket.dp_group)
