"""Megatron-LM 23.05's tensor_parallel names kept for ported code: the seven region
functions, `broadcast_data`, `split_tensor_into_1d_equal_chunks` / `gather_split_1d_tensor`.

On 4 gloo ranks (tensor-parallel 2 x data-parallel 2, as ported code calls them after
`initialize_model_parallel(2)`) each result and input grad is checked against the same
thing worked out on the full tensor in this process.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel import data as tp_data
from megatron.core.tensor_parallel import mappings, utils
from tests.dist_utils import run_distributed

TP = 2
X = torch.arange(4 * 2 * 6, dtype=torch.float32).reshape(4, 2, 6)  # [s, b, h]
W = torch.linspace(-1.0, 1.0, 4 * 2 * 6).reshape(4, 2, 6)  # upstream grad, full shape


def _chunk(t, dim, r):
    return t.chunk(TP, dim=dim)[r]


def _run(fn, x, grad_out):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def _regions(r):
    """(name, fn, input, upstream grad) as each tp rank r calls them."""
    s = r + 1.0  # a rank-dependent factor: sums over the group are visible
    return [
        ("copy", mappings.copy_to_tensor_model_parallel_region, X, W * s),
        ("reduce", mappings.reduce_from_tensor_model_parallel_region, X * s, W),
        ("scatter_tp", mappings.scatter_to_tensor_model_parallel_region, X, _chunk(W, -1, r) * s),
        ("gather_tp", mappings.gather_from_tensor_model_parallel_region, _chunk(X, -1, r), W),
        ("scatter_sp", mappings.scatter_to_sequence_parallel_region, X, _chunk(W, 0, r) * s),
        ("gather_sp", mappings.gather_from_sequence_parallel_region, _chunk(X, 0, r), W * s),
        ("gather_sp_nogrdsum", lambda t: mappings.gather_from_sequence_parallel_region(t, False),
         _chunk(X, 0, r), W * s),
        ("reduce_scatter_sp", mappings.reduce_scatter_to_sequence_parallel_region, X * s,
         _chunk(W, 0, r)),
    ]


def _broadcasts(rank):
    src = rank % TP == 0
    batch = {"text": torch.arange(10).reshape(2, 5) + 100 * rank, "lens": torch.tensor([rank, 7])}
    good = tp.broadcast_data(["text", "lens"], batch if src else None, torch.int64)
    try:
        bad = {"text": torch.zeros(3, dtype=torch.int32)}
        tp.broadcast_data(["text"], bad if src else None, torch.int64)
        refused = None
    except ValueError as e:
        refused = str(e)
    return good, refused


def _worker(rank, world_size):
    ps.initialize_model_parallel(TP)
    r = ps.get_tensor_model_parallel_rank()
    out = {"tp_rank": r, "regions": {n: _run(f, x, g) for n, f, x, g in _regions(r)}}
    out["broadcast"] = _broadcasts(rank)
    flat = torch.arange(12.0).reshape(3, 4)
    part = tp.split_tensor_into_1d_equal_chunks(flat)
    out["split"] = (part, tp.split_tensor_into_1d_equal_chunks(flat, new_buffer=True),
                    tp.gather_split_1d_tensor(part))
    dist.barrier()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4)


def _expected(name, r):
    total = 1.0 + 2.0  # sum of the factors r + 1 over the tp group
    s = r + 1.0
    return {  # (forward output, input grad)
        "copy": (X, W * total),
        "reduce": (X * total, W),
        "scatter_tp": (_chunk(X, -1, r), torch.cat([_chunk(W, -1, q) * (q + 1) for q in range(TP)], -1)),
        "gather_tp": (X, _chunk(W, -1, r)),
        "scatter_sp": (_chunk(X, 0, r), torch.cat([_chunk(W, 0, q) * (q + 1) for q in range(TP)], 0)),
        "gather_sp": (X, _chunk(W * total, 0, r)),
        "gather_sp_nogrdsum": (X, _chunk(W * s, 0, r)),
        "reduce_scatter_sp": (_chunk(X * total, 0, r), W),
    }[name]


@pytest.mark.parametrize("name", [n for n, *_ in _regions(0)])
def test_region_functions_match_the_single_process_math(results, name):
    for res in results:
        r = res["tp_rank"]
        y, grad = res["regions"][name]
        want_y, want_grad = _expected(name, r)
        torch.testing.assert_close(y, want_y, msg=f"{name} forward, tp rank {r}")
        torch.testing.assert_close(grad, want_grad, msg=f"{name} backward, tp rank {r}")


def test_broadcast_data_gives_every_tp_rank_the_source_batch(results):
    for rank, res in enumerate(results):
        good, refused = res["broadcast"]
        src = rank - rank % TP
        assert torch.equal(good["text"], torch.arange(10).reshape(2, 5) + 100 * src)
        assert torch.equal(good["lens"], torch.tensor([src, 7]))
        # a wrong dtype on the source fails on every rank of the group (no one waits)
        assert refused is not None and "'text'" in refused and "torch.int64" in refused, refused
        if rank == src:
            assert "has dtype torch.int32" in refused


def test_split_and_gather_1d(results):
    flat = torch.arange(12.0)
    for res in results:
        r = res["tp_rank"]
        part, copy, gathered = res["split"]
        assert torch.equal(part, flat[6 * r:6 * r + 6]) and torch.equal(copy, part)
        assert torch.equal(gathered, flat)


# ------------------------------------------------------------------ one process
@pytest.fixture
def one_process():
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_one_process_regions_are_identity(one_process):
    for name, fn, *_ in _regions(0):
        y, grad = _run(fn, X, W)
        torch.testing.assert_close(y, X, msg=name)
        torch.testing.assert_close(grad, W, msg=name)


def test_one_process_broadcast_and_split(one_process):
    batch = {"text": torch.arange(6).reshape(2, 3)}
    assert torch.equal(tp.broadcast_data(["text"], batch, torch.int64)["text"], batch["text"])
    with pytest.raises(ValueError, match=r"data\['text'\] has dtype torch.int64, expected "
                                         r"torch.float32"):
        tp.broadcast_data(["text"], batch, torch.float32)
    with pytest.raises(ValueError, match="key 'labels' is not in the data"):
        tp.broadcast_data(["labels"], batch, torch.int64)
    t = torch.arange(5.0)
    assert torch.equal(tp.split_tensor_into_1d_equal_chunks(t), t)
    assert torch.equal(tp.gather_split_1d_tensor(t), t)
    assert tp_data.MAX_DATA_DIM >= 5  # Megatron's limit (fewer than 5 dims) still fits


def test_one_process_broadcast_moves_the_batch_to_the_groups_device(one_process, monkeypatch):
    """Megatron's broadcast_data returns the batch on the GPU at tensor-parallel size 1 too
    (a get_batch that feeds the model its result); here the device of the group's backend,
    stood for by the meta device."""
    monkeypatch.setattr(tp_data.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tp_data, "_device", lambda group: torch.device("meta"))
    out = tp.broadcast_data(["text"], {"text": torch.arange(6).reshape(2, 3)}, torch.int64)
    assert out["text"].device.type == "meta" and out["text"].shape == (2, 3)


def test_uneven_1d_split_names_the_sizes(monkeypatch):
    monkeypatch.setattr(utils, "group_size", lambda group: 2)
    monkeypatch.setattr(ps, "_STATE", ps.ParallelState.build(1))
    with pytest.raises(ValueError, match=r"7 elements \(shape \(7,\)\) do not split into 2"):
        tp.split_tensor_into_1d_equal_chunks(torch.arange(7.0))


def test_names_need_initialize_model_parallel():
    ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        tp.copy_to_tensor_model_parallel_region(X)
