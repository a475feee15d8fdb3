"""The GPT model: embeddings -> transformer block -> output layer -> per-token loss.

Shape legend: b = micro batch, s = sequence (s/tp inside the block with sequence
parallelism), h = hidden, V = padded vocabulary (V/tp on each tensor-parallel rank).

Module names follow Megatron's checkpoint keys (`language_model.embedding.word_embeddings`,
`language_model.encoder.layers.<i>.self_attention.query_key_value`, ...), so a state_dict
maps one to one onto a Megatron `model_optim_rng.pt` payload.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron.core.config import ModelConfig
from megatron.core.fused_cross_entropy import linear_cross_entropy, use_fused
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    group_rank,
    reduce_from_tp,
    scatter_to_sp,
    vocab_parallel_cross_entropy,
)

from .rotary import rotary_dim, rotary_table
from .transformer import TransformerBlock, init_methods, resolve_rng_tracker

_COMPILED_CE = None


def plain_cross_entropy(logits_sbv: torch.Tensor, labels_sb: torch.Tensor) -> torch.Tensor:
    """Per-token loss [s, b] in fp32 from full-vocabulary logits (tensor-parallel size 1).

    Under torch.compile the upcast fuses into the softmax reductions, so fp32 logits are
    never materialised for the whole batch; forward and backward each read the logits once
    or twice instead of the many fp32 passes of the unfused path."""
    flat = logits_sbv.float().flatten(0, 1)
    loss = torch.nn.functional.cross_entropy(flat, labels_sb.flatten(), reduction="none")
    return loss.view(labels_sb.shape)


def half_precision_cross_entropy(logits_sbv: torch.Tensor, labels_sb: torch.Tensor,
                                 tp_group=None) -> torch.Tensor:
    """Per-token loss [s, b] computed in the logits' own dtype (`--fp16-lm-cross-entropy`):
    no fp32 copy of the [s, b, V/tp] logits is made, and the loss comes back in fp16, as
    Megatron computes it with that flag. Vocabulary-parallel like
    `vocab_parallel_cross_entropy`; collectives over `tp_group`: forward all-reduce MAX of
    the max logit (no grad), then all-reduce SUM of the target logit and of sum(exp);
    backward identity for both (`reduce_from_tp`)."""
    with torch.no_grad():
        logits_max = logits_sbv.max(dim=-1)[0]
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX,
                                         group=tp_group)
    shifted = logits_sbv - logits_max.unsqueeze(-1)
    vocab_start = group_rank(tp_group) * shifted.size(-1)
    outside = (labels_sb < vocab_start) | (labels_sb >= vocab_start + shifted.size(-1))
    local = (labels_sb - vocab_start).masked_fill(outside, 0)
    target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), tp_group)
    return torch.log(sum_exp) - reduce_from_tp(target, tp_group)


def compiled_cross_entropy():
    global _COMPILED_CE
    if _COMPILED_CE is None:
        _COMPILED_CE = torch.compile(plain_cross_entropy, dynamic=False)
    return _COMPILED_CE


class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) plus learned absolute positions, then dropout.

    Output [s, b, h], or [s/tp, b, h] with sequence parallelism (scattered along s), in
    the compute dtype (fp32 with --fp32-residual-connection). With
    --embedding-weights-in-fp32 the word-embedding table is an fp32 parameter whatever
    the compute dtype (the lookup is exact; the tied output layer casts it).
    """

    def __init__(self, config: ModelConfig, tp_group=None, rng_tracker=None, device=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.rng_tracker = rng_tracker = resolve_rng_tracker(rng_tracker, tp_group)
        init, _ = init_methods(config)
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, tp_group=tp_group,
            init_method=init, params_dtype=word_embedding_dtype(config),
            use_cpu_initialization=config.use_cpu_initialization, device=device,
            rng_tracker=rng_tracker,
        )
        self.position_embeddings = None
        if config.add_position_embedding:
            shape = (config.max_position_embeddings, config.hidden_size)
            where = "cpu" if config.use_cpu_initialization else device
            # Without initialisation nn.Embedding must not draw its default N(0, 1) either.
            empty = (None if config.perform_initialization else
                     torch.empty(shape, dtype=config.params_dtype, device=where))
            self.position_embeddings = nn.Embedding(*shape, dtype=config.params_dtype,
                                                    device=where, _weight=empty)
            init(self.position_embeddings.weight)
            self.position_embeddings.to(device)
            self.position_embeddings.weight.tensor_model_parallel = False
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]):
        emb_bsh = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            emb_bsh = emb_bsh + self.position_embeddings(position_ids)
        emb_sbh = emb_bsh.transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            emb_sbh = emb_sbh.float()
        else:
            emb_sbh = emb_sbh.to(self.config.params_dtype)
        if self.config.sequence_parallel:
            emb_sbh = scatter_to_sp(emb_sbh, self.tp_group)
            if self.rng_tracker is not None and self.training and self.dropout.p > 0:
                with self.rng_tracker.fork():
                    return self.dropout(emb_sbh)
        return self.dropout(emb_sbh)


class CastTo(nn.Module):
    """`forward(tensor, dtype)` -> `tensor.to(dtype)`. A module call, so that wrappers which
    wait for a parameter before the module that receives it (the distributed optimizer's
    overlapped all-gather) see the parameter itself, not the cast copy."""

    def forward(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor.to(dtype)


def word_embedding_dtype(config: ModelConfig) -> torch.dtype:
    """dtype of the word-embedding table (and of its copy on the last pipeline stage)."""
    return torch.float32 if config.embedding_weights_in_fp32 else config.params_dtype


class LanguageModel(nn.Module):
    """Holds the three parts under Megatron's names: embedding, encoder, output_layer."""

    def __init__(self, config: ModelConfig, num_layers: int, layer_offset: int,
                 pre_process: bool, post_process: bool, tp_group, rng_tracker, device):
        super().__init__()
        if pre_process:
            self.embedding = Embedding(config, tp_group, rng_tracker, device)
        self.encoder = TransformerBlock(
            config, num_layers, layer_offset, post_process, tp_group, rng_tracker, device
        )
        if post_process and config.untie_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, tp_group=tp_group, bias=False,
                gather_output=False, init_method=init_methods(config)[0],
                sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                use_cpu_initialization=config.use_cpu_initialization, device=device,
                rng_tracker=rng_tracker,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            )


class GPTModel(nn.Module):
    """GPT for one pipeline stage (the whole model when pp = 1).

    forward(input_ids [b, s], position_ids [b, s] or None, labels [b, s] or None,
            attention_mask [b, 1, s, s] bool (True = masked) or None for plain causal)
      -> per-token losses [b, s] when labels are given (fp32; in the logits' dtype with
         --fp16-lm-cross-entropy), else logits [b, s, V/tp].
    Stages other than the first take `hidden_sbh` instead of input ids (see `set_input`).
    """

    def __init__(self, config: ModelConfig, tp_group=None, rng_tracker=None,
                 pre_process: bool = True, post_process: bool = True,
                 num_layers: Optional[int] = None, layer_offset: int = 0, device=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor: Optional[torch.Tensor] = None
        n = config.num_layers if num_layers is None else num_layers
        self.language_model = LanguageModel(
            config, n, layer_offset, pre_process, post_process, tp_group, rng_tracker, device
        )
        self.tied_output = post_process and not config.untie_embeddings_and_output_weights
        if self.tied_output:
            self.output_projection = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, tp_group=tp_group, bias=False,
                gather_output=False, init_method=init_methods(config)[0],
                sequence_parallel=config.sequence_parallel, params_dtype=config.params_dtype,
                skip_weight_param_allocation=True, device=device,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            )
            if not pre_process:  # last stage of a pipeline keeps its own copy, kept in sync
                self.word_embeddings_for_head = VocabParallelEmbedding(
                    config.padded_vocab_size, config.hidden_size, tp_group=tp_group,
                    init_method=nn.init.zeros_, params_dtype=word_embedding_dtype(config),
                    device=device,
                    use_cpu_initialization=config.use_cpu_initialization, rng_tracker=rng_tracker,
                )
                self.word_embeddings_for_head.weight.shared = True
            self.output_weight_cast = CastTo()
        self.rotary_dim = None
        if config.use_rotary_position_embeddings:
            self.rotary_dim = rotary_dim(config.kv_channels, config.rotary_percent)
        self._rotary_cache = None

    def set_input_tensor(self, hidden_sbh: Optional[torch.Tensor]) -> None:
        """Activations received from the previous pipeline stage."""
        self.input_tensor = hidden_sbh

    def output_weight(self) -> torch.Tensor:
        if self.config.untie_embeddings_and_output_weights:
            return self.language_model.output_layer.weight
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def _rotary(self, seq_length: int, device) -> Optional[torch.Tensor]:
        if self.rotary_dim is None:
            return None
        cache = self._rotary_cache  # [2, s, 1, 1, rotated channels]: cos and sin
        if cache is None or cache.shape[1] < seq_length or cache.device != device:
            cache = rotary_table(max(seq_length, self.config.seq_length), self.rotary_dim,
                                 self.config.rotary_base, device)
            self._rotary_cache = cache
        return cache[:, :seq_length]

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        lm = self.language_model
        if self.pre_process:
            if position_ids is None and lm.embedding.position_embeddings is not None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            hidden_sbh = lm.embedding(input_ids, position_ids)
            seq_length = input_ids.shape[1]
        else:
            hidden_sbh = self.input_tensor
            seq_length = hidden_sbh.shape[0] * (self._tp_size() if self.config.sequence_parallel else 1)
        hidden_sbh = lm.encoder(hidden_sbh, self._rotary(seq_length, hidden_sbh.device),
                                attention_mask)
        if not self.post_process:
            return hidden_sbh
        return self._head(hidden_sbh, labels)

    def _tp_size(self) -> int:
        return 1 if self.tp_group is None else torch.distributed.get_world_size(self.tp_group)

    def _fused_head_weight(self, hidden_sbh: torch.Tensor):
        """(weight, fusion flag) for the fused output layer + cross entropy
        (`--cross-entropy-kernel`), or None when the separate layers must run."""
        cfg = self.config
        reason = use_fused(cfg.cross_entropy_kernel, hidden_sbh.device,
                           cfg.fp16_lm_cross_entropy, hidden_sbh.dtype)
        if reason is not None:
            if cfg.cross_entropy_kernel == "triton":
                raise ValueError(f"--cross-entropy-kernel triton cannot be used: {reason}; "
                                 "use --cross-entropy-kernel auto or torch")
            return None
        if cfg.untie_embeddings_and_output_weights:
            layer = self.language_model.output_layer
            return layer.weight, layer.gradient_accumulation_fusion
        weight = self.output_weight_cast(self.output_weight(), hidden_sbh.dtype)
        return weight, self.output_projection.gradient_accumulation_fusion

    def _head(self, hidden_sbh: torch.Tensor, labels: Optional[torch.Tensor]):
        fused = self._fused_head_weight(hidden_sbh) if labels is not None else None
        if fused is not None:
            loss_sb = linear_cross_entropy(hidden_sbh, fused[0], labels.transpose(0, 1), fused[1],
                                           self.config.sequence_parallel, self.tp_group)
            return loss_sb.transpose(0, 1).contiguous()
        if self.config.untie_embeddings_and_output_weights:
            logits_sbv, _ = self.language_model.output_layer(hidden_sbh)
        else:
            # An fp32 word-embedding table (--embedding-weights-in-fp32) is cast to the
            # compute dtype; its grad flows back through the cast in fp32.
            weight = self.output_weight_cast(self.output_weight(), hidden_sbh.dtype)
            logits_sbv, _ = self.output_projection(hidden_sbh, weight=weight)
        if labels is None:
            return logits_sbv.transpose(0, 1).contiguous()
        labels_sb = labels.transpose(0, 1)
        if self.config.fp16_lm_cross_entropy:
            loss_sb = half_precision_cross_entropy(logits_sbv, labels_sb, self.tp_group)
        elif self.config.compile_layers and self._tp_size() == 1:
            loss_sb = compiled_cross_entropy()(logits_sbv, labels_sb)
        else:
            loss_sb = vocab_parallel_cross_entropy(logits_sbv.float(), labels_sb, self.tp_group)
        return loss_sb.transpose(0, 1).contiguous()
