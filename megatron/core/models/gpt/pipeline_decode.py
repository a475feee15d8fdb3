"""Decoding with a GPT split over pipeline stages: one rank's stage, called as the model.

Shape legend: b = batch, s = new tokens of a call, h = hidden, V = padded vocabulary
(V/tp on each tensor-parallel rank).

`PipelineGPT(stage, ps)` wraps this rank's `GPTModel` stage (built as training builds it:
stages.py; one chunk, no virtual stages) so that the decoding code written for a whole
model runs unchanged on every rank of the pipeline, all ranks calling it with the same
tokens in lockstep:

    model(input_ids_bs)                       logits [b, s, V/tp], the full forward
    forward_incremental(model, ids, cache)    kv_cache.py: logits [b, s, V], cached

A call passes the tokens through the stages in order. The first stage embeds them
(`kv_cache.embed_step`), each stage runs its own layers (`layers_step`; its key/value
cache holds those layers only: `KVCache(len(model.language_model.encoder.layers))` counts
this stage's), sends its hidden states [s, b, h] to the next stage (a blocking send/recv
pair between the neighbours' global ranks) and the last stage applies the final norm and
output layer (`head_step`). The last stage's vocabulary-parallel logits are then
broadcast over the pipeline group (each tensor-parallel rank of the last stage to the
ranks of its own pipeline, which hold the same vocabulary slice), so every rank returns
the same logits as the last stage; `gather_vocab` then all-gathers them over the
tensor-parallel group as at pp = 1. Every rank thus holds the same full-vocabulary
logits, and the sampling code draws the same token on every rank from the same
per-prompt generator, as under tensor parallelism: no token, stop flag or score needs a
broadcast of its own, and beam search reorders every stage's cache with the same rows.

The transfers carry the activation dtype (fp32 with --fp32-residual-connection, else the
params dtype): the receiver knows every shape from the tokens, so nothing else is
exchanged. The static CUDA-graph step (static_decode.py) is not used: each step here
crosses the stages (`static_decode.graph_reason` names the reason).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.core.parallel_state import ParallelState

from .kv_cache import (
    KVCache,
    advance,
    check_room,
    embed_step,
    gather_vocab,
    head_step,
    layers_step,
)


class PipelineGPT(nn.Module):
    """This rank's pipeline stage of a GPT, seen as the whole model by the decoding code
    (module docstring). Every rank of the pipeline (and of each stage's tensor-parallel
    group) must make the same calls with the same tokens. Collectives per call: one
    send/recv of [s, b, h] between each pair of neighbouring stages, one broadcast of
    [b, s, V/tp] from the last stage over the pipeline group (and the all-gather over the
    tensor-parallel group of `gather_vocab`). No gradients (eval only)."""

    def __init__(self, stage: nn.Module, ps: ParallelState) -> None:
        super().__init__()
        if ps.pp_size > 1 and (stage.pre_process != ps.is_first_stage or
                               stage.post_process != ps.is_last_stage):
            raise ValueError(f"pipeline rank {ps.pp_rank} of {ps.pp_size} needs a stage "
                             "with the embedding exactly on the first stage and the output "
                             "layer exactly on the last (one chunk, no standalone "
                             "embedding stage)")
        self.stage = stage
        self.config = stage.config
        self.tp_group = stage.tp_group
        self.pre_process = self.post_process = True  # the pipeline as a whole
        self.pp_ranks = ps.ranks("pp")
        self.pp_group = ps.pp_group
        self.pp_size, self.pp_rank = ps.pp_size, ps.pp_rank

    @property
    def language_model(self):
        """This stage's LanguageModel (its layers: what a key/value cache is sized by)."""
        return self.stage.language_model

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def _tp_size(self) -> int:
        return self.stage._tp_size()

    def _act_dtype(self) -> torch.dtype:
        return torch.float32 if self.config.fp32_residual_connection else self.config.params_dtype

    def _device(self) -> torch.device:
        return next(self.stage.parameters()).device

    def _recv(self, b: int, s: int) -> torch.Tensor:
        """Hidden states [s, b, h] from the previous stage."""
        buf = torch.empty(s, b, self.config.hidden_size, dtype=self._act_dtype(),
                          device=self._device())
        dist.recv(buf, src=self.pp_ranks[self.pp_rank - 1])
        return buf

    def _send(self, hidden_sbh: torch.Tensor) -> None:
        dist.send(hidden_sbh.to(self._act_dtype()).contiguous(),
                  dst=self.pp_ranks[self.pp_rank + 1])

    def _from_last_stage(self, logits_bsv: Optional[torch.Tensor],
                         shape: Tuple[int, int]) -> torch.Tensor:
        """The last stage's vocabulary-parallel logits [b, s, V/tp] on every stage."""
        vocab = self.config.padded_vocab_size // self._tp_size()
        if self.pp_size == 1:  # one stage: nothing to pass
            return logits_bsv
        if self.is_last:
            buf = logits_bsv.to(self._act_dtype()).contiguous()
        else:
            buf = torch.empty(*shape, vocab, dtype=self._act_dtype(), device=self._device())
        dist.broadcast(buf, src=self.pp_ranks[-1], group=self.pp_group)
        return buf

    def _pass_on(self, hidden_sbh: torch.Tensor, logits) -> Optional[torch.Tensor]:
        """The last stage's logits (`logits(hidden)`); other stages send `hidden_sbh` on."""
        if self.is_last:
            return logits(hidden_sbh)
        self._send(hidden_sbh)
        return None

    @torch.no_grad()
    def forward(self, input_ids_bs: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, V/tp] of the full forward (causal, positions from 0), as a whole
        GPTModel returns them, on every rank."""
        b, s = input_ids_bs.shape
        if self.is_first:
            hidden_sbh = self.stage(input_ids_bs)
        else:
            self.stage.set_input_tensor(self._recv(b, s))
            hidden_sbh = self.stage(None)
            self.stage.set_input_tensor(None)
        return self._from_last_stage(self._pass_on(hidden_sbh, lambda x: x), (b, s))

    @torch.no_grad()
    def forward_incremental(self, input_ids_bs: torch.Tensor, cache: KVCache,
                            last_only: bool = False) -> torch.Tensor:
        """kv_cache.forward_incremental through the stages: logits [b, s, V] ([b, 1, V]
        with `last_only`) on every rank; `cache` holds this stage's layers."""
        b, s = input_ids_bs.shape
        start, end = check_room(self, cache, s)
        if self.is_first:
            hidden_sbh = embed_step(self.stage, input_ids_bs, start)
        else:
            hidden_sbh = self._recv(b, s)
        hidden_sbh = layers_step(self.stage, hidden_sbh, cache)
        advance(cache, end)
        logits = self._pass_on(hidden_sbh, lambda x: head_step(self.stage, x, last_only))
        return gather_vocab(self, self._from_last_stage(logits, (b, 1 if last_only else s)))


__all__ = ["PipelineGPT"]
