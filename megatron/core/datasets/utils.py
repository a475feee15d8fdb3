"""Batch helpers for left-to-right language modelling."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# Elements of one band of rows of the --reset-attention-mask mask written at a time.
MASK_BAND_ELEMENTS = 1 << 24


def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: int,
                                    reset_position_ids: bool, reset_attention_mask: bool,
                                    eod_mask_loss: bool
                                    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(attention_mask, loss_mask, position_ids) for `tokens` [b, s] (Megatron semantics).

    attention_mask: bool [b, 1, s, s], True = masked, given only with `reset_attention_mask`
        (then a token sees only earlier tokens of its own document: no attention across an
        EOD); None otherwise, meaning plain causal attention.
    loss_mask: float [b, s]; 0 on EOD tokens when `eod_mask_loss`, else all ones.
    position_ids: long [b, s]; with `reset_position_ids` positions restart at 0 after each
        EOD, else 0..s-1.
    """
    b, s = tokens.shape
    is_eod = tokens == eod_token
    loss_mask = torch.ones((b, s), dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    arange = torch.arange(s, device=tokens.device)
    # start[t]: index of the first token of t's document = 1 + the last EOD before t (0
    # when none); an EOD belongs to the document it ends.
    eod_pos = torch.where(is_eod, arange.unsqueeze(0), torch.full_like(tokens, -1))
    start = torch.zeros((b, s), dtype=torch.long, device=tokens.device)
    start[:, 1:] = torch.cummax(eod_pos, dim=1).values[:, :-1] + 1
    if reset_position_ids:
        position_ids = arange.unsqueeze(0) - start
    else:
        position_ids = arange.unsqueeze(0).expand(b, s).clone()
    attention_mask = None
    if reset_attention_mask:
        attention_mask = _document_causal_mask(start, arange)
    return attention_mask, loss_mask, position_ids


def _document_causal_mask(start: torch.Tensor, arange: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, s, s], True = masked: row i sees keys start[i]..i only.

    Written in place, a band of rows at a time: the mask is the only b x s x s
    allocation (the temporaries are one band, MASK_BAND_ELEMENTS), which at long sequences
    (1 GiB per sample at 32768) is what the loader-to-model path can afford."""
    b, s = start.shape
    mask = torch.empty((b, 1, s, s), dtype=torch.bool, device=start.device)
    rows = max(1, MASK_BAND_ELEMENTS // (b * s))
    for i0 in range(0, s, rows):
        i1 = min(s, i0 + rows)
        band = mask[:, 0, i0:i1]  # [b, rows, s]
        torch.lt(arange, start[:, i0:i1, None], out=band)  # keys before the document
        band.logical_or_(arange > arange[i0:i1, None])  # future keys
    return mask
