"""Communication as named autograd pairs.

Each public function takes the process group it talks over. A group of `None`, or a
group of one process, means "single process": every function is then the identity in
both directions, so model code runs unchanged without torch.distributed.

Tensor-parallel (TP) functions split or gather the LAST dimension (hidden / vocab);
sequence-parallel (SP) functions split or gather dimension 0 (the sequence, since
activations are laid out [s, b, h]).

| function              | forward                         | backward                         |
|-----------------------|---------------------------------|----------------------------------|
| copy_to_tp            | identity                        | all-reduce                       |
| reduce_from_tp        | all-reduce                      | identity                         |
| scatter_to_tp         | keep own chunk of last dim      | all-gather last dim              |
| gather_from_tp        | all-gather last dim             | keep own chunk of last dim       |
| scatter_to_sp         | keep own chunk of dim 0         | all-gather dim 0                 |
| gather_from_sp        | all-gather dim 0                | reduce-scatter dim 0 (or split)  |
| reduce_scatter_to_sp  | reduce-scatter dim 0            | all-gather dim 0                 |
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import parallel_state

# torch >= 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    """Number of processes in `group`; 1 when `group` is None."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside `group`; 0 when `group` is None."""
    return 0 if group is None else dist.get_rank(group)


class _GroupOfInitializeModelParallel:
    def __repr__(self) -> str:
        return "<tensor-parallel group of initialize_model_parallel>"


# The default group of Megatron-LM 23.05's names that take one here (ColumnParallelLinear,
# RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy,
# linear_with_grad_accumulation_and_async_allreduce): ported code that leaves it out gets
# Megatron's group, the one `parallel_state.initialize_model_parallel` remembered. An
# explicit None stays one process (this project's model code always passes its group).
TP_GROUP_OF_STATE = _GroupOfInitializeModelParallel()


def resolve_tp_group(group, where: str):
    """`group` itself; for TP_GROUP_OF_STATE the tensor-parallel group remembered by
    `initialize_model_parallel` (before it: None in a one-process run, an error in a
    larger one). `where` names the call and its group argument, e.g. "f(group=...)"."""
    if group is not TP_GROUP_OF_STATE:
        return group
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{where} was not given and parallel_state.initialize_model_parallel() has not "
            f"been called in this {dist.get_world_size()}-process run, so the tensor-parallel "
            "group is unknown: call initialize_model_parallel(tensor_model_parallel_size) "
            "first (as in Megatron-LM), or pass the group (None: this process alone)")
    else:
        group = None
    forced = parallel_state._OVERRIDES.get("tp_size")
    if forced is not None and forced != group_size(group):
        raise ValueError(
            f"{where} was not given: set_tensor_model_parallel_world_size({forced}) is in "
            f"effect but the tensor-parallel group has {group_size(group)} process(es), and "
            "the layers here shard and communicate by their group: pass a group of "
            f"{forced} ranks, or set_tensor_model_parallel_world_size(None)")
    return group


# --- raw collectives (no autograd) ------------------------------------------------------
def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the group into a new contiguous tensor (`x` is left untouched).

    Out of place on purpose: autograd may hand the same grad tensor to several
    consumers (e.g. both branches of a residual add), so reducing it in place would
    corrupt the others.
    """
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def split_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal chunk of `x` along `dim` (contiguous)."""
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world != 0:
        raise ValueError(
            f"dimension {dim} of size {x.size(dim)} is not divisible by the group size {world}"
        )
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def all_gather_dim0(x: torch.Tensor, group, async_op: bool = False):
    """Concatenate every rank's `x` along dim 0. With async_op returns (tensor, handle)."""
    world = group_size(group)
    if world == 1:
        return (x, None) if async_op else x
    x = x.contiguous()
    if _traced():
        out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group.group_name)
        return (out, _FUNCTIONAL) if async_op else finish(out, _FUNCTIONAL)
    out = torch.empty((world * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = _all_gather_single(out, x, group=group, async_op=async_op)
    return (out, handle) if async_op else out


def reduce_scatter_dim0(x: torch.Tensor, group, async_op: bool = False):
    """Sum over ranks, keep this rank's chunk of dim 0. With async_op returns (tensor, handle)."""
    world = group_size(group)
    if world == 1:
        return (x, None) if async_op else x
    if x.size(0) % world != 0:
        raise ValueError(
            f"dimension 0 of size {x.size(0)} is not divisible by the group size {world}"
        )
    x = x.contiguous()
    if _traced():
        out = torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", world, group.group_name)
        return (out, _FUNCTIONAL) if async_op else finish(out, _FUNCTIONAL)
    out = torch.empty((x.size(0) // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = _reduce_scatter_single(out, x, group=group, async_op=async_op)
    return (out, handle) if async_op else out


# Collectives started for overlap return (result, handle) -- `start_all_reduce`,
# `all_gather_dim0_after`, and `all_gather_dim0` / `reduce_scatter_dim0` with async_op --
# and `finish(result, handle)` gives the result to read once the overlapped work is
# issued. Eagerly the handle is c10d's async work. Under torch.compile (torch >= 2.13,
# see TRACED_COLLECTIVES) every collective here is a functional op and its wait a
# separate `wait_tensor` node placed where `finish` is called, so a TP layer (with or
# without sequence parallelism) compiles as one graph that keeps the overlap (the layers
# compile with inductor's peak-memory reordering off, see `compile_layers`).
_FUNCTIONAL = "functional"
# Traced (functional) collectives are used from torch 2.13 on. On torch 2.11 a compiled
# tensor-parallel layer (gloo) trained to NaN from its second step with them; there
# `compile_layers` leaves layers with TP collectives uncompiled.
TRACED_COLLECTIVES = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _traced() -> bool:
    return TRACED_COLLECTIVES and torch.compiler.is_compiling()


def start_all_reduce(x: torch.Tensor, group):
    """Sum of `x` over the group started asynchronously (eagerly in place on a contiguous
    `x`, compiled out of place): (tensor, handle); see `finish`."""
    if group_size(group) == 1:
        return x, None
    if _traced():
        out = torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group.group_name)
        return out, _FUNCTIONAL
    x = x.contiguous()
    return x, dist.all_reduce(x, group=group, async_op=True)


def finish(result: torch.Tensor, handle) -> torch.Tensor:
    """Wait for a collective started for overlap; returns the tensor to use."""
    if handle is _FUNCTIONAL:
        return torch.ops._c10d_functional.wait_tensor(result)
    if handle is not None:
        handle.wait()
    return result


# The backward's re-gather of a sequence-parallel linear's input, as an operator of our
# own when compiled. Traced as the plain functional gather it would depend only on a
# forward value, so the partitioner would run it in the forward (merged with the forward's
# own gather) and save the whole-sequence result for backward. `after` (the output grad)
# ties it to the backward; its implementation only starts the gather, which `finish` waits
# for, so the compiled backward keeps the overlap with the input-grad GEMM.
_LIB = torch.library.Library("megatron", "FRAGMENT")
_LIB.define("all_gather_dim0_after(Tensor x, Tensor after, int world, str group_name) -> Tensor")


def _all_gather_dim0_after_impl(x, after, world, group_name):
    return torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world, group_name)


for _key in ("CPU", "CUDA"):
    _LIB.impl("all_gather_dim0_after", _all_gather_dim0_after_impl, _key)


@torch.library.register_fake("megatron::all_gather_dim0_after", lib=_LIB)
def _all_gather_dim0_after_fake(x, after, world, group_name):
    return x.new_empty((world * x.size(0),) + tuple(x.shape[1:]))


def all_gather_dim0_after(x: torch.Tensor, after: torch.Tensor, group):
    """`all_gather_dim0(x, group, async_op=True)` issued in the backward, once `after`
    exists (see above): (tensor, handle); see `finish`."""
    world = group_size(group)
    if world == 1:
        return x, None
    if _traced():
        out = torch.ops.megatron.all_gather_dim0_after(x, after, world, group.group_name)
        return out, _FUNCTIONAL
    return all_gather_dim0(x, group, async_op=True)


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension."""
    world = group_size(group)
    if world == 1:
        return x
    stacked = all_gather_dim0(x.unsqueeze(0), group)  # [world, *x.shape]
    return torch.cat(stacked.unbind(0), dim=-1).contiguous()


# --- autograd pairs ---------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region. Forward: identity. Backward: all-reduce (sum) of the grad."""
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region by summing partial results. Forward: all-reduce. Backward: identity."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    if group_size(group) == 1:
        return x
    return _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of dim 0 (sequence). Backward: all-gather dim 0."""
    if group_size(group) == 1:
        return x
    return _ScatterToSP.apply(x, group)


def gather_from_sp(
    x: torch.Tensor, group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Forward: all-gather dim 0 (sequence).

    Backward: reduce-scatter dim 0 when the consumer of the output is tensor-parallel
    (each rank holds a partial grad that must be summed); with
    `tensor_parallel_output_grad=False` the grad is already complete on every rank and
    backward just keeps this rank's chunk of dim 0.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: reduce-scatter (sum, keep own chunk of dim 0). Backward: all-gather dim 0."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSP.apply(x, group)


# --- Megatron-LM 23.05's names, for ported code -----------------------------------------
# Each reads the tensor-parallel group remembered by `parallel_state.initialize_model_parallel`
# (call that first) and does what the function above it names does; library code passes
# its group to those functions instead.
def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """`copy_to_tp` over the tensor-parallel group."""
    return copy_to_tp(input_, parallel_state.get_tensor_model_parallel_group())


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """`reduce_from_tp` over the tensor-parallel group."""
    return reduce_from_tp(input_, parallel_state.get_tensor_model_parallel_group())


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """`scatter_to_tp` over the tensor-parallel group."""
    return scatter_to_tp(input_, parallel_state.get_tensor_model_parallel_group())


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """`gather_from_tp` over the tensor-parallel group."""
    return gather_from_tp(input_, parallel_state.get_tensor_model_parallel_group())


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """`scatter_to_sp` over the tensor-parallel group."""
    return scatter_to_sp(input_, parallel_state.get_tensor_model_parallel_group())


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """`gather_from_sp` over the tensor-parallel group."""
    return gather_from_sp(input_, parallel_state.get_tensor_model_parallel_group(),
                          tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """`reduce_scatter_to_sp` over the tensor-parallel group."""
    return reduce_scatter_to_sp(input_, parallel_state.get_tensor_model_parallel_group())
