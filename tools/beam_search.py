"""Beam search over one prompt, as Megatron-LM 23.05's text generation server runs it
(the request's `beam_width`, `stop_token`, `length_penalty`).

B = beam_width rows ("beams") all start as the prompt, each with a running score: the sum
of the log-probabilities of its generated tokens (log-softmax of the plain logits over the
tokenizer's vocabulary: no temperature, top-k or top-p). Each step:

1. every candidate (beam, token) scores beam score + log p(token | beam); at the first
   step only beam 0's candidates count (the beams are still the same sequence);
2. the best 2B candidates are walked in descending score (ties: the lower beam, then the
   lower token id, first). A candidate whose token is `stop_token` finishes a hypothesis
   -- only when it ranks among the first B of the 2B, else it is skipped -- made of its
   beam's generated tokens WITHOUT the stop token, scored
   sum of log-probabilities / length ** length_penalty, where length counts the generated
   tokens with the stop token's position. Any other candidate becomes a beam of the next
   step, until B are collected (at most B of the 2B are stop tokens, one per beam, so
   there are always B);
3. the finished hypotheses keep the best B by that score (a full set takes only a
   strictly better one, dropping its worst); the search is done when it holds B and its
   worst score is >= the best candidate's score / (generated length) ** length_penalty.

After max_new_tokens (or the model's last position) without being done, every live beam
becomes a hypothesis too, scored with its generated length. The answer is the kept
hypotheses, best first: always B of them (the set is filled either way).

With the key/value cache the B rows are prefilled together (the prompt repeated, as
Megatron does) and each step feeds the B new tokens; the cache's rows are then reordered by
the beams chosen (`KVCache.reorder`, in place, so a static decoder's captured CUDA graph
keeps reading the same tensors). Without the cache every step recomputes all B sequences;
both give the same hypotheses (the logits agree up to float rounding). A static decoder
(--decode-cuda-graph) serves the beams as a batch of B rows: it captures a graph for B rows
the first time (and again when a request of another batch size came in between).

Under tensor parallelism every rank calls `beam_search` with the same arguments: the
logits are all-gathered over the vocabulary (the same tensor on every rank) and everything
after them is deterministic (a stable sort, then host-side bookkeeping), so every rank
keeps the same beams and reorders its own shard of the cache alike. Under pipeline
parallelism (megatron/core/models/gpt/pipeline_decode.py) the last stage's logits reach
every rank, so every stage keeps the same beams and reorders its own layers' cache alike.
"""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/beam_search.py is a library module (beam search of the text "
                     "generation server); run python tools/run_text_generation_server.py --help "
                     "and send a request with beam_width")

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron.core.models.gpt.kv_cache import KVCache, check_incremental, gather_vocab
from megatron.core.models.gpt.static_decode import StaticDecoder
from tools.generate import _batch_step_logits
from tools.sampling_rules import forbid_after

Hypothesis = Tuple[List[int], float]  # (generated ids without the stop token, score)


class Hypotheses:
    """The finished hypotheses of a beam search: the best `width` by
    sum_logprobs / length ** length_penalty."""

    def __init__(self, width: int, length_penalty: float) -> None:
        self.width, self.length_penalty = width, length_penalty
        self.kept: List[Tuple[float, List[int]]] = []  # (score, ids), in order of arrival

    def score(self, sum_logprobs: float, length: int) -> float:
        return sum_logprobs / length ** self.length_penalty

    def add(self, ids: List[int], sum_logprobs: float, length: int) -> None:
        """Keep `ids` if the set is not full or it beats the worst kept (which then goes:
        of equal worst ones, the first kept)."""
        score = self.score(sum_logprobs, length)
        if len(self.kept) >= self.width and score <= min(s for s, _ in self.kept):
            return
        self.kept.append((score, ids))
        if len(self.kept) > self.width:
            worst = min(range(len(self.kept)), key=lambda i: (self.kept[i][0], i))
            del self.kept[worst]

    def done(self, best_sum_logprobs: float, length: int) -> bool:
        """Whether no live beam can enter the set any more: it is full and its worst
        score is >= the best candidate's at the current generated `length`."""
        return len(self.kept) == self.width and \
            min(s for s, _ in self.kept) >= self.score(best_sum_logprobs, length)

    def best_first(self) -> List[Hypothesis]:
        """(ids, score) of the kept hypotheses, best first (equal scores: first kept)."""
        ranked = sorted(self.kept, key=lambda kept: kept[0], reverse=True)
        return [(ids, score) for score, ids in ranked]


class BeamLogits:
    """Logits [B, V] (fp32, the first `vocab_limit`) of the token after each beam, and
    the reordering of the beams' rows: through a key/value cache (a `decoder`'s when
    given) that the first call prefills and later calls extend by one token, or
    recomputing every sequence in full (`use_cache` False)."""

    def __init__(self, model, width: int, capacity: int, use_cache: bool = True,
                 decoder: Optional[StaticDecoder] = None,
                 vocab_limit: Optional[int] = None) -> None:
        self.model, self.vocab_limit = model, vocab_limit
        self.device = next(model.parameters()).device
        self.cache: Optional[KVCache] = None
        self.decoder = decoder if use_cache else None
        if use_cache:
            check_incremental(model)
            self.cache = (decoder.new_cache(width, capacity) if decoder is not None else
                          KVCache(len(model.language_model.encoder.layers), capacity))

    def __call__(self, beams: List[List[int]]) -> torch.Tensor:
        if self.cache is None:
            tokens = torch.tensor(beams, dtype=torch.long, device=self.device)
            logits = gather_vocab(self.model, self.model(tokens))
            return logits[:, -1, :self.vocab_limit].float()
        new = [beam[self.cache.length:] for beam in beams]
        tokens = torch.tensor(new, dtype=torch.long, device=self.device)
        return _batch_step_logits(self.model, self.cache, tokens, self.vocab_limit,
                                  self.decoder)

    def reorder(self, rows: List[int]) -> None:
        """Row i now continues the old row rows[i]."""
        if self.cache is not None:
            self.cache.reorder(torch.tensor(rows, dtype=torch.long, device=self.device))


def _ranked(logp_bv: torch.Tensor, scores_b: Optional[torch.Tensor],
            count: int) -> List[Tuple[float, int, int]]:
    """The best `count` candidates (score, beam, token), best first; with `scores_b`
    None (the first step) those of beam 0 alone."""
    vocab = logp_bv.shape[1]
    total = logp_bv[:1] if scores_b is None else logp_bv + scores_b[:, None]
    values, order = torch.sort(total.reshape(-1), descending=True, stable=True)
    values, order = values[:count].tolist(), order[:count].tolist()
    return [(value, index // vocab, index % vocab) for value, index in zip(values, order)]


def _walk(ranked: List[Tuple[float, int, int]], beams: List[List[int]], prompt_len: int,
          hyps: Hypotheses, stop_token: int, length: int) -> List[Tuple[float, int, int]]:
    """The next beams (score, beam, token) from the ranked candidates; the stop-token
    candidates among the first `hyps.width` are added to `hyps` (the beam's generated
    tokens, `length` counting the stop token's position)."""
    width, chosen = hyps.width, []
    for rank, (score, beam, token) in enumerate(ranked):
        if token == stop_token:
            if rank < width:
                hyps.add(beams[beam][prompt_len:], score, length)
        else:
            chosen.append((score, beam, token))
        if len(chosen) == width:
            break
    return chosen


def run_beams(next_logits: Callable[[List[List[int]]], torch.Tensor],
              reorder: Callable[[List[int]], None], prompt_ids: Sequence[int], width: int,
              max_new_tokens: int, *, stop_token: int, length_penalty: float = 1.0,
              forbid: Optional[Tuple[int, int]] = None) -> List[Hypothesis]:
    """The beam search of the module docstring over `next_logits(beams)` -> logits
    [width, V] of the token after each beam; `reorder(rows)` is told which old beam each
    new one continues. Returns (generated ids, score) of each hypothesis, best first."""
    prompt = list(prompt_ids)
    beams = [list(prompt) for _ in range(width)]
    scores_b: Optional[torch.Tensor] = None
    hyps = Hypotheses(width, length_penalty)
    for generated in range(max_new_tokens):
        logits = forbid_after(next_logits(beams), [b[-1] for b in beams], forbid)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ranked = _ranked(logp, scores_b, 2 * width)
        chosen = _walk(ranked, beams, len(prompt), hyps, stop_token, generated + 1)
        if hyps.done(ranked[0][0], generated + 1):
            return hyps.best_first()
        beams = [beams[beam] + [token] for _, beam, token in chosen]
        scores_b = logp.new_tensor([score for score, _, _ in chosen])
        reorder([beam for _, beam, _ in chosen])
    for beam, score in zip(beams, scores_b.tolist()):
        hyps.add(beam[len(prompt):], score, max_new_tokens)
    return hyps.best_first()


@torch.no_grad()
def beam_search(model, prompt_ids: Sequence[int], width: int, max_new_tokens: int, *,
                stop_token: int, length_penalty: float = 1.0,
                vocab_limit: Optional[int] = None, use_cache: bool = True,
                decoder: Optional[StaticDecoder] = None,
                forbid: Optional[Tuple[int, int]] = None) -> List[Hypothesis]:
    """(generated ids, score) of the `width` hypotheses of a beam search after
    `prompt_ids`, best first (see the module docstring). At most up to the model's last
    position (max_new_tokens is cut to --max-position-embeddings - len(prompt_ids), as
    Megatron does). `vocab_limit`: only the first logits (the tokenizer's vocabulary) are
    candidates; `forbid` = (a, b): token b never follows token a
    (prevent_newline_after_colon). The model is as for tools/generate.py `generate`: one
    process, or every rank of a tensor x pipeline layout with the same arguments.
    ValueError for an empty prompt, no room for a new token, width < 1 or a vocabulary
    of fewer than 2 * width tokens."""
    max_len = model.config.max_position_embeddings
    vocab = vocab_limit or model.config.padded_vocab_size
    if width < 1 or vocab < 2 * width:
        raise ValueError(f"beam search with width {width} needs width >= 1 and at least "
                         f"2 x width candidate tokens (the vocabulary has {vocab})")
    if not prompt_ids or max_new_tokens < 1 or len(prompt_ids) >= max_len:
        raise ValueError(f"beam search needs a prompt (got {len(prompt_ids)} tokens) that "
                         f"leaves room in the model's {max_len} positions, and "
                         f"max_new_tokens >= 1 (got {max_new_tokens})")
    max_new_tokens = min(max_new_tokens, max_len - len(prompt_ids))
    steps = BeamLogits(model, width, len(prompt_ids) + max_new_tokens - 1, use_cache,
                       decoder, vocab_limit)
    return run_beams(steps, steps.reorder, prompt_ids, width, max_new_tokens,
                     stop_token=stop_token, length_penalty=length_penalty, forbid=forbid)


__all__ = ["BeamLogits", "Hypotheses", "beam_search", "run_beams"]
