"""Megatron-LM 23.05's embedding-group accessors, the split-rank and stage setters and the
global memory buffer, for ported code (megatron.core.parallel_state).

Megatron's semantics: the embedding group is the first and last stage of each pipeline
group (the rank alone when pp is 1), the position-embedding group the first stage only;
`is_rank_in_embedding_group()` without `ignore_virtual` also asks that the first stage runs
its first virtual chunk and the last stage its last one. The 4-process worker runs the
tied-embedding gradient all-reduce the way Megatron's training loop writes it.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.dist_utils import run_distributed

_LAYOUTS = [(1, 2), (2, 2), (1, 4), (4, 1)]  # (tp, pp) on 4 ranks


def _tied_grad_all_reduce(rank):
    """Megatron-LM 23.05's _allreduce_embedding_grads, ported unchanged."""
    grad = torch.full((3,), float(rank + 1))
    if (ps.is_rank_in_embedding_group(ignore_virtual=True)
            and ps.get_pipeline_model_parallel_world_size() > 1):
        dist.all_reduce(grad, group=ps.get_embedding_group())
    return grad


def _layout_values(rank):
    out = {"in_emb": ps.is_rank_in_embedding_group(),
           "in_pos": ps.is_rank_in_position_embedding_group(),
           "grad": _tied_grad_all_reduce(rank)}
    try:
        out["emb"] = dist.get_process_group_ranks(ps.get_embedding_group())
    except RuntimeError as e:
        out["emb"] = str(e)
    try:
        out["pos"] = dist.get_process_group_ranks(ps.get_position_embedding_group())
    except RuntimeError as e:
        out["pos"] = str(e)
    return out


def _virtual_membership():
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 4, 2)
    rows = []
    for chunk in (0, 1):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        rows.append((ps.is_rank_in_embedding_group(),
                     ps.is_rank_in_embedding_group(ignore_virtual=True)))
    return rows


def _worker(rank, world_size):
    out = {}
    for tp, pp in _LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp)
        out[(tp, pp)] = _layout_values(rank)
    out["virtual"] = _virtual_membership()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4)


def test_tied_embedding_grads_sum_over_first_and_last_stage(results):
    expected = {  # rank r holds r + 1; first + last stage of each pipeline group summed
        (1, 2): [4, 6, 4, 6], (2, 2): [4, 6, 4, 6], (1, 4): [5, 2, 3, 5], (4, 1): [1, 2, 3, 4]}
    for layout, column in expected.items():
        got = [res[layout]["grad"] for res in results]
        for rank, (g, want) in enumerate(zip(got, column)):
            assert torch.equal(g, torch.full((3,), float(want))), (layout, rank)


def test_embedding_group_members(results):
    expected_emb = {(1, 2): [[0, 2], [1, 3], [0, 2], [1, 3]],
                    (2, 2): [[0, 2], [1, 3], [0, 2], [1, 3]],
                    (1, 4): [[0, 3], None, None, [0, 3]],
                    (4, 1): [[0], [1], [2], [3]]}
    for layout, column in expected_emb.items():
        for rank, want in enumerate(column):
            v = results[rank][layout]
            assert v["in_emb"] == (want is not None), (layout, rank)
            if want is None:  # a middle stage: an error naming the check, not the world
                assert "is_rank_in_embedding_group()" in v["emb"], v["emb"]
                assert v["emb"].startswith(f"rank {rank} is not in the embedding group (of "
                                           "its pipeline group [0, 1, 2, 3] only ranks [0, 3]")
            else:
                assert v["emb"] == want, (layout, rank)


def test_position_embedding_group_is_the_first_stage(results):
    for layout in _LAYOUTS:
        tp, pp = layout
        for rank, res in enumerate(results):
            v = res[layout]
            first = rank < 4 // pp
            assert v["in_pos"] == first, (layout, rank)
            if first:
                assert v["pos"] == [rank]
            else:
                assert "is_rank_in_position_embedding_group()" in v["pos"]


def test_embedding_membership_follows_the_virtual_chunk(results):
    # rows: chunk 0, chunk 1 of 2; each (is_rank_in_embedding_group(), ignore_virtual=True)
    assert results[0]["virtual"] == [(True, True), (False, True)]
    assert results[3]["virtual"] == [(False, True), (True, True)]
    assert results[1]["virtual"] == results[2]["virtual"] == [(False, False)] * 2


# ------------------------------------------------------------------ one process
@pytest.fixture
def fresh_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_single_process_embedding_groups(fresh_state):
    ps.initialize_model_parallel()
    assert ps.is_rank_in_embedding_group() and ps.is_rank_in_position_embedding_group()
    assert ps.get_embedding_group() is None and ps.get_position_embedding_group() is None


def test_setters_describe_a_rank_without_initialisation(fresh_state):
    # Megatron's checkpoint tools build one rank's model this way, with no process groups.
    ps.set_tensor_model_parallel_world_size(2)
    ps.set_tensor_model_parallel_rank(1)
    ps.set_pipeline_model_parallel_world_size(4)
    ps.set_pipeline_model_parallel_rank(3)
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank()) == (2, 1, 4, 3)
    assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    ps.set_pipeline_model_parallel_rank(0)
    assert ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    ps.initialize_model_parallel()  # the values set win over the state, as in Megatron
    assert ps.get_tensor_model_parallel_world_size() == 2
    ps.set_tensor_model_parallel_world_size(None)
    assert ps.get_tensor_model_parallel_world_size() == 1
    ps.destroy_model_parallel()  # forgets them
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_pipeline_model_parallel_rank()


@pytest.mark.parametrize("setter, value", [
    (ps.set_tensor_model_parallel_world_size, 0), (ps.set_pipeline_model_parallel_rank, -1),
    (ps.set_tensor_model_parallel_rank, "1"), (ps.set_pipeline_model_parallel_world_size, 2.0),
])
def test_setters_refuse_bad_values(fresh_state, setter, value):
    with pytest.raises(ValueError, match=rf"{setter.__name__}\({value!r}\): expected an int"):
        setter(value)


def test_split_rank(fresh_state):
    assert ps.get_pipeline_model_parallel_split_rank() is None
    ps.set_pipeline_model_parallel_split_rank(None)
    with pytest.raises(ValueError, match="pipeline_model_parallel_split_rank=1 splits"):
        ps.set_pipeline_model_parallel_split_rank(1)
    assert ps.is_pipeline_stage_before_split() and ps.is_pipeline_stage_after_split(0)
    assert ps.is_pipeline_stage_at_split()


def test_global_memory_buffer(fresh_state):
    assert ps.is_unitialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_global_memory_buffer()
    ps.initialize_model_parallel()
    assert not ps.is_unitialized()
    buf = ps.get_global_memory_buffer()
    assert buf is ps.get_global_memory_buffer()
    a = buf.get_tensor((4, 3), torch.float32, "mpu")
    assert a.shape == (4, 3) and a.dtype == torch.float32 and not a.requires_grad
    b = buf.get_tensor([2, 5], torch.float32, "mpu")  # smaller: the same memory
    assert b.shape == (2, 5) and b.data_ptr() == a.data_ptr()
    assert buf.get_tensor((4, 3), torch.float16, "mpu").data_ptr() != a.data_ptr()
    assert buf.get_tensor((4, 3), torch.float32, "other").data_ptr() != a.data_ptr()
    assert buf.get_tensor((5, 5), torch.float32, "mpu").numel() == 25  # grows
    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    assert ps.get_global_memory_buffer() is not buf
