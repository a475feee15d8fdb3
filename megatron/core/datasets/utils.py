"""Batch helpers for left-to-right language modelling."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


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
    position_ids = arange.unsqueeze(0).expand(b, s)
    # segment[t] = number of EODs strictly before t: tokens of one document share it.
    before = torch.zeros((b, s), dtype=torch.long, device=tokens.device)
    before[:, 1:] = torch.cumsum(is_eod[:, :-1].long(), dim=1)
    if reset_position_ids:
        # Start of t's document = 1 + index of the last EOD before t (0 when none).
        eod_pos = torch.where(is_eod, arange.unsqueeze(0), torch.full_like(tokens, -1))
        last_eod = torch.cummax(eod_pos, dim=1).values
        start = torch.zeros((b, s), dtype=torch.long, device=tokens.device)
        start[:, 1:] = last_eod[:, :-1] + 1
        position_ids = arange.unsqueeze(0) - start
    else:
        position_ids = position_ids.clone()
    attention_mask = None
    if reset_attention_mask:
        causal = torch.ones((s, s), dtype=torch.bool, device=tokens.device).tril()
        same_doc = before.unsqueeze(2) == before.unsqueeze(1)  # [b, s, s]
        attention_mask = ~(causal.unsqueeze(0) & same_doc).unsqueeze(1)
    return attention_mask, loss_mask, position_ids
