"""get_ltor_masks_and_position_ids (megatron/core/datasets/utils.py) vs Megatron's loop
implementation: attention and loss masks, position ids, awkward document boundaries, one
[b, 1, s, s] allocation."""
from __future__ import annotations

import pytest
import torch

from megatron.core.datasets.utils import get_ltor_masks_and_position_ids


def ref_masks(data, eod, reset_pos, reset_att, eod_mask):
    """Megatron's loop implementation."""
    b, s = data.shape
    att = torch.tril(torch.ones((b if reset_att else 1, s, s))).view(-1, 1, s, s)
    loss = torch.ones(data.shape)
    if eod_mask:
        loss[data == eod] = 0.0
    pos = torch.arange(s).unsqueeze(0).expand_as(data).clone()
    for i in range(b):
        eods = pos[i, data[i] == eod].clone()
        prev = 0
        for j in eods.tolist():
            if reset_att:
                att[i, 0, j + 1:, :j + 1] = 0
            if reset_pos:
                pos[i, j + 1:] -= j + 1 - prev
                prev = j + 1
    return att < 0.5, loss, pos


@pytest.mark.parametrize("flags", [(False, False, False), (True, False, True),
                                   (False, True, False), (True, True, True)])
def test_ltor_masks(flags):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 5, (3, 16), generator=g)
    data[1] = 7
    data[2, -1] = 0
    mask, loss, pos = get_ltor_masks_and_position_ids(data, 0, *flags)
    r_mask, r_loss, r_pos = ref_masks(data, 0, *flags)
    torch.testing.assert_close(loss, r_loss)
    assert torch.equal(pos, r_pos)
    if flags[1]:
        assert mask.dtype == torch.bool and torch.equal(mask, r_mask)
    else:
        assert mask is None


def _eod_layouts(s, eod):
    """[n, s] token rows with awkward document boundaries."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.full((s,), eod + 1)]  # one document spans the whole sample
    r = torch.full((s,), eod + 1)
    r[0] = r[-1] = eod  # EOD at the first and the last position
    rows.append(r)
    r = torch.full((s,), eod + 1)
    r[3:7] = eod  # several EODs in a row
    rows.append(r)
    rows.append(torch.full((s,), eod))  # all EODs
    for p in (0.02, 0.2, 0.6):  # random boundaries
        rows.append(torch.where(torch.rand(s, generator=g) < p, eod, eod + 1))
    return torch.stack(rows)


@pytest.mark.parametrize("band", [1 << 24, 37, 1])
def test_ltor_masks_boundaries_match_reference(monkeypatch, band):
    from megatron.core.datasets import utils
    monkeypatch.setattr(utils, "MASK_BAND_ELEMENTS", band)  # several bands, ragged last
    data = _eod_layouts(23, 5)
    for flags in [(True, True, True), (False, True, False), (True, False, True)]:
        mask, loss, pos = get_ltor_masks_and_position_ids(data, 5, *flags)
        r_mask, r_loss, r_pos = ref_masks(data, 5, *flags)
        assert torch.equal(loss, r_loss) and torch.equal(pos, r_pos)
        if flags[1]:
            assert mask.dtype == torch.bool and mask.shape == r_mask.shape
            assert torch.equal(mask, r_mask)
        for i in range(len(data)):  # one sample alone gets its own rows of the batch
            one = get_ltor_masks_and_position_ids(data[i:i + 1], 5, *flags)
            assert flags[1] is False or torch.equal(one[0][0], mask[i])


def test_ltor_mask_makes_one_s_by_s_allocation(monkeypatch):
    """Building the [b, 1, s, s] mask allocates it once, not ~4 s x s temporaries
    (4 GiB at seq 32768 in the loader-to-model path); the rest is one band of rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core.datasets import utils
    s, b = 512, 2
    monkeypatch.setattr(utils, "MASK_BAND_ELEMENTS", 16 * b * s)  # as at seq 16 Ki
    big = set()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= s * s:
                    big.add(t.untyped_storage().data_ptr())
            return out

    data = _eod_layouts(s, 5)[:b]
    with Count():
        mask, _, _ = get_ltor_masks_and_position_ids(data, 5, True, True, True)
    assert len(big) == 1 and mask.untyped_storage().data_ptr() in big
