"""Data-parallel gradient reduction with contiguous grad buffers ("local" DDP).

Layout: one flat buffer per gradient dtype. Parameters are placed in reverse order (the
last parameter of the model first, as Megatron does), since backward produces gradients
roughly in that order. Every parameter gets `param.main_grad`, a view into the buffer. The
buffer is cut into buckets of about `ddp_bucket_size` elements (a parameter is never split).

Gradient flow: after autograd accumulates a parameter's `.grad`, a post-accumulate-grad
hook adds it into `main_grad` and frees `.grad`, so micro-batches accumulate in the buffer.
With `overlap_grad_reduce`, on the last micro-batch (outside `no_sync()`) a bucket's
asynchronous all-reduce starts as soon as all its parameters have their gradients.
`finish_grad_sync()` starts whatever has not started and waits for all of them.

Collectives: per bucket, all-reduce SUM over the data-parallel group of the bucket
pre-divided by the data-parallel size (i.e. the average; gloo has no AVG). A `dp_group` of
None means a single replica: nothing is communicated.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.config import ParallelConfig

DEFAULT_BUCKET_SIZE = 40_000_000


class Bucket:
    """A contiguous slice of a grad buffer, all-reduced as one message."""

    def __init__(self, params: List[torch.nn.Parameter], data: torch.Tensor, dp_group,
                 dp_size: int) -> None:
        self.params = params
        self.data = data
        self.dp_group = dp_group
        self.dp_size = dp_size
        self._pending = set(params)
        self._handle = None
        self._started = False

    def reset(self) -> None:
        self._pending = set(self.params)
        self._handle = None
        self._started = False

    def start_grad_sync(self) -> None:
        """Launch the asynchronous all-reduce (average over the DP group) of this bucket."""
        assert not self._started, "bucket all-reduce started twice"
        self._started = True
        if self.dp_group is None:
            return
        self.data.div_(self.dp_size)
        self._handle = dist.all_reduce(self.data, group=self.dp_group, async_op=True)

    def mark_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Record that `param`'s gradient is final; launch the all-reduce when all are."""
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
        """Start the all-reduce if needed and wait for it; then ready for the next round."""
        if not self._started:
            self.start_grad_sync()
        if self._handle is not None:
            self._handle.wait()
        self.reset()


class GradBuffer:
    """One flat gradient tensor for `params` (all of one grad dtype) plus its buckets."""

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype,
                 bucket_size: Optional[int], dp_group, dp_size: int) -> None:
        devices = {p.device for p in params}
        assert len(devices) == 1, f"grad buffer params on several devices: {devices}"
        self.dtype = dtype
        self.params = list(params)
        self.numel = sum(p.numel() for p in params)
        self.data = torch.zeros(self.numel, dtype=dtype, device=devices.pop())
        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        offset, bucket_start, bucket_params = 0, 0, []
        for p in reversed(self.params):
            p.main_grad = self.data[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            bucket_params.append(p)
            if bucket_size is not None and offset - bucket_start >= bucket_size:
                self._add_bucket(bucket_params, bucket_start, offset, dp_group, dp_size)
                bucket_start, bucket_params = offset, []
        if bucket_params:
            self._add_bucket(bucket_params, bucket_start, offset, dp_group, dp_size)

    def _add_bucket(self, params, start: int, end: int, dp_group, dp_size: int) -> None:
        bucket = Bucket(list(params), self.data[start:end], dp_group, dp_size)
        self.buckets.append(bucket)
        for p in params:
            self.param_to_bucket[p] = bucket

    def zero(self) -> None:
        self.data.zero_()
        for bucket in self.buckets:
            bucket.reset()


class DistributedDataParallel(torch.nn.Module):
    """Wraps a model chunk; its grads accumulate in contiguous buffers (`param.main_grad`)
    and are averaged over the data-parallel group by `finish_grad_sync()`.

    Args:
        module: the model chunk; `forward` delegates to it, `.module` returns it, and
            `state_dict`/`load_state_dict` are the module's own (no "module." prefix).
        parallel_state: gives `dp_group` and `dp_size`.
        config: `overlap_grad_reduce`, `ddp_bucket_size` (elements; default 40M with
            overlap, one bucket per buffer without), `accumulate_allreduce_grads_in_fp32`.
        grad_dtype: force every grad buffer to this dtype; None -> fp32 when
            `accumulate_allreduce_grads_in_fp32`, else each parameter's own dtype.

    Use: `zero_grad_buffer()`; all but the last micro-batch inside `no_sync()`;
    `finish_grad_sync()`; optimizer step (it reads `param.main_grad`).
    """

    def __init__(self, module: torch.nn.Module, parallel_state, config: ParallelConfig,
                 grad_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.module = module
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.dp_group = parallel_state.dp_group
        self.dp_size = parallel_state.dp_size if self.dp_group is not None else 1
        self._dp_src_rank = parallel_state.ranks("dp")[0] if self.dp_group is not None else 0
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
        self.grad_buffers: Dict[torch.dtype, GradBuffer] = {
            dtype: GradBuffer(params, dtype, bucket_size, self.dp_group, self.dp_size)
            for dtype, params in by_dtype.items()
        }
        self._param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        for buffer in self.grad_buffers.values():
            self._param_to_bucket.update(buffer.param_to_bucket)
        self._is_last_microbatch = True
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._grad_hook)
            for p in self._param_to_bucket
        ]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        """Move the freshly accumulated `.grad` into `main_grad`; maybe start a bucket."""
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.overlap_grad_reduce and self._is_last_microbatch:
            self._param_to_bucket[param].mark_grad_ready(param)

    @property
    def buckets(self) -> List[Bucket]:
        return [b for buffer in self.grad_buffers.values() for b in buffer.buckets]

    @contextmanager
    def no_sync(self):
        """Micro-batches run inside do not start any all-reduce (grads only accumulate)."""
        self._is_last_microbatch = False
        try:
            yield
        finally:
            self._is_last_microbatch = True

    def finish_grad_sync(self) -> None:
        """Average every bucket over the data-parallel group (all-reduce SUM of grad/dp).

        Without overlap all buckets are launched here (asynchronously, then waited);
        with overlap the ones already in flight are waited for."""
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

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy the parameters of data-parallel rank 0 to the other DP ranks.

        Collective: one broadcast per parameter over the data-parallel group."""
        if self.dp_group is None:
            return
        for p in self.module.parameters():
            dist.broadcast(p.data, src=self._dp_src_rank, group=self.dp_group)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    def state_dict_for_save_checkpoint(self, *args, **kwargs):
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
    Collective: one all-reduce SUM over `embedding_group`."""
    allreduce_grads_coalesced(params, embedding_group)
