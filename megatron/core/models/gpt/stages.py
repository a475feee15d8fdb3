"""GPT split into pipeline stages: which layers each rank (and each virtual chunk) holds,
building those chunks, and keeping the tied word embedding equal on the first and last
stage.

Layer split (layers keep their global 1-based `layer_number`; checkpoint keys count from
0 inside each chunk, as Megatron's do):

    pp only               rank r holds layers [r * L, (r + 1) * L), L = num_layers / pp
    virtual stages (vpp)  chunk c of rank r is virtual stage s = c * pp + r and holds
                          layers [s * Lv, (s + 1) * Lv), Lv = num_layers / (pp * vpp)
    standalone embedding  rank 0 holds only the embedding; rank r >= 1 holds layers
                          [(r - 1) * L, r * L), L = num_layers / (pp - 1)

The embedding lives on the first virtual stage, the final norm, output layer and loss on
the last. With tied embeddings and pp > 1 the last stage keeps its own copy
(`word_embeddings_for_head`, marked `shared` so the grad norm counts it once): it is
broadcast from the first stage when built, and after every backward the two gradients are
summed over the embedding group (first and last stage of each pipeline), so both copies
take identical optimizer steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.config import ModelConfig
from megatron.core.distributed import allreduce_embedding_grads
from megatron.core.parallel_state import ParallelState

if TYPE_CHECKING:
    from .gpt_model import GPTModel


@dataclass(frozen=True)
class StageSpec:
    """What one model chunk of a rank holds."""

    chunk: int
    virtual_stage: int
    layer_offset: int  # global index of its first layer (0-based)
    num_layers: int
    pre_process: bool  # embedding
    post_process: bool  # final norm, output layer, loss


def stage_layout(num_layers: int, pp_size: int, pp_rank: int, vpp_size: Optional[int] = None,
                 standalone_embedding_stage: bool = False) -> List[StageSpec]:
    """The chunks of pipeline rank `pp_rank` (pure arithmetic, see module doc).

    Raises ValueError naming the sizes when the layers do not split evenly."""
    vpp = vpp_size or 1
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} outside pipeline of size {pp_size}")
    if standalone_embedding_stage:
        if vpp > 1 or pp_size < 2:
            raise ValueError("--standalone-embedding-stage needs --pipeline-model-parallel-size"
                             f" >= 2 and no virtual stages (got pp {pp_size}, vpp {vpp})")
        per = _split(num_layers, pp_size - 1, "pipeline-model-parallel size - 1")
        offset, count = (0, 0) if pp_rank == 0 else ((pp_rank - 1) * per, per)
        return [StageSpec(0, pp_rank, offset, count, pp_rank == 0, pp_rank == pp_size - 1)]
    per = _split(num_layers, pp_size * vpp, "pipeline-model-parallel size x virtual stages")
    last = pp_size * vpp - 1
    specs = []
    for c in range(vpp):
        s = c * pp_size + pp_rank
        specs.append(StageSpec(c, s, s * per, per, s == 0, s == last))
    return specs


def _split(num_layers: int, parts: int, what: str) -> int:
    if parts < 1 or num_layers % parts:
        raise ValueError(f"--num-layers {num_layers} is not divisible by the {what} ({parts}); "
                         "every stage needs the same number of layers")
    return num_layers // parts


def build_stage_models(config: ModelConfig, ps: ParallelState, rng_tracker=None, device=None,
                       vpp_size: Optional[int] = None,
                       standalone_embedding_stage: bool = False) -> List[GPTModel]:
    """This rank's GPT chunks, in virtual-stage order (one GPTModel each).

    No communication: call `sync_tied_embeddings` once all ranks have built theirs."""
    # imported here: the model (and the GPU kernels' triton it imports) is not needed by
    # `stage_layout`'s callers that build no model (--dry-run, the argument report)
    from .gpt_model import GPTModel

    specs = stage_layout(config.num_layers, ps.pp_size, ps.pp_rank, vpp_size,
                         standalone_embedding_stage)
    return [
        GPTModel(config, tp_group=ps.tp_group, rng_tracker=rng_tracker,
                 pre_process=s.pre_process, post_process=s.post_process,
                 num_layers=s.num_layers, layer_offset=s.layer_offset, device=device)
        for s in specs
    ]


def tied_embedding_weights(models: Sequence[torch.nn.Module], ps: ParallelState
                           ) -> List[torch.Tensor]:
    """The word-embedding weights this rank keeps equal with the other end of its
    pipeline: the input embedding on the first stage, the output copy on the last.
    Empty when pp == 1, with untied output weights, or on a middle stage."""
    models = [getattr(m, "module", m) for m in models]
    if ps.pp_size == 1 or models[0].config.untie_embeddings_and_output_weights:
        return []
    weights = []
    if ps.is_first_stage and models[0].pre_process:
        weights.append(models[0].language_model.embedding.word_embeddings.weight)
    if ps.is_last_stage and models[-1].post_process:
        weights.append(models[-1].word_embeddings_for_head.weight)
    return weights


@torch.no_grad()
def sync_tied_embeddings(models: Sequence[torch.nn.Module], ps: ParallelState) -> None:
    """Copy the first stage's word embedding into the last stage's output copy.

    Collective: one broadcast from the first stage over the embedding group; ranks
    outside the group (middle stages) do nothing."""
    weights = tied_embedding_weights(models, ps)
    if not weights or ps.embedding_group is None:
        return
    src = ps.ranks("pp")[0]
    for w in weights:
        dist.broadcast(w.data, src=src, group=ps.embedding_group)


def allreduce_tied_embedding_grads(models: Sequence[torch.nn.Module], ps: ParallelState) -> None:
    """Sum the word-embedding gradients of the first and last pipeline stage, so both
    copies see the gradient of the whole model. Call after the data-parallel reduction.

    Collective: one all-reduce SUM over the embedding group (first and last stage); a
    no-op for pp == 1, untied weights and middle stages."""
    weights = tied_embedding_weights(models, ps)
    if weights and ps.embedding_group is not None:
        allreduce_embedding_grads(weights, ps.embedding_group)
