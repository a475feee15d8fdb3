"""Transformer layers of the GPT model: attention, MLP, layer, block (the norms are in
norms.py).

Shape legend: s = sequence (s/tp when sequence parallel), b = micro batch, h = hidden,
n = attention heads on this rank, g = query groups (key/value heads) on this rank,
d = head dim (kv_channels), f = ffn hidden size on this rank.

The parallel plan is visible in `ParallelAttention.__init__` and `ParallelMLP.__init__`:
query/key/value and the first MLP projection are column-parallel, the attention output
projection and the second MLP projection are row-parallel. Everything else reads like
single-device code.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from megatron.core import fused_activation
from megatron.core.config import ModelConfig
from megatron.core.fused_rotary import split_and_rotate
from megatron.core.models.gpt import grouped_experts
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron.core.tensor_parallel.layers import XavierUniform, _resolve_device
from megatron.core.tensor_parallel.mappings import TRACED_COLLECTIVES
from megatron.core.tensor_parallel.random import checkpoint as recompute_checkpoint
from megatron.core.tensor_parallel.random import checkpoint_distributed_input, get_rng_tracker
from megatron.core.tensor_parallel.utils import divide

from .norms import (  # noqa: F401 (the norm classes re-exported)
    LayerNorm,
    LayerNorm1P,
    RMSNorm,
    build_norm,
)


def _no_init(tensor: torch.Tensor) -> torch.Tensor:
    return tensor  # --no-initialization: the weights come from a checkpoint


def init_methods(config: ModelConfig):
    """(init, output_init): the weight initialisers of the model, Megatron's choice.

    Default: N(0, std^2) for every weight, N(0, (std / sqrt(2 * num_layers))^2) for the
    output projections of attention and MLP. `--init-method-xavier-uniform`: Xavier
    uniform for both (bounds from the full weights' fans at any tensor-parallel size).
    `--no-initialization`: weights are left as allocated (to be overwritten by a
    checkpoint). Norm weights and biases always start at 1 / 0."""
    if not config.perform_initialization:
        return _no_init, _no_init
    if config.init_method_xavier_uniform:
        return XavierUniform(), XavierUniform()
    return (init_method_normal(config.init_method_std),
            scaled_init_method_normal(config.init_method_std, config.num_layers))


def _gelu_auto(x: torch.Tensor) -> torch.Tensor:
    """`--gelu-kernel auto`: the polynomial's Triton kernels where they can run, else torch."""
    return fused_activation.gelu(x) if fused_activation.available(x.device) else F.gelu(x)


def _activation(name: str, config: Optional[ModelConfig] = None):
    if name == "gelu":
        kernel = config.gelu_kernel if config is not None else "torch"
        return {"polynomial": fused_activation.gelu, "auto": _gelu_auto}.get(kernel, F.gelu)
    if name == "openai_gelu":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "squared_relu":
        return lambda x: torch.pow(F.relu(x), 2)
    raise ValueError(f"unknown activation {name!r}")


# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5 on.
_SDPA_GQA = TorchVersion(torch.__version__) >= (2, 5)
_SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def sdpa_backend(name: str):
    """Context that restricts scaled_dot_product_attention to one kernel
    (`--attention-backend`); "auto" leaves torch's own choice."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA_BACKENDS[name])])


def _sm80_gpu(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU of compute capability 8.0 or newer (where cuDNN and
    flash attention take grouped k/v)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


class GradLikeOutput(torch.autograd.Function):
    """Identity whose backward hands on the gradient in the output's own strides (copied
    when it comes in others). For the attention's output: torch's cuDNN attention backward
    (seen on torch 2.11, CUDA 13, H100) caches its plan without the grad output's strides,
    so after one call whose grad output came in one layout, a call of the same shapes
    whose grad output came in another (a compiled layer's and an eager one's in one
    process: torch.compile picks the layout) computed wrong q/k/v gradients in silence --
    relative error ~1 with dropout 0, the wrong dropout mask with dropout. With the
    output's strides every call gives cuDNN one layout, the one it is built for."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        ctx.layout = (out.shape, out.stride())
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        shape, strides = ctx.layout
        if grad.stride() == strides:
            return grad
        return torch.empty_strided(shape, strides, dtype=grad.dtype,
                                   device=grad.device).copy_(grad)


def resolve_rng_tracker(rng_tracker, tp_group):
    """The tracker whose model-parallel stream a module's dropout draws from: `rng_tracker`;
    when None, at tensor-parallel size > 1 the process-wide default (`get_rng_tracker`),
    the one the sharded weights are then initialised from (layers.py), so each rank draws
    its own masks, as Megatron does; None at size 1 (the default generator is used)."""
    if rng_tracker is not None or tp_group is None:
        return rng_tracker
    return get_rng_tracker() if torch.distributed.get_world_size(tp_group) > 1 else None


def _linear_kwargs(config: ModelConfig, tp_group, device, rng_tracker=None) -> dict:
    return {
        "tp_group": tp_group,
        "rng_tracker": rng_tracker,
        "params_dtype": config.params_dtype,
        "use_cpu_initialization": config.use_cpu_initialization,
        "sequence_parallel": config.sequence_parallel,
        "gradient_accumulation_fusion": config.gradient_accumulation_fusion,
        "device": device,
    }


class ParallelMLP(nn.Module):
    """h -> f (column-parallel) -> activation -> h (row-parallel)."""

    def __init__(self, config: ModelConfig, tp_group=None, device=None, rng_tracker=None):
        super().__init__()
        kw = _linear_kwargs(config, tp_group, device, rng_tracker)
        init, output_init = init_methods(config)
        self.swiglu = config.swiglu
        fc1_out = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, fc1_out, bias=config.add_bias_linear, gather_output=False,
            init_method=init, stride=2 if self.swiglu else 1,
            async_tensor_model_parallel_allreduce=config.async_tensor_model_parallel_allreduce,
            **kw,
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, init_method=output_init, **kw,
        )
        self.act = None if self.swiglu else _activation(config.activation, config)
        # GeLU (tanh form), after fc1's bias, inside fc1's forward and fc2's input-grad
        # products (ColumnParallelLinear.forward_gelu, RowParallelLinear.forward_after_gelu):
        # asked for with --gelu-kernel epilogue, and auto's choice for the tanh form itself
        # (--openai-gelu, or Megatron's fused bias-GeLU), where it changes only the speed
        self.gelu_epilogue = (
            (config.gelu_kernel == "epilogue" and config.activation in ("gelu", "openai_gelu"))
            or (config.gelu_kernel == "auto" and config.activation == "openai_gelu"))

    def forward(self, x_sbh: torch.Tensor):
        if self.gelu_epilogue:
            return self.dense_4h_to_h.forward_after_gelu(*self.dense_h_to_4h.forward_gelu(x_sbh))
        h_sbf, bias = self.dense_h_to_4h(x_sbh)
        if bias is not None:
            h_sbf = h_sbf + bias
        return self.dense_4h_to_h(self.activation(h_sbf))  # (out [s,b,h], bias or None)

    def activation(self, h_sbf: torch.Tensor) -> torch.Tensor:
        """The activation applied to fc1's output (its bias added). With the GeLU epilogue
        `forward` never calls this; the tanh-form GeLU here is the same function, for the
        switch MLP's grouped experts, which have no epilogue."""
        if self.swiglu:  # silu(gate) * up, gate and up the halves of h (one kernel each way)
            return fused_activation.swiglu(h_sbf)
        if self.gelu_epilogue:
            return F.gelu(h_sbf, approximate="tanh")
        return self.act(h_sbf)


def build_router(config: ModelConfig, device=None) -> nn.Linear:
    """The switch MLP's router: nn.Linear(h, num_experts) with bias, torch's default init
    drawn from the CPU generator (Megatron-LM builds it on the host, like any plain torch
    module; also with --no-initialization), then moved to `device` in the model's dtype.
    The same seed gives every tensor-parallel rank the same router; it is replicated,
    never split."""
    target = _resolve_device(device, config.use_cpu_initialization)
    init_on = "meta" if target.type == "meta" else "cpu"
    router = nn.Linear(config.hidden_size, config.num_experts, bias=True,
                       dtype=config.params_dtype, device=init_on)
    router.to(target)
    for p in router.parameters():
        p.tensor_model_parallel = False
        p.sequence_parallel = False  # refused with experts (arguments_validate)
    return router


class SwitchMLP(nn.Module):
    """`--num-experts E`: Megatron-LM 23.05's top-1 mixture of experts in place of the MLP.

    router (`build_router`, replicated over TP) scores each token; experts[e] are E
    ParallelMLPs, each split over tensor-parallel ranks exactly as the dense MLP. Per token
    x: probs = softmax(router(x)) in the activation dtype, (p, e) = their max, and the
    output is p * expert_e(x), with expert e's fc2 bias times p returned separately (as
    the dense MLP returns its bias, for the layer's bias-dropout-add). No load-balancing
    loss, no capacity limit, no expert parallelism, no sequence parallelism (refused).

    Two dispatches of the same function. Grouped (grouped_experts.py), where
    torch._grouped_mm runs for the experts' dtype, device and widths (probed once for
    each, at the first call): tokens sorted by expert, every expert's fc1 and fc2 one
    grouped GEMM each over the experts' stacked weights; no host sync, fixed shapes. Loop
    (the fallback, and the reference in tests): tokens per expert counted on the host and
    each expert called as a module on its rows.

    Every expert's parameters get a gradient on every call, a zero one for an expert with
    no tokens (the loop runs it on zero rows; the grouped GEMMs give it a zero slice): the
    grad hooks, the bucketed all-reduce and the distributed optimizer see the same
    sequence of ready parameters on all data-parallel ranks. This module runs eagerly,
    outside the compiled layer graphs (the loop's shapes are data-dependent).
    """

    def __init__(self, config: ModelConfig, tp_group=None, device=None, rng_tracker=None):
        super().__init__()
        _keep_switch_mlp_eager()
        if config.sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True cannot be used with num_experts={config.num_experts}:"
                " each tensor-parallel rank would route its own slice of the sequence while "
                "the experts' split products need the same tokens on every rank (Megatron-LM "
                "23.05's switch MLP has the same limit); set sequence_parallel=False")
        self.router = build_router(config, device)
        self.experts = nn.ModuleList(ParallelMLP(config, tp_group, device, rng_tracker)
                                     for _ in range(config.num_experts))
        self.tp_group = tp_group
        self.expert_params = grouped_experts.ExpertParams()  # see there: DDP's pre-hook
        self.dispatch = "auto"  # "auto" | "grouped" | "loop" (tests and benchmarks pick one)

    def grouped_dispatch(self) -> bool:
        """Whether this call uses the grouped GEMMs: with "auto", where the probe
        (`grouped_experts.grouped_mm_works`, run once per device, dtype and widths, then
        a cache lookup) passed for the experts' fc1 and fc2 weights as they are now."""
        if self.dispatch != "auto":
            return self.dispatch == "grouped"
        expert = self.experts[0]
        return all(grouped_experts.grouped_mm_works(w.device, w.dtype, *w.shape[::-1])
                   for w in (expert.dense_h_to_4h.weight, expert.dense_4h_to_h.weight))

    def sync_free(self) -> bool:
        """Whether a call needs nothing from the host (whole-step CUDA graphs): the
        grouped dispatch, with a grouped GEMM known to run on the device alone."""
        weight = self.experts[0].dense_h_to_4h.weight
        return self.grouped_dispatch() and grouped_experts.sync_free(weight.device,
                                                                     weight.dtype)

    def forward(self, x_sbh: torch.Tensor):
        s, b, h = x_sbh.shape
        probs_sbe = torch.softmax(self.router(x_sbh), dim=-1)
        prob_sb, expert_sb = probs_sbe.max(dim=-1)
        expert_t = expert_sb.reshape(-1)  # t = s * b tokens
        order_t = torch.argsort(expert_t, stable=True)  # tokens grouped by expert
        inverse_t = torch.empty_like(order_t).scatter_(
            0, order_t, torch.arange(order_t.numel(), device=order_t.device))
        x_th = x_sbh.reshape(-1, h).index_select(0, order_t)
        experts = self._experts_grouped if self.grouped_dispatch() else self._experts_loop
        out_th, bias_th = experts(x_th, expert_t, order_t, inverse_t)
        scale_t1 = prob_sb.reshape(-1, 1)
        out_sbh = (out_th.index_select(0, inverse_t) * scale_t1).view(s, b, h)
        if bias_th is None:
            return out_sbh, None
        return out_sbh, (bias_th * scale_t1).view(s, b, h)

    def _experts_loop(self, x_th, expert_t, order_t, inverse_t):
        """(outputs [t, h] in the sorted order of `x_th`, fc2 biases [t, h] in token order
        or None): one host sync (the counts) and one module call per expert."""
        h = x_th.shape[-1]
        counts = torch.bincount(expert_t, minlength=len(self.experts)).tolist()
        outs, biases = [], []
        for expert, x_nh in zip(self.experts, x_th.split(counts)):
            out_n1h, bias_h = expert(x_nh.unsqueeze(1))  # [n, 1, h]: n tokens as a sequence
            outs.append(out_n1h.squeeze(1))
            if bias_h is not None:
                biases.append(bias_h.expand(x_nh.shape[0], h))
        bias_th = torch.cat(biases).index_select(0, inverse_t) if biases else None
        return torch.cat(outs), bias_th

    def _experts_grouped(self, x_th, expert_t, order_t, inverse_t):
        """As `_experts_loop`, by two grouped GEMMs over the stacked expert weights, with
        no host sync."""
        fc1s = [e.dense_h_to_4h for e in self.experts]
        fc2s = [e.dense_4h_to_h for e in self.experts]
        biased = fc1s[0].bias is not None
        params = self.expert_params(*(m.weight for m in fc1s), *(m.weight for m in fc2s),
                                    *((m.bias for m in fc1s + fc2s) if biased else ()))
        num = len(self.experts)
        fc1_w, fc2_w, fc1_b, fc2_b = (params[i * num:(i + 1) * num] for i in range(4))
        out_th = grouped_experts.experts_forward(
            x_th, expert_t.index_select(0, order_t), fc1_w, fc1_b if biased else None, fc2_w,
            self.experts[0].activation, self.tp_group)
        return out_th, grouped_experts.expert_rows(expert_t, fc2_b) if biased else None


def _keep_switch_mlp_eager() -> None:
    """Mark SwitchMLP.forward as never compiled (torch.compiler.disable), once, when the
    first switch MLP is built: before any torch.compile can meet one. Not at class
    definition: torch.compiler.disable imports torch._dynamo, about a second of every
    process's start-up, dense models included."""
    if not getattr(SwitchMLP.forward, "_torchdynamo_disable", False):
        SwitchMLP.forward = torch.compiler.disable(SwitchMLP.forward)


class ParallelAttention(nn.Module):
    """Causal self-attention with heads split across tensor-parallel ranks.

    The fused QKV weight is laid out per query group: [q x (n/g), k, v] blocks of d rows,
    so a contiguous split over ranks gives each rank whole groups (Megatron's ordering).

    Precision: for fp16/bf16 inputs scaled_dot_product_attention computes the scores and
    the softmax in fp32 (the math backend upcasts, the fused kernels accumulate in fp32).
    That is what --attention-softmax-in-fp32 asks for, and what query-key layer scaling
    (on unless --no-query-key-layer-scaling) only approximated to keep fp16 scores from
    overflowing; both flags are therefore no-ops here (tests/test_mixed_precision.py).
    """

    def __init__(self, config: ModelConfig, tp_group=None, rng_tracker=None, device=None):
        super().__init__()
        tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.config = config
        self.rng_tracker = rng_tracker = resolve_rng_tracker(rng_tracker, tp_group)
        self.d = config.kv_channels
        self.n = divide(config.num_attention_heads, tp)
        self.g = divide(config.num_query_groups, tp)
        kw = _linear_kwargs(config, tp_group, device, rng_tracker)
        init, output_init = init_methods(config)
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * self.d
        self.query_key_value = ColumnParallelLinear(
            config.hidden_size, qkv_out, bias=config.add_bias_linear, gather_output=False,
            init_method=init,
            async_tensor_model_parallel_allreduce=config.async_tensor_model_parallel_allreduce,
            **kw,
        )
        self.dense = RowParallelLinear(
            config.num_attention_heads * self.d, config.hidden_size, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, init_method=output_init, **kw,
        )
        self.selective_recompute = config.recompute_granularity == "selective"
        self._sm80 = _sm80_gpu(self.query_key_value.weight.device)

    def _apply(self, fn, *args, **kwargs):
        """Moves (.to, .cuda, .to_empty all come through here) re-read `_sm80` from where
        the weights now are: a model built on "meta" and moved to the GPU (tools/
        generate.py) takes SDPA's grouped k/v like one built there. Not in forward, which
        runs under torch.compile."""
        module = super()._apply(fn, *args, **kwargs)
        self._sm80 = _sm80_gpu(self.query_key_value.weight.device)
        return module

    def _split_qkv(self, qkv_sbx: torch.Tensor):
        s, b, _ = qkv_sbx.shape
        per_group = self.n // self.g
        x = qkv_sbx.view(s, b, self.g, (per_group + 2) * self.d)
        q, k, v = torch.split(x, [per_group * self.d, self.d, self.d], dim=-1)
        return q.reshape(s, b, self.n, self.d), k, v  # k, v: [s, b, g, d]

    def _dropout_rng(self):
        """The model-parallel RNG stream while attention dropout is on (each TP rank holds
        other heads, so draws other masks). Forked around the selective-recompute
        checkpoint, not inside it: torch's checkpoint then replays the forked generator
        state (eager: the state it saved; compiled: its functionalized RNG). A fork inside
        a compiled checkpoint made the recompute draw another mask than the forward."""
        if self.rng_tracker and self.training and self.config.attention_dropout > 0:
            return self.rng_tracker.fork()
        return contextlib.nullcontext()

    def _recompute_core(self) -> bool:
        """Selective recompute of the attention core (training only), except in a compiled
        layer with attention dropout: there torch.compile recomputes the fused CUDA
        attention kernels (memory-efficient, flash, cuDNN) in backward, which draw their
        dropout mask again from their own RNG, so the backward differentiated another mask
        than the forward applied (gradient audit, H100 fp32: directional error ~1; the math
        kernel's dropout is replayed). Those kernels keep no s x s probabilities: without
        the recompute a layer keeps the kernel's [b, n, s, d] output and log-sum-exp."""
        if not (self.selective_recompute and self.training):
            return False
        return not (torch.compiler.is_compiling() and self.config.attention_dropout > 0)

    def _core_attention(self, q_bnsd, k_bgsd, v_bgsd, attention_mask=None):
        dropout_p = self.config.attention_dropout if self.training else 0.0
        with sdpa_backend(self.config.attention_backend):
            k_bgsd, v_bgsd, gqa = self.grouped_kv(q_bnsd, k_bgsd, v_bgsd, attention_mask)
            # attention_mask: [b, 1, s, s] bool, True = masked (Megatron's convention;
            # SDPA's boolean mask means the opposite), or the additive bias that
            # `attention_bias` made of it once for all layers. None = plain causal.
            out = F.scaled_dot_product_attention(
                q_bnsd, k_bgsd, v_bgsd, attn_mask=_sdpa_mask(attention_mask, q_bnsd.dtype),
                is_causal=attention_mask is None, dropout_p=dropout_p,
                scale=1.0 / math.sqrt(self.d), **gqa,
            )
        return GradLikeOutput.apply(out) if out.is_cuda else out

    def grouped_kv(self, q_bnsd, k_bgsd, v_bgsd, attention_mask):
        """(k, v, extra SDPA kwargs) for the query heads: the groups as they are with
        `enable_gqa` where the kernel takes them (`_native_gqa`), else each group repeated
        to its n/g query heads; unchanged without grouped-query attention."""
        if self.g == self.n:
            return k_bgsd, v_bgsd, {}
        if self._native_gqa(q_bnsd, attention_mask):
            return k_bgsd, v_bgsd, {"enable_gqa": True}
        rep = self.n // self.g
        return k_bgsd.repeat_interleave(rep, dim=1), v_bgsd.repeat_interleave(rep, dim=1), {}

    def _native_gqa(self, q: torch.Tensor, attention_mask) -> bool:
        """Whether SDPA gets the query groups' k and v as they are (`enable_gqa`: the
        kernel maps query head i to group i // (n/g), and sums the k/v grads of a group
        itself) rather than repeated to every query head. Only where a kernel that does
        this will be chosen: cuDNN and flash attention (half precision, sm80 and newer)
        and the CPU's; the memory-efficient kernel has no such mode (the masked case and
        fp32 on the GPU use it), and torch < 2.5 has no `enable_gqa`."""
        if not _SDPA_GQA or attention_mask is not None:
            return False
        if self.config.attention_backend == "efficient":
            return False
        if q.device.type == "cpu":
            return True
        return q.dtype in (torch.float16, torch.bfloat16) and self._sm80

    def forward(self, x_sbh: torch.Tensor, rotary_table: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        qkv, bias = self.query_key_value(x_sbh)
        if bias is not None:
            qkv = qkv + bias
        if rotary_table is None:
            q, k, v = self._split_qkv(qkv)  # [s, b, n|g, d]
        else:  # split and rotate in one operator (megatron/core/fused_rotary.py)
            q, k, v = split_and_rotate(qkv, rotary_table, self.g, self.n // self.g, self.d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n|g, s, d]
        with self._dropout_rng():
            if self._recompute_core():
                ctx = recompute_checkpoint(self._core_attention, q, k, v, attention_mask,
                                           tracker=self.rng_tracker)
            else:
                ctx = self._core_attention(q, k, v, attention_mask)
        s, b = qkv.shape[0], qkv.shape[1]  # full sequence: SP inputs were gathered by the QKV linear
        ctx_sbx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.n * self.d)
        return self.dense(ctx_sbx)  # (out [s,b,h], bias or None)


class TransformerLayer(nn.Module):
    """Pre-LN block: x + Attn(LN(x)), then x + MLP(LN(x)) (post-LN residual optional)."""

    def __init__(self, config: ModelConfig, layer_number: int, tp_group=None, rng_tracker=None,
                 device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.rng_tracker = rng_tracker = resolve_rng_tracker(rng_tracker, tp_group)
        self.input_layernorm = build_norm(config)
        self.self_attention = ParallelAttention(config, tp_group, rng_tracker, device)
        self.post_attention_layernorm = build_norm(config)
        mlp = SwitchMLP if config.num_experts else ParallelMLP
        self.mlp = mlp(config, tp_group, device, rng_tracker)

    def _residual_dropout(self, out, bias, residual):
        if bias is not None:
            out = out + bias
        if self.config.fp32_residual_connection:
            residual = residual.float()  # the sum (the residual stream) stays fp32
        p = self.config.hidden_dropout if self.training else 0.0
        if p > 0:
            # Under sequence parallelism each rank holds different tokens: use the
            # model-parallel RNG so masks differ across TP ranks.
            sp = self.config.sequence_parallel and self.rng_tracker is not None
            with self.rng_tracker.fork() if sp else contextlib.nullcontext():
                out = F.dropout(out, p=p, training=True)
        return residual + out

    def forward(self, x_sbh: torch.Tensor, rotary_table: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        if not self.config.apply_residual_connection_post_layernorm:
            ln = self.input_layernorm(x_sbh)
            return self.forward_from_norm(x_sbh, ln, None, rotary_table, attention_mask)[0]
        ln = self.input_layernorm(x_sbh)  # post-LN residuals: the sums start from the norms
        out, bias = self.self_attention(ln, rotary_table, attention_mask)
        x_sbh = self._residual_dropout(out, bias, ln)
        ln = self.post_attention_layernorm(x_sbh)
        out, bias = self.mlp(ln)
        return self._residual_dropout(out, bias, ln)

    def forward_from_norm(self, x_sbh: torch.Tensor, ln_sbh: torch.Tensor,
                          next_norm: Optional[nn.Module],
                          rotary_table: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None):
        """The pre-LN layer with its input norm done by the caller (`ln_sbh` =
        input_layernorm(x_sbh)) and the following norm (the next layer's input norm, or the
        final norm) applied here: returns (output, next_norm(output)), (output, None) when
        `next_norm` is None. Compiled per layer, this puts each residual add in one kernel
        with the norm that reads it, forward and backward, as compiling the whole stack
        does, while every layer still shares one compiled graph."""
        out, bias = self.self_attention(ln_sbh, rotary_table, attention_mask)
        x_sbh = self._residual_dropout(out, bias, x_sbh)
        out, bias = self.mlp(self.post_attention_layernorm(x_sbh))
        x_sbh = self._residual_dropout(out, bias, x_sbh)
        return x_sbh, None if next_norm is None else next_norm(x_sbh)


def _layer_unit(layer, x_sbh, ln_sbh, next_norm, rotary_table, attention_mask):
    """What the layer scope compiles: one layer from its input norm to the next norm (the
    modules are arguments, so every layer runs the same compiled graph)."""
    return layer.forward_from_norm(x_sbh, ln_sbh, next_norm, rotary_table, attention_mask)


def compile_layers(fn, mode: str = "default", tp_collectives: bool = False):
    """torch.compile of layer code with `mode` (a torch.compile mode; "default" = none).

    With tensor-parallel collectives in the graph, inductor's reordering for peak memory
    is off: it does not know what a collective overlaps, and moves the weight-grad GEMM
    ahead of the input-grad GEMM and a collective's wait next to its start, which
    serialises the backward's communication. In the order the layers issue them, each
    collective is started before the GEMM it overlaps and waited for after it.

    Before torch 2.13 layers with TP collectives are not compiled (returned as they are,
    with a warning): on torch 2.11 a compiled tensor-parallel layer trained to NaN."""
    if tp_collectives and not TRACED_COLLECTIVES:
        warnings.warn(f"torch {torch.__version__}: layers with tensor-parallel collectives "
                      "run eagerly (compiled they need torch >= 2.13)", stacklevel=2)
        return fn
    options = dict(torch._inductor.list_mode_options(mode))
    if tp_collectives:
        options["reorder_for_peak_memory"] = False
    return torch.compile(fn, dynamic=False, options=options)


def attention_bias(attention_mask: Optional[torch.Tensor], dtype: torch.dtype):
    """The [b, 1, s, s] bool mask (True = masked) as an additive bias (0 / -inf) in `dtype`,
    made once per forward and shared by every layer: SDPA turns a bool mask into such a
    bias itself and the backward keeps it, so passing the bool mask would keep one s x s
    copy per layer (4 GiB each in fp32 at s = 32768)."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return attention_mask
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill_(attention_mask, float("-inf"))


def _sdpa_mask(attention_mask: Optional[torch.Tensor], dtype: torch.dtype):
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return ~attention_mask
    return attention_mask if attention_mask.dtype == dtype else attention_mask.to(dtype)


class TransformerBlock(nn.Module):
    """A stack of layers (this pipeline stage's share) plus the final norm on the last stage.

    `layer_offset` is the global index of the first layer, so layers are numbered as in
    the whole model (1-based, as Megatron's `layer_number`).
    """

    def __init__(self, config: ModelConfig, num_layers: int, layer_offset: int = 0,
                 post_process: bool = True, tp_group=None, rng_tracker=None, device=None):
        super().__init__()
        self.config = config
        self.rng_tracker = rng_tracker = resolve_rng_tracker(rng_tracker, tp_group)
        self.tp_collectives = tp_group is not None and torch.distributed.get_world_size(tp_group) > 1
        # With sequence parallelism the layer input is already split over the TP ranks.
        self.distribute_group = (tp_group if config.distribute_saved_activations
                                 and not config.sequence_parallel else None)
        self.layers = nn.ModuleList(
            TransformerLayer(config, layer_offset + i + 1, tp_group, rng_tracker, device)
            for i in range(num_layers)
        )
        self.final_layernorm = build_norm(config) if post_process else None
        self._compiled = None
        self._compiled_block = None
        self._compiled_unit = None

    def _compile(self, fn):
        return compile_layers(fn, self.config.compile_mode, self.tp_collectives)

    def _run_layers(self, x_sbh, rotary_table, attention_mask):
        for layer in self.layers:
            x_sbh = layer(x_sbh, rotary_table, attention_mask)
        return x_sbh

    def _layer_fns(self):
        if not self.config.compile_layers:
            return list(self.layers)
        if self._compiled is None:
            # Regional compilation: one compiled graph per layer, shared code, short start-up.
            self._compiled = [self._compile(layer) for layer in self.layers]
        return self._compiled

    def _recompute(self, i: int) -> bool:
        c = self.config
        if c.recompute_granularity != "full" or not self.training:
            return False
        if c.recompute_method == "block":
            return i < c.recompute_num_layers
        return True  # uniform: every layer (chunks of recompute_num_layers share nothing)

    def _norms_across_layers(self) -> bool:
        """Layer scope, compiled, no full recompute, pre-LN: each layer's compiled graph
        ends with the next norm (TransformerLayer.forward_from_norm)."""
        c = self.config
        return (c.compile_layers and c.compile_scope == "layer" and len(self.layers) > 0
                and c.recompute_granularity != "full"
                and not c.apply_residual_connection_post_layernorm)

    def _run_norms_across_layers(self, x_sbh, rotary_table, attention_mask):
        if self._compiled_unit is None:
            self._compiled_unit = self._compile(_layer_unit)
        layers = self.layers
        ln = layers[0].input_layernorm(x_sbh)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.final_layernorm
            x_sbh, ln = self._compiled_unit(layer, x_sbh, ln, nxt, rotary_table, attention_mask)
        return x_sbh if self.final_layernorm is None else ln

    def _attention_dtype(self) -> torch.dtype:
        """The dtype q has in the attention kernel: the layers' weights' (bf16/fp16/fp32)."""
        for param in self.layers.parameters():
            return param.dtype
        return torch.float32

    def forward(self, x_sbh: torch.Tensor, rotary_table: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        c = self.config
        attention_mask = attention_bias(attention_mask, self._attention_dtype())
        if c.compile_layers and c.compile_scope == "block" and c.recompute_granularity != "full":
            if self._compiled_block is None:
                self._compiled_block = self._compile(self._run_layers)
            x_sbh = self._compiled_block(x_sbh, rotary_table, attention_mask)
            return x_sbh if self.final_layernorm is None else self.final_layernorm(x_sbh)
        if self._norms_across_layers():
            return self._run_norms_across_layers(x_sbh, rotary_table, attention_mask)
        for i, layer in enumerate(self._layer_fns()):
            if self._recompute(i) and self.distribute_group is not None:
                x_sbh = checkpoint_distributed_input(
                    layer, x_sbh, rotary_table, attention_mask, group=self.distribute_group,
                    tracker=self.rng_tracker)
            elif self._recompute(i):
                x_sbh = recompute_checkpoint(layer, x_sbh, rotary_table, attention_mask,
                                             tracker=self.rng_tracker)
            else:
                x_sbh = layer(x_sbh, rotary_table, attention_mask)
        if self.final_layernorm is not None:
            x_sbh = self.final_layernorm(x_sbh)
        return x_sbh
