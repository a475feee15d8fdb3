"""Tensor-parallel layers: VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear.

Shapes: activations are [s, b, h] (sequence first). With sequence parallelism (SP) the
tensors between TP regions are split along s: [s/tp, b, h].

Parameter attributes (Megatron's convention; optimizer, grad clipping and checkpoint code
read them):
  tensor_model_parallel  True when the parameter is split over TP (set even at TP=1, so
                         resharding code can find every splittable tensor)
  partition_dim          dimension that is split (0 for column / vocab, 1 for row)
  partition_stride       number of independently split blocks along partition_dim
  sequence_parallel      (row-parallel bias under SP) its grad is partial per rank and
                         must be all-reduced over TP before the optimizer step

Initialisation: with `use_cpu_initialization=True` the FULL fp32 weight is drawn on CPU
from the global torch generator and this rank keeps its slice, so any TP size starts from
the TP=1 model's weights (same seed, same construction order). Otherwise the local shard
is drawn directly on its device under the tracker's model-parallel fork.

Megatron-LM 23.05's constructor keywords are accepted with its meaning and defaults
(`gather_output=True`, `init_method=torch.nn.init.xavier_normal_`, keyword-only after the
two sizes): `sequence_parallel_enabled` (this module's `sequence_parallel`),
`perform_initialization=False` (allocate, set the TP attributes -- Megatron-LM leaves
them unset -- and draw nothing) and
`keep_master_weight_for_test=True` (with CPU initialisation: the full weight drawn is kept
as `layer.master_weight`).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state
from . import gemm_algos
from .grad_accumulation import accumulate_weight_grad, grad_into_main_grad
from .mappings import (
    TP_GROUP_OF_STATE,
    all_gather_dim0,
    all_gather_dim0_after,
    copy_to_tp,
    finish,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_dim0,
    reduce_scatter_to_sp,
    resolve_tp_group,
    scatter_to_tp,
    start_all_reduce,
)
from .random import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker

InitMethod = Callable[[torch.Tensor], object]

_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1,
                          "partition_stride": 1}


# --- parameter attributes ---------------------------------------------------------------
def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark `param` as a TP shard (or not) split along `dim` in `stride` blocks.

    As in Megatron-LM, a parameter that already carries one of these attributes is refused
    (marking it again would silently change how it is sharded, clipped and saved)."""
    already = {name: getattr(param, name) for name in _TP_ATTRIBUTE_DEFAULTS
               if hasattr(param, name)}
    if already:
        raise ValueError(
            f"set_tensor_model_parallel_attributes: the tensor already has {already}; it is "
            "marked once, when it is created (use copy_tensor_model_parallel_attributes to "
            "copy another tensor's marks, or delete these attributes first to re-mark it)")
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Give `param` the non-sharded defaults for any TP attribute it lacks."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the TP attributes of `source` (or the defaults) onto `destination`."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        setattr(destination, name, getattr(source, name, value))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor,
                                           tp_rank: Optional[int] = None) -> bool:
    """True when `param` should be counted on this rank: a shard, or TP rank 0's copy.

    Used to count each parameter once in grad-norm and parameter-count reductions.
    Without `tp_rank` (Megatron-LM's one-argument form): the tensor-parallel rank of
    `parallel_state.initialize_model_parallel`.
    """
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


# --- initialisation ---------------------------------------------------------------------
def init_method_normal(std: float) -> InitMethod:
    """Init function drawing N(0, std^2) in place."""

    def init_(tensor: torch.Tensor):
        return nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, (std / sqrt(2 * num_layers))^2): for the output projections of each layer."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


class XavierUniform:
    """Xavier (Glorot) uniform init: U(-a, a), a = sqrt(6 / (fan_in + fan_out)), the fans of
    the FULL weight [fan_out, fan_in]. Called on a tensor-parallel shard, pass the full
    weight's shape (`_init_weight` does): a shard's own fans would widen the bound with the
    tensor-parallel size (Megatron-LM's in-place shard init does that)."""

    def __call__(self, tensor: torch.Tensor, full_shape: Optional[Tuple[int, int]] = None):
        fan_out, fan_in = full_shape if full_shape is not None else tensor.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        return nn.init.uniform_(tensor, -bound, bound)


def _resolve_device(device, use_cpu_initialization: bool) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available() and not use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_of_full_weight(
    full: torch.Tensor, partition_dim: int, stride: int, rank: int, world_size: int
) -> torch.Tensor:
    """This rank's slice of a full weight: each of `stride` blocks split in `world_size`.

    E.g. a fused [gate; up] weight with stride 2: rank r gets gate chunk r and up chunk r.
    """
    blocks = torch.chunk(full, stride, dim=partition_dim)
    if any(b.size(partition_dim) % world_size for b in blocks) or len(blocks) != stride:
        raise ValueError(
            f"dimension {partition_dim} of size {full.size(partition_dim)} cannot be split in "
            f"{stride} blocks of {world_size} equal chunks"
        )
    own = [torch.chunk(b, world_size, dim=partition_dim)[rank] for b in blocks]
    return torch.cat(own, dim=partition_dim)


def _init_weight(
    weight: torch.Tensor, full_shape: Tuple[int, int], partition_dim: int, stride: int,
    init_method: InitMethod, use_cpu_initialization: bool, group,
    rng_tracker: Optional[RNGStatesTracker], perform: bool = True,
) -> Optional[torch.Tensor]:
    """Fill `weight` (this rank's shard) and set its TP attributes; with
    `use_cpu_initialization` return the full weight drawn (in the weight's dtype), else None.
    `perform=False` (Megatron's perform_initialization) sets the attributes only."""
    world, rank = group_size(group), group_rank(group)
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if not perform:
        return None
    with torch.no_grad():
        if use_cpu_initialization:
            full = torch.empty(full_shape, dtype=torch.float32)
            init_method(full)
            full = full.to(weight.dtype)
            weight.copy_(shard_of_full_weight(full, partition_dim, stride, rank, world))
            return full
        if world == 1:
            init_method(weight)
            return None
        tracker = get_rng_tracker() if rng_tracker is None else rng_tracker
        if not tracker.has(MODEL_PARALLEL_RNG):
            raise ValueError(
                "tensor-parallel weight init needs the model-parallel RNG stream; call "
                "model_parallel_seed(seed, tp_rank, tracker) before building layers, or pass "
                "use_cpu_initialization=True"
            )
        if torch.device(tracker.device).type != weight.device.type:
            raise ValueError(
                f"RNG tracker drives the {tracker.device} generator but the weight lives on "
                f"{weight.device}; build the tracker with device={weight.device.type!r}"
            )
        with tracker.fork():
            if isinstance(init_method, XavierUniform):
                init_method(weight, full_shape)
            else:
                init_method(weight)
    return None


# --- the linear with overlapped backward communication -----------------------------------
class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """y = x W^T + b with TP communication folded into forward and backward.

    Forward: with sequence_parallel, all-gather x along dim 0 ([s/tp,b,h] -> [s,b,h])
    before the matmul; otherwise no communication.
    Backward: grad_x = grad_y W is reduced over the group with async_op=True -- all-reduce
    when `async_grad_allreduce`, reduce-scatter along dim 0 when `sequence_parallel` --
    and the weight grad is computed while that collective is in flight. Under SP the
    gathered input is not kept: it is all-gathered again (async) while grad_x is computed.
    With `gradient_accumulation_fusion` and a `weight.main_grad` buffer the weight grad is
    added into main_grad and None is returned for it (the layers route the bias through
    `grad_into_main_grad`, which does the same for its grad). The buffer is also recorded
    on ctx at forward time, for a backward under full recompute, whose saved weight is a
    recomputed alias without `main_grad`.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                sequence_parallel, group):
        total_x = _setup_linear(ctx, x, weight, bias, gradient_accumulation_fusion,
                                async_grad_allreduce, sequence_parallel, group)
        return gemm_algos.linear_forward(total_x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = _linear_backward(
            ctx, grad_output, x, weight, gemm_algos.linear_dgrad, ctx.needs_input_grad[0],
            ctx.needs_input_grad[1], ctx.use_bias)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _setup_linear(ctx, x, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                  sequence_parallel, group, *more_saved):
    """Save what the backward needs; the input the product reads (gathered under SP)."""
    ctx.save_for_backward(x, weight, *more_saved)
    ctx.use_bias = bias is not None
    ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
    # The grad buffer itself (a persistent view, no activation memory): under full
    # recompute the saved weight comes back as a recomputed alias without `main_grad`.
    ctx.main_grad = getattr(weight, "main_grad", None) if gradient_accumulation_fusion else None
    ctx.async_grad_allreduce = async_grad_allreduce and group_size(group) > 1
    ctx.sequence_parallel = sequence_parallel and group_size(group) > 1
    ctx.group = group
    return all_gather_dim0(x, group) if ctx.sequence_parallel else x


def _linear_backward(ctx, grad_output, x, weight, dgrad, want_input_grad: bool,
                     want_weight_grad: bool, use_bias: bool):
    """(grad_input, grad_weight, grad_bias) of a linear layer, `dgrad(grad_output, weight)`
    giving the input grad, with the collectives of `_setup_linear`'s ctx."""
    group = ctx.group
    total_x, gather_handle = x, None
    grad_output = grad_output.contiguous()
    if ctx.sequence_parallel:
        total_x, gather_handle = all_gather_dim0_after(x, grad_output.view(-1)[:1], group)
    grad_input = dgrad(grad_output, weight) if want_input_grad else None
    total_x = finish(total_x, gather_handle)

    reduce_handle = None
    if grad_input is not None and ctx.sequence_parallel:
        grad_input, reduce_handle = reduce_scatter_dim0(grad_input, group, async_op=True)
    elif grad_input is not None and ctx.async_grad_allreduce:
        grad_input, reduce_handle = start_all_reduce(grad_input, group)

    # Weight and bias grads run while the input-grad collective is in flight.
    grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))
    total_x_2d = total_x.reshape(-1, total_x.size(-1))
    grad_weight = None
    if want_weight_grad:
        if ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
            accumulate_weight_grad(weight.main_grad, grad_output_2d, total_x_2d)
        elif ctx.main_grad is not None:  # recompute: the weight's alias lacks main_grad
            accumulate_weight_grad(ctx.main_grad, grad_output_2d, total_x_2d)
        else:
            grad_weight = grad_output_2d.t().matmul(total_x_2d)
    grad_bias = grad_output_2d.sum(dim=0) if use_bias else None

    if grad_input is not None:
        grad_input = finish(grad_input, reduce_handle)
    return grad_input, grad_weight, grad_bias


class LinearGeluEpilogue(torch.autograd.Function):
    """(act, pre) = (gelu_tanh(h), h) for h = x W^T (+ b), from one product whose epilogue
    adds the bias and applies the GeLU (gemm_algos.linear_gelu_forward); communication as
    in LinearWithGradAccumulationAndAsyncCommunication.

    `act` carries no gradient (non-differentiable output): its consumer must be
    `LinearAfterGelu`, which hands the gradient of the pre-activation to `pre`, so the
    backward here is a plain linear layer's backward fed with that gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                sequence_parallel, group):
        total_x = _setup_linear(ctx, x, weight, bias, gradient_accumulation_fusion,
                                async_grad_allreduce, sequence_parallel, group)
        act, pre = gemm_algos.linear_gelu_forward(total_x, weight, bias)
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)  # act's gradient stays None, not a zero tensor
        return act, pre

    @staticmethod
    def backward(ctx, grad_act, grad_pre):
        if grad_pre is None:
            return None, None, None, None, None, None, None
        x, weight = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = _linear_backward(
            ctx, grad_pre, x, weight, gemm_algos.linear_dgrad, ctx.needs_input_grad[0],
            ctx.needs_input_grad[1], ctx.use_bias)
        return grad_input, grad_weight, grad_bias, None, None, None, None


class LinearAfterGelu(torch.autograd.Function):
    """y = act W^T for act = gelu_tanh(pre) from LinearGeluEpilogue (row-parallel input,
    no communication here). The backward returns the gradient of `pre` (the input-grad
    product's epilogue multiplies by gelu'(pre): gemm_algos.linear_dgrad_dgelu) and none
    for `act`."""

    @staticmethod
    def forward(ctx, act, pre, weight, gradient_accumulation_fusion, group):
        _setup_linear(ctx, act, weight, None, gradient_accumulation_fusion, False, False, group,
                      pre)
        return gemm_algos.linear_forward(act, weight)

    @staticmethod
    def backward(ctx, grad_output):
        act, weight, pre = ctx.saved_tensors
        grad_pre, grad_weight, _ = _linear_backward(
            ctx, grad_output, act, weight,
            lambda g, w: gemm_algos.linear_dgrad_dgelu(g, w, pre), ctx.needs_input_grad[1],
            ctx.needs_input_grad[2], False)
        return None, grad_pre, grad_weight, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    x: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None, gradient_accumulation_fusion: bool = False,
    async_grad_allreduce: bool = False, sequence_parallel: Optional[bool] = None,
    group=TP_GROUP_OF_STATE, *, input: Optional[torch.Tensor] = None,  # noqa: A002
    sequence_parallel_enabled: Optional[bool] = None,
) -> torch.Tensor:
    """Functional form of `LinearWithGradAccumulationAndAsyncCommunication` (see there).
    Without `group`: the tensor-parallel group of `initialize_model_parallel`, as in
    Megatron-LM (`mappings.resolve_tp_group`); None is one process. Megatron-LM 23.05's
    keyword names `input=` and `sequence_parallel_enabled=` are accepted too."""
    where = "linear_with_grad_accumulation_and_async_allreduce"
    x = _one_of(where, "x", x, "input", input, None)
    sequence_parallel = _one_of(where, "sequence_parallel", sequence_parallel,
                                "sequence_parallel_enabled", sequence_parallel_enabled, False)
    if x is None or weight is None:
        raise TypeError(f"{where}() needs the input (x, or input=) and weight")
    group = resolve_tp_group(group, "linear_with_grad_accumulation_and_async_allreduce(group=...)")
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel,
        group,
    )


def _one_of(where: str, name: str, value, megatron_name: str, megatron_value, default):
    """The value of an argument that also has a Megatron-LM 23.05 name; both given and
    different is a ValueError naming both."""
    if megatron_value is None:
        return default if value is None else value
    same = value is megatron_value or (
        not isinstance(value, torch.Tensor) and value == megatron_value)
    if value is not None and not same:
        raise ValueError(f"{where}: {name}={value!r} and {megatron_name}={megatron_value!r} "
                         f"disagree; pass one of them ({megatron_name} is Megatron-LM's name)")
    return megatron_value


def _check_keep_master(layer: str, keep: bool, use_cpu_initialization: bool,
                       perform_initialization: bool) -> None:
    if keep and not (use_cpu_initialization and perform_initialization):
        raise ValueError(
            f"{layer}: keep_master_weight_for_test=True keeps the full weight drawn on CPU, "
            "which exists only with use_cpu_initialization=True and perform_initialization="
            "True; pass those, or drop keep_master_weight_for_test")


def _per_partition(size: int, world: int, layer: str, name: str) -> int:
    """`size // world` for a dimension split over TP; a ValueError naming the layer, the
    argument and both values otherwise (`divide`'s message names neither)."""
    if size % world:
        raise ValueError(
            f"{layer}: {name}={size} is not divisible by the tensor-parallel size {world}; "
            f"choose a {name} that is a multiple of {world} or another tensor-parallel size")
    return size // world


def _new_param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


def _zero_bias(size: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, dtype=dtype, device=device))


# --- layers -----------------------------------------------------------------------------
class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary over the TP group.

    Input: token ids [b, s] (global ids). Each rank looks up the ids that fall in its
    vocabulary range, zeroes the others, and the partial results are summed:
      * default: all-reduce over TP -> output [b, s, h] (like nn.Embedding; the model
        transposes to [s, b, h]). Backward: identity.
      * reduce_scatter_embeddings=True (sequence parallel): the partial [b, s, h] is
        transposed to [s, b, h] and reduce-scattered along s -> output [s/tp, b, h].
        Backward: all-gather along s. Only valid when nothing else (position embeddings)
        must be added to the full sequence before the split.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp_group=TP_GROUP_OF_STATE,
        init_method: InitMethod = nn.init.xavier_normal_,
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = False, reduce_scatter_embeddings: bool = False,
        device=None, rng_tracker: Optional[RNGStatesTracker] = None,
        perform_initialization: bool = True,
    ) -> None:
        super().__init__()
        tp_group = resolve_tp_group(tp_group, "VocabParallelEmbedding(tp_group=...)")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        world, rank = group_size(tp_group), group_rank(tp_group)
        self.num_embeddings_per_partition = _per_partition(
            num_embeddings, world, "VocabParallelEmbedding", "num_embeddings")
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        device = _resolve_device(device, use_cpu_initialization)
        self.weight = _new_param(
            (self.num_embeddings_per_partition, embedding_dim), params_dtype, device
        )
        _init_weight(self.weight, (num_embeddings, embedding_dim), 0, 1, init_method,
                     use_cpu_initialization, tp_group, rng_tracker, perform_initialization)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local_ids, self.weight)
            partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            partial = F.embedding(input_ids, self.weight)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sp(partial.transpose(0, 1).contiguous(), self.tp_group)
        return reduce_from_tp(partial, self.tp_group)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split along its output columns: rank r computes Y_r = X A_r + b_r.

    Input [s, b, h_in] (or [s/tp, b, h_in] with sequence_parallel); output
    [s, b, h_out/tp], or [s, b, h_out] when gather_output. Communication:
      * plain: input forward identity / backward all-reduce of grad_input (async,
        overlapped with the weight-grad matmul when async_tensor_model_parallel_allreduce;
        otherwise a synchronous copy_to_tp);
      * sequence_parallel: input all-gathered along s in forward, grad reduce-scattered in
        backward (async, overlapped);
      * gather_output: output all-gathered along the last dim (backward: split).
    forward(input, weight=None) returns (output, output_bias); output_bias is the bias
    when skip_bias_add (the caller adds it, e.g. fused into an activation), else None.
    `weight` overrides the layer's own weight (required with skip_weight_param_allocation,
    e.g. an output layer tied to the word embeddings).
    """

    def __init__(
        self, input_size: int, output_size: int, *, tp_group=TP_GROUP_OF_STATE, bias: bool = True,
        gather_output: bool = True, init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1, skip_bias_add: bool = False, sequence_parallel: Optional[bool] = None,
        async_tensor_model_parallel_allreduce: bool = True,
        params_dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = False,
        skip_weight_param_allocation: bool = False, device=None,
        gradient_accumulation_fusion: bool = False,
        rng_tracker: Optional[RNGStatesTracker] = None,
        sequence_parallel_enabled: Optional[bool] = None, perform_initialization: bool = True,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        sequence_parallel = _one_of("ColumnParallelLinear", "sequence_parallel", sequence_parallel,
                                    "sequence_parallel_enabled", sequence_parallel_enabled, False)
        _check_keep_master("ColumnParallelLinear", keep_master_weight_for_test,
                           use_cpu_initialization, perform_initialization)
        tp_group = resolve_tp_group(tp_group, "ColumnParallelLinear(tp_group=...)")
        world = group_size(tp_group)
        # at TP size 1 sequence parallelism is off (as in Megatron-LM 23.05), so gathering
        # the output is the identity and both may be asked for
        if sequence_parallel and gather_output and world > 1:
            raise ValueError(
                f"ColumnParallelLinear: gather_output=True (the default, as in Megatron-LM) "
                f"cannot be used with sequence_parallel=True at tensor-parallel size {world}; "
                "pass gather_output=False and gather in the caller")
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _per_partition(
            output_size, world, "ColumnParallelLinear", "output_size")
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        self.async_tensor_model_parallel_allreduce = (
            async_tensor_model_parallel_allreduce and world > 1 and not self.sequence_parallel
        )
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        device = _resolve_device(device, use_cpu_initialization)
        shape = (self.output_size_per_partition, input_size)
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = _new_param(shape, params_dtype, device)
            # with fusion every grad of the weight comes from accumulate_weight_grad
            self.weight.grad_overwrites_stale = gradient_accumulation_fusion
            full = _init_weight(self.weight, (output_size, input_size), 0, stride, init_method,
                                use_cpu_initialization, tp_group, rng_tracker,
                                perform_initialization)
            if keep_master_weight_for_test:
                self.master_weight = full
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(
        self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear built with skip_weight_param_allocation="
                                 "True needs the weight passed to forward(input, weight)")
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"weight passed to ColumnParallelLinear has shape "
                             f"{tuple(weight.shape)}, expected "
                             f"{(self.output_size_per_partition, self.input_size)}")
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel:
            input_parallel = input_
        else:
            input_parallel = copy_to_tp(input_, self.tp_group)
        bias = grad_into_main_grad(self.bias, self.gradient_accumulation_fusion)
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel, weight, None if self.skip_bias_add else bias,
            self.gradient_accumulation_fusion, self.async_tensor_model_parallel_allreduce,
            self.sequence_parallel, self.tp_group,
        )
        output = gather_from_tp(output_parallel, self.tp_group) if self.gather_output \
            else output_parallel
        return output, (bias if self.skip_bias_add else None)

    def forward_gelu(self, input_: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(act, pre): this layer's output (bias included) through the tanh-form GeLU
        computed in the product's epilogue, for `RowParallelLinear.forward_after_gelu` (the
        only consumer of `act`, which carries no gradient itself). Needs no skip_bias_add,
        gather_output or passed weight."""
        if self.skip_bias_add or self.gather_output or self.weight is None:
            raise ValueError("ColumnParallelLinear.forward_gelu needs a layer without "
                             "skip_bias_add, gather_output or a passed weight (the GeLU "
                             "epilogue adds the bias itself and keeps the output split)")
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel:
            input_parallel = input_
        else:
            input_parallel = copy_to_tp(input_, self.tp_group)
        bias = grad_into_main_grad(self.bias, self.gradient_accumulation_fusion)
        return LinearGeluEpilogue.apply(
            input_parallel, self.weight, bias, self.gradient_accumulation_fusion,
            self.async_tensor_model_parallel_allreduce, self.sequence_parallel, self.tp_group)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split along its input rows: Y = sum_r X_r A_r + b.

    Input [s, b, h_in/tp] when input_is_parallel (else [s, b, h_in], split here with
    scatter_to_tp: forward keep own chunk / backward all-gather). The partial products are
    summed with reduce_from_tp (forward all-reduce / backward identity), or under
    sequence_parallel with reduce_scatter_to_sp (forward reduce-scatter along s ->
    [s/tp, b, h_out] / backward all-gather). The bias is added after the reduction; under
    SP it is marked `sequence_parallel=True` because each rank sees only its part of the
    sequence, so its grad must be all-reduced over TP by the trainer.
    forward(input) returns (output, output_bias) as ColumnParallelLinear does.
    """

    def __init__(
        self, input_size: int, output_size: int, *, tp_group=TP_GROUP_OF_STATE, bias: bool = True,
        input_is_parallel: bool = False, init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1, skip_bias_add: bool = False, sequence_parallel: Optional[bool] = None,
        params_dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = False,
        device=None, gradient_accumulation_fusion: bool = False,
        rng_tracker: Optional[RNGStatesTracker] = None,
        sequence_parallel_enabled: Optional[bool] = None, perform_initialization: bool = True,
        keep_master_weight_for_test: bool = False,
    ) -> None:
        super().__init__()
        sequence_parallel = _one_of("RowParallelLinear", "sequence_parallel", sequence_parallel,
                                    "sequence_parallel_enabled", sequence_parallel_enabled, False)
        _check_keep_master("RowParallelLinear", keep_master_weight_for_test,
                           use_cpu_initialization, perform_initialization)
        tp_group = resolve_tp_group(tp_group, "RowParallelLinear(tp_group=...)")
        world = group_size(tp_group)
        if sequence_parallel and world > 1 and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires "
                             "input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _per_partition(
            input_size, world, "RowParallelLinear", "input_size")
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and world > 1
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        device = _resolve_device(device, use_cpu_initialization)
        self.weight = _new_param((output_size, self.input_size_per_partition), params_dtype,
                                 device)
        # as in ColumnParallelLinear: with fusion the weight-grad product writes every grad
        self.weight.grad_overwrites_stale = gradient_accumulation_fusion
        full = _init_weight(self.weight, (output_size, input_size), 1, stride, init_method,
                            use_cpu_initialization, tp_group, rng_tracker, perform_initialization)
        if keep_master_weight_for_test:
            self.master_weight = full
        if bias:
            self.bias = _zero_bias(output_size, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        input_parallel = input_ if self.input_is_parallel else scatter_to_tp(input_, self.tp_group)
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel, self.weight, None, self.gradient_accumulation_fusion,
            False, False, self.tp_group,
        )
        return self._reduce(output_parallel)

    def forward_after_gelu(self, act: torch.Tensor, pre: torch.Tensor
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """forward(act) for (act, pre) from ColumnParallelLinear.forward_gelu: the gradient
        goes to `pre` through the input-grad product's GeLU-derivative epilogue."""
        if not self.input_is_parallel:
            raise ValueError("RowParallelLinear.forward_after_gelu needs input_is_parallel=True")
        output_parallel = LinearAfterGelu.apply(act, pre, self.weight,
                                                self.gradient_accumulation_fusion, self.tp_group)
        return self._reduce(output_parallel)

    def _reduce(self, output_parallel: torch.Tensor):
        """Sum the partial products over TP, then the bias: (output, output_bias)."""
        if self.sequence_parallel:
            output = reduce_scatter_to_sp(output_parallel, self.tp_group)
        else:
            output = reduce_from_tp(output_parallel, self.tp_group)
        bias = grad_into_main_grad(self.bias, self.gradient_accumulation_fusion)
        if self.skip_bias_add or bias is None:
            return output, (bias if self.skip_bias_add else None)
        return output + bias, None
