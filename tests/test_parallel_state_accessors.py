"""Megatron-LM 23.05's parallel_state accessors kept for ported code, and
tensor_parallel.model_parallel_cuda_manual_seed.

The 4-process tests read the members of the real process groups that
`initialize_model_parallel` built (torch.distributed.get_process_group_ranks) and check each
accessor against them: a source rank is the first member of the group, next/prev wrap
around the pipeline group. The hand-written tables pin the same numbers for one layout.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import random as tp_random
from tests.dist_utils import run_distributed

_LAYOUTS = [(2, 2), (1, 2), (1, 4)]  # (tp, pp) on 4 ranks: tp2 x pp2, dp2 x pp2, pp4
_SEED = 1234


def _accessor_values():
    return {
        "tp_src": ps.get_tensor_model_parallel_src_rank(),
        "dp_src": ps.get_data_parallel_src_rank(),
        "pp_first": ps.get_pipeline_model_parallel_first_rank(),
        "pp_last": ps.get_pipeline_model_parallel_last_rank(),
        "pp_next": ps.get_pipeline_model_parallel_next_rank(),
        "pp_prev": ps.get_pipeline_model_parallel_prev_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "tp_members": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "dp_members": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "pp_members": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "vpp": (ps.get_virtual_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_rank()),
    }


def _virtual_stages():
    """(vrank read back, first, first ignoring virtual, last, last ignoring virtual) for
    each virtual chunk of 2 on a pipeline of 4."""
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 4, 2)
    rows = [ps.get_virtual_pipeline_model_parallel_rank()]
    for chunk in (1, 0):
        ps.set_virtual_pipeline_model_parallel_rank(chunk)
        rows.append((
            ps.get_virtual_pipeline_model_parallel_rank(),
            ps.is_pipeline_first_stage(), ps.is_pipeline_first_stage(ignore_virtual=True),
            ps.is_pipeline_last_stage(), ps.is_pipeline_last_stage(ignore_virtual=True),
        ))
    return rows


def _seeded_draws():
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(2, 2)
    tp_random.set_rng_tracker(tp_random.RNGStatesTracker("cpu"))
    torch.manual_seed(1000 + dist.get_rank())  # differs per rank before the call
    tracker = tp_random.model_parallel_cuda_manual_seed(_SEED)
    default = torch.rand(8)
    with tracker.fork():
        forked = torch.rand(8)
    return {"default": default, "forked": forked, "after": torch.rand(8),
            "tp_rank": ps.get_tensor_model_parallel_rank()}


def _worker(rank, world_size):
    out = {}
    for tp, pp in _LAYOUTS:  # every rank initialises the layouts in the same order
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp)
        out[(tp, pp)] = _accessor_values()
    out["virtual"] = _virtual_stages()
    out["seed"] = _seeded_draws()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_accessors_match_the_groups_built(results, layout):
    for rank, res in enumerate(results):
        v = res[layout]
        tp_m, dp_m, pp_m = v["tp_members"], v["dp_members"], v["pp_members"]
        assert rank in tp_m and rank in dp_m and rank in pp_m
        assert v["tp_src"] == tp_m[0] == min(tp_m)
        assert v["tp_src"] == (rank // layout[0]) * layout[0]  # Megatron's own formula
        assert v["dp_src"] == dp_m[0] == min(dp_m)
        i = pp_m.index(rank)
        assert i == v["pp_rank"]
        assert (v["pp_first"], v["pp_last"]) == (pp_m[0], pp_m[-1])
        assert v["pp_next"] == pp_m[(i + 1) % len(pp_m)]
        assert v["pp_prev"] == pp_m[(i - 1) % len(pp_m)]
        assert v["vpp"] == (None, None)


def _column(results, layout, key):
    return [res[layout][key] for res in results]


def test_accessor_values_by_hand(results):
    expected = {
        (2, 2): {"tp_src": [0, 0, 2, 2], "dp_src": [0, 1, 2, 3], "pp_first": [0, 1, 0, 1],
                 "pp_last": [2, 3, 2, 3], "pp_next": [2, 3, 0, 1], "pp_prev": [2, 3, 0, 1]},
        (1, 2): {"tp_src": [0, 1, 2, 3], "dp_src": [0, 0, 2, 2], "pp_first": [0, 1, 0, 1],
                 "pp_last": [2, 3, 2, 3], "pp_next": [2, 3, 0, 1], "pp_prev": [2, 3, 0, 1]},
        (1, 4): {"tp_src": [0, 1, 2, 3], "dp_src": [0, 1, 2, 3], "pp_first": [0, 0, 0, 0],
                 "pp_last": [3, 3, 3, 3], "pp_next": [1, 2, 3, 0], "pp_prev": [3, 0, 1, 2]},
    }
    for layout, table in expected.items():
        for key, column in table.items():
            assert _column(results, layout, key) == column, (layout, key)


def test_virtual_rank_round_trip_and_stage_checks(results):
    # (vrank, first, first ignoring virtual, last, last ignoring virtual)
    for rank, res in enumerate(results):
        initial, chunk1, chunk0 = res["virtual"]
        assert initial == 0  # initialisation with a virtual size starts at chunk 0
        first, last = rank == 0, rank == 3
        assert chunk1 == (1, False, first, last, last), rank
        assert chunk0 == (0, first, first, False, last), rank


def test_model_parallel_cuda_manual_seed(results):
    seeds = [res["seed"] for res in results]
    assert [s["tp_rank"] for s in seeds] == [0, 1, 0, 1]
    for s in seeds[1:]:  # the default generator: identical on every rank
        assert torch.equal(s["default"], seeds[0]["default"])
        assert torch.equal(s["after"], seeds[0]["after"])  # fork leaves it alone
    assert not torch.equal(seeds[0]["forked"], seeds[1]["forked"])  # TP ranks differ
    assert torch.equal(seeds[0]["forked"], seeds[2]["forked"])  # same TP rank, same draws
    for s in seeds:
        g = torch.Generator().manual_seed(_SEED + 2718 + s["tp_rank"])
        assert torch.equal(s["forked"], torch.rand(8, generator=g))
        g = torch.Generator().manual_seed(_SEED)
        assert torch.equal(s["default"], torch.rand(8, generator=g))


# ------------------------------------------------------------------ one process
@pytest.fixture
def fresh_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_single_process_accessors(fresh_state):
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_pipeline_model_parallel_next_rank()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.set_virtual_pipeline_model_parallel_rank(0)
    ps.initialize_model_parallel()
    getters = (
        ps.get_tensor_model_parallel_src_rank, ps.get_data_parallel_src_rank,
        ps.get_pipeline_model_parallel_first_rank, ps.get_pipeline_model_parallel_last_rank,
        ps.get_pipeline_model_parallel_next_rank, ps.get_pipeline_model_parallel_prev_rank,
    )
    assert [g() for g in getters] == [0] * len(getters)
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    assert ps.get_virtual_pipeline_model_parallel_rank() is None
    ps.set_virtual_pipeline_model_parallel_rank(1)  # no virtual size: no effect, as Megatron
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage(ignore_virtual=False)


def test_virtual_stages_without_a_pipeline_are_refused(fresh_state):
    # Megatron-LM 23.05 raises for pipeline sizes <= 2; here 2 works, 1 is refused (it
    # was accepted, and is_pipeline_last_stage() was then False on the only stage).
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size=2 needs "
                                         r"pipeline_model_parallel_size >= 2 \(got 1\)"):
        ps.initialize_model_parallel(1, 1, 2)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=0 must be >= 1"):
        ps.initialize_model_parallel(1, 1, 0)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel(1, 1, 1)  # one chunk: the only stage is first and last
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()


def test_virtual_rank_outside_the_virtual_size_is_refused(fresh_state, monkeypatch):
    # pipeline rank 0 of 2, set without processes (initialize_model_parallel needs them)
    monkeypatch.setattr(ps, "_STATE", ps.ParallelState.build(
        2, 0, pp_size=2, virtual_pp_size=3, create_groups=False))
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 3
    with pytest.raises(ValueError, match=r"virtual pipeline rank 3 is outside 0\.\.2"):
        ps.set_virtual_pipeline_model_parallel_rank(3)
    ps.set_virtual_pipeline_model_parallel_rank(2)
    assert not ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    assert ps.is_pipeline_first_stage(ignore_virtual=True)
    ps.set_virtual_pipeline_model_parallel_rank(0)
    assert ps.is_pipeline_first_stage()


def test_manual_seed_single_process_matches_model_parallel_seed(fresh_state, monkeypatch):
    monkeypatch.setattr(tp_random, "_DEFAULT_TRACKER", tp_random.RNGStatesTracker("cpu"))
    ps.initialize_model_parallel()
    with torch.random.fork_rng(devices=[]):
        tracker = tp_random.model_parallel_cuda_manual_seed(7)
        assert tracker is tp_random.get_rng_tracker()
        with tracker.fork():
            ours = torch.rand(4)
        mine = torch.rand(4)
        ref = tp_random.model_parallel_seed(7, 0, tp_random.RNGStatesTracker("cpu"))
        with ref.fork():
            theirs = torch.rand(4)
        assert torch.equal(ours, theirs) and torch.equal(mine, torch.rand(4))


def test_mpu_is_the_legacy_name_of_parallel_state():
    """`from megatron.core import mpu` (Megatron-LM's ported code) is parallel_state; other
    missing names stay AttributeError, so hasattr() probes work."""
    import megatron.core
    from megatron.core import mpu

    assert mpu is ps
    assert not hasattr(megatron.core, "no_such_name")
