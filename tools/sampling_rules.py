"""Two rules of Megatron-LM 23.05's text generation server that change what a token is
drawn from: top_p decay (`TopPSchedule`) and prevent_newline_after_colon (`forbid_after`).

Both are used by tools/generate.py (`generate`, `generate_batch`) and tools/beam_search.py;
the server (tools/text_generation_api.py) builds them from a request.
"""
from __future__ import annotations

# A library module, not a command: run as a script, it says which command to use.
if __name__ == "__main__":
    raise SystemExit("tools/sampling_rules.py is a library module (sampling rules of text "
                     "generation); run python tools/generate.py --help")

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

# the logit a forbidden token gets (Megatron's value): finite, so softmax and log_softmax
# stay finite and a beam that still takes the token has a (very bad) score, not NaN
BANNED_LOGIT = -1e10

# generate()'s top_p: a number, or a function of the position of the token drawn
TopP = Union[float, Callable[[int], float]]


class TopPSchedule:
    """top_p as a function of the position of the token drawn: Megatron-LM 23.05's
    top_p_decay / top_p_bound.

    Megatron decodes a batch position by position from its shortest prompt (position
    `start`) and, after each position, when top_p > 0 and top_p_decay > 0, sets
    top_p = top_p * top_p_decay and then, when top_p_bound > 0,
    top_p = max(top_p, top_p_bound). So the token at position p draws with top_p updated
    p - start times, in every row of the batch alike (a longer prompt's first new token
    has a top_p already decayed). The values are that recurrence in Python floats, not
    top_p * decay ** k, so they are Megatron's to the bit, down to 0.0 where it underflows
    (no top_p_bound): sample_next then keeps the most likely token alone (Megatron's
    `top_p > 0` test turns its filter off there instead)."""

    def __init__(self, top_p: float, decay: float, bound: float, start: int) -> None:
        self.decay, self.bound, self.start = decay, bound, start
        self.values: List[float] = [top_p]  # values[k]: after k updates

    def _next(self, top_p: float) -> float:
        if top_p > 0 and self.decay > 0:
            top_p = top_p * self.decay
            if self.bound > 0:
                top_p = max(top_p, self.bound)
        return top_p

    def __call__(self, position: int) -> float:
        step = max(0, position - self.start)
        while len(self.values) <= step:
            self.values.append(self._next(self.values[-1]))
        return self.values[step]


def top_p_at(top_p: TopP, position: int) -> float:
    """The top_p of the token drawn at `position` (a number is the same everywhere)."""
    return top_p(position) if callable(top_p) else top_p


def forbid_after(logits_bv: torch.Tensor, last_tokens: Sequence[int],
                 pair: Optional[Tuple[int, int]]) -> torch.Tensor:
    """`logits_bv` [b, V] with the logit of token pair[1] set to BANNED_LOGIT in every
    row whose last token (`last_tokens[row]`) is pair[0], so that pair[1] is never drawn
    right after pair[0] (prevent_newline_after_colon: pair = (':', '\\n')). A new tensor
    when a row changes, else `logits_bv` itself; `pair` None changes nothing."""
    if pair is None or not 0 <= pair[1] < logits_bv.shape[-1]:
        return logits_bv
    rows = [row for row, token in enumerate(last_tokens) if token == pair[0]]
    if not rows:
        return logits_bv
    logits_bv = logits_bv.clone()
    logits_bv[rows, pair[1]] = BANNED_LOGIT
    return logits_bv


__all__ = ["BANNED_LOGIT", "TopP", "TopPSchedule", "forbid_after", "top_p_at"]
