"""Rank layout of megatron.core.parallel_state.

The arithmetic tests need no processes: they check every group kind of every layout with a
world of up to 64 ranks against the rules of Megatron's initialize_model_parallel (TP
groups are consecutive ranks, DP groups stride TP inside each block of world/PP ranks, PP
groups stride world/PP, the embedding group is the first and last rank of each PP group).
One test runs 4 gloo processes and checks that all-reduces over the real process groups
sum exactly the expected ranks.
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.parallel_state import (
    GROUP_KINDS,
    ParallelState,
    RankGrid,
    get_parallel_group_info,
)
from tests.dist_utils import run_distributed


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(world: int):
    """Every (tp, pp, ep) with tp * pp dividing world and ep dividing dp."""
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for ep in _divisors(world // (tp * pp)):
                yield tp, pp, ep


def _reference_groups(world: int, tp: int, pp: int):
    """Groups written from the rules of the 23.05 facts sheet (independent of RankGrid)."""
    block = world // pp  # ranks of one pipeline stage
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    dp_groups = [
        list(range(stage * block + j, (stage + 1) * block, tp))
        for stage in range(pp)
        for j in range(tp)
    ]
    pp_groups = [list(range(i, world, block)) for i in range(block)]
    return tp_groups, dp_groups, pp_groups


def _assert_partition(groups, world, size, kind):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world)), f"{kind} groups do not partition the world: {groups}"
    assert all(len(g) == size for g in groups), f"{kind} group sizes != {size}: {groups}"
    assert all(g == sorted(g) for g in groups), f"{kind} groups not sorted: {groups}"


def _group_index(groups):
    """rank -> position of its group in `groups`."""
    return {r: i for i, g in enumerate(groups) for r in g}


def _check_layout(world, tp, pp, ep):
    grid = RankGrid(world, tp, pp, ep)
    dp = world // (tp * pp)
    assert grid.dp_size == dp
    coords = [grid.coords(r) for r in range(world)]

    # coordinates: the documented formula, and rank_of inverts coords
    for r, c in enumerate(coords):
        assert 0 <= c["tp"] < tp and 0 <= c["dp"] < dp and 0 <= c["pp"] < pp
        assert r == c["pp"] * tp * dp + c["dp"] * tp + c["tp"]
        assert r == grid.rank_of(**c)

    sizes = {"tp": tp, "dp": dp, "pp": pp, "mp": tp * pp, "ep": ep, "dp_modulo_ep": dp // ep}
    for kind, size in sizes.items():
        _assert_partition(grid.groups(kind), world, size, kind)
        for r in {0, world // 2, world - 1}:
            assert r in grid.group_of(kind, r)

    ref_tp, ref_dp, ref_pp = _reference_groups(world, tp, pp)
    assert grid.tp_groups() == ref_tp
    assert grid.dp_groups() == ref_dp
    assert grid.pp_groups() == ref_pp

    for g in grid.tp_groups():  # consecutive, aligned
        assert g == list(range(g[0], g[0] + tp)) and g[0] % tp == 0
    for g in grid.dp_groups():  # same tp and pp coordinate, dp coordinate 0..dp-1
        assert len({(coords[r]["tp"], coords[r]["pp"]) for r in g}) == 1
        assert [coords[r]["dp"] for r in g] == list(range(dp))
    for g in grid.pp_groups():  # stride world/pp, same tp and dp coordinate
        assert all(b - a == world // pp for a, b in zip(g, g[1:]))
        assert len({(coords[r]["tp"], coords[r]["dp"]) for r in g}) == 1
        assert [coords[r]["pp"] for r in g] == list(range(pp))
    for d, g in enumerate(grid.mp_groups()):  # all ranks with the same dp rank
        assert g == [r for r in range(world) if coords[r]["dp"] == d]

    # the three main kinds are orthogonal: two groups of different kinds share <= 1 rank
    index = {k: _group_index(grid.groups(k)) for k in ("tp", "dp", "pp", "ep", "dp_modulo_ep")}
    for ka, kb in itertools.combinations(("tp", "dp", "pp"), 2):
        pairs = {(index[ka][r], index[kb][r]) for r in range(world)}
        assert len(pairs) == world, (ka, kb)

    # embedding groups: first and last rank of each PP group; they cover only the
    # first and last pipeline stages, each such rank exactly once
    emb = grid.embedding_groups()
    assert emb == [sorted({g[0], g[-1]}) for g in grid.pp_groups()]
    emb_flat = sorted(r for g in emb for r in g)
    assert emb_flat == [r for r in range(world) if coords[r]["pp"] in (0, pp - 1)]
    pos = grid.position_embedding_groups()
    assert sorted(r for g in pos for r in g) == [r for r in range(world) if coords[r]["pp"] == 0]
    assert all(len(g) == 1 for g in pos)

    # expert groups: consecutive blocks inside a DP group; dp_modulo_ep strides ep inside it
    dp_groups = grid.dp_groups()
    dp_of = {r: tuple(dp_groups[i]) for r, i in index["dp"].items()}
    for g in grid.ep_groups():
        dpg = list(dp_of[g[0]])
        assert all(dp_of[r] == tuple(dpg) for r in g)
        start = dpg.index(g[0])
        assert g == dpg[start : start + ep] and start % ep == 0
    for g in grid.dp_modulo_ep_groups():
        dpg = list(dp_of[g[0]])
        assert g == dpg[dpg.index(g[0]) :: ep]
    # each (ep group, dp_modulo_ep group) pair inside a DP group meets in exactly one rank
    pairs = {(index["ep"][r], index["dp_modulo_ep"][r]) for r in range(world)}
    assert len(pairs) == world


@pytest.mark.parametrize("world", list(range(1, 65)))
def test_every_layout_partitions_the_world(world):
    layouts = list(_layouts(world))
    assert layouts  # at least (1, 1, 1)
    for tp, pp, ep in layouts:
        _check_layout(world, tp, pp, ep)


def test_megatron_docstring_example_world16_tp2_pp4():
    grid = RankGrid(16, tp_size=2, pp_size=4)
    assert grid.dp_size == 2
    assert grid.tp_groups() == [[2 * i, 2 * i + 1] for i in range(8)]
    assert grid.dp_groups() == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15],
    ]
    assert grid.pp_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert grid.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert grid.position_embedding_groups() == [[0], [1], [2], [3]]
    assert grid.mp_groups() == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert grid.coords(13) == {"tp": 1, "dp": 0, "pp": 3}
    assert grid.rank_of(tp=0, dp=1, pp=2) == 10


def test_parallel_state_view_of_one_rank():
    state = ParallelState(RankGrid(16, 2, 4), rank=6)
    assert (state.tp_rank, state.dp_rank, state.pp_rank) == (0, 1, 1)
    assert (state.tp_size, state.dp_size, state.pp_size, state.world_size) == (2, 2, 4, 16)
    assert state.ranks("pp") == [2, 6, 10, 14]
    assert (state.pp_prev_rank, state.pp_next_rank) == (2, 10)
    assert not state.is_first_stage and not state.is_last_stage
    assert state.ranks("embedding") == []  # a middle stage holds no embedding
    assert state.tp_group is None and state.group("dp") is None  # no groups built
    last = ParallelState(RankGrid(16, 2, 4), rank=15)
    assert last.is_last_stage and last.pp_next_rank == 3 and last.ranks("embedding") == [3, 15]


def test_get_parallel_group_info_matches_grid():
    info = get_parallel_group_info(8, 2, 2, 2)
    grid = RankGrid(8, 2, 2, 2)
    assert [row["rank"] for row in info] == list(range(8))
    for row in info:
        r = row["rank"]
        assert {k: row[k] for k in ("tp", "dp", "pp")} == grid.coords(r)
        for kind in GROUP_KINDS:
            assert row[f"{kind}_ranks"] == grid.group_of(kind, r)


# ------------------------------------------------------------------------- errors
def test_world_not_divisible_by_tp_times_pp_names_the_values():
    with pytest.raises(ValueError, match=r"world size \(12\).*\(5\).*\(1\)"):
        RankGrid(12, tp_size=5)
    with pytest.raises(ValueError, match=r"world size \(8\).*\(2\).*\(3\)"):
        RankGrid(8, tp_size=2, pp_size=3)


def test_ep_not_dividing_dp_names_the_values():
    with pytest.raises(ValueError, match=r"data-parallel size \(4\).*expert.*\(3\)"):
        RankGrid(8, tp_size=2, pp_size=1, ep_size=3)
    # the fix: the expert-parallel sizes that divide this data-parallel size
    with pytest.raises(ValueError, match=r"\(6\).*\(4\).*choose one of 1, 2, 3, 6$"):
        RankGrid(6, ep_size=4)


@pytest.mark.parametrize("field", ["world_size", "tp_size", "pp_size", "ep_size"])
def test_sizes_below_one_are_rejected(field):
    sizes = {"world_size": 4, "tp_size": 1, "pp_size": 1, "ep_size": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        RankGrid(**sizes)


def test_bad_rank_and_group_kind():
    grid = RankGrid(4, 2)
    with pytest.raises(ValueError, match="rank 4 outside world of size 4"):
        grid.coords(4)
    with pytest.raises(ValueError, match="unknown group kind 'tensor'"):
        grid.groups("tensor")
    with pytest.raises(ValueError, match="unknown group kind 'tensor'"):
        ParallelState(grid).group("tensor")  # never a silent None


def test_sequence_parallel_requires_tensor_parallel():
    with pytest.raises(ValueError, match="^Sequence parallelism requires tensor parallelism$"):
        ps.initialize_model_parallel(tensor_model_parallel_size=1, sequence_parallel_enabled=True)
    with pytest.raises(ValueError, match="Sequence parallelism requires tensor parallelism"):
        ParallelState.build(world_size=4, rank=0, tp_size=1, sequence_parallel=True)
    assert not ps.model_parallel_is_initialized()


# ----------------------------------------------------------- single-process accessors
@pytest.fixture
def fresh_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_accessors_single_process(fresh_state):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_rank()
    state = ps.initialize_model_parallel()
    assert ps.model_parallel_is_initialized() and ps.get_parallel_state() is state
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.get_data_parallel_rank() == 0
    assert ps.get_data_parallel_world_size() == 1
    for getter in (
        ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group,
        ps.get_data_parallel_group, ps.get_model_parallel_group, ps.get_embedding_group,
    ):
        assert getter() is None  # world of one: nothing to communicate
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


def test_initialize_rejects_tp_larger_than_single_process_world(fresh_state):
    with pytest.raises(ValueError, match=r"world size \(1\)"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    # the likely cause named: torchrun started several processes, none joined the group
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 needs several "
                       r"processes, but torch.distributed is not initialised.*init_process"):
        ps.initialize_model_parallel(1, 2)


def test_initialize_takes_megatron_positional_order(fresh_state):
    # Megatron-LM 23.05's initialize passes (tp, pp, virtual pp, split rank) positionally
    state = ps.initialize_model_parallel(1, 1, None, None)
    assert state.ep_size == 1 and ps.get_tensor_model_parallel_world_size() == 1
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, None, pipeline_model_parallel_split_rank=None)
    ps.destroy_model_parallel()
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_split_rank=1 .*pass None"):
        ps.initialize_model_parallel(1, 1, None, 1)
    assert not ps.model_parallel_is_initialized()


def test_second_initialize_without_destroy_is_refused(fresh_state):
    # Megatron-LM asserts; silently building a second set of groups would leave code that
    # kept the first ones talking over other groups than the accessors return
    state = ps.initialize_model_parallel()
    with pytest.raises(RuntimeError, match=r"already called \(tensor_model_parallel_size=1, "
                       r"pipeline_model_parallel_size=1\).*destroy_model_parallel\(\) first"):
        ps.initialize_model_parallel()
    assert ps.get_parallel_state() is state  # the first state is kept
    ps.destroy_model_parallel()
    assert ps.initialize_model_parallel() is not state


# --------------------------------------------------------------- 4 gloo processes
_DIST_LAYOUTS = [(2, 2, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
_SUM_KINDS = ("tp", "dp", "pp", "mp", "embedding", "ep", "dp_modulo_ep")


def _sum_over(group, rank):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)  # a None group would reduce over the whole world
    return t.item()


def _groups_worker(rank, world_size):
    out = {}
    for tp, pp, ep in _DIST_LAYOUTS:  # every rank builds the layouts in the same order
        state = ParallelState.build(world_size, dist.get_rank(), tp, pp, ep)
        out[(tp, pp, ep)] = {
            kind: _sum_over(state.group(kind), rank)
            for kind in _SUM_KINDS
            if state.group(kind) is not None
        }
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    out["accessors"] = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_world_size(),
        _sum_over(ps.get_tensor_model_parallel_group(), rank),
        _sum_over(ps.get_pipeline_model_parallel_group(), rank),
        # Megatron's accessors keep their groups of one: ported code passes them to torch
        _sum_over(ps.get_data_parallel_group(), rank),
    )
    return out


def test_process_groups_all_reduce_expected_ranks():
    results = run_distributed(_groups_worker, 4)
    # tp=2, pp=2 (dp=1): tp [0,1] [2,3]; dp of one rank: None; pp = embedding = [0,2] [1,3]
    expected = {
        "tp": [1, 1, 5, 5], "pp": [2, 4, 2, 4], "mp": [6, 6, 6, 6], "embedding": [2, 4, 2, 4],
    }
    for kind, sums in expected.items():
        assert [res[(2, 2, 1)][kind] for res in results] == sums, kind
    assert all("dp" not in res[(2, 2, 1)] for res in results)
    for layout in _DIST_LAYOUTS:
        grid = RankGrid(4, *layout)
        for rank, res in enumerate(results):
            for kind in _SUM_KINDS:
                members = grid.group_of(kind, rank)
                # a group of one rank is None (nothing to communicate)
                assert (kind in res[layout]) == (len(members) > 1), (layout, kind, rank)
                if len(members) > 1:
                    assert res[layout][kind] == sum(members), (layout, kind, rank)
    assert [res["accessors"] for res in results] == [
        (0, 0, 1, 1, 2, 0), (1, 0, 1, 1, 4, 1), (0, 1, 1, 5, 2, 2), (1, 1, 1, 5, 4, 3),
    ]


# ------------------------------------------------------- tools/parallel_groups.py
def test_tool_prints_table_and_writes_dot(tmp_path, capsys):
    from tools import parallel_groups

    dot = tmp_path / "groups.dot"
    argv = ["--world-size", "8", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--dot", str(dot)]
    assert parallel_groups.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    assert header == ["rank", "tp", "dp", "pp", "tp group", "dp group", "pp group",
                      "embedding group"]
    rows = [[c.strip() for c in line.split("|")] for line in lines[2:10]]
    assert rows[0] == ["0", "0", "0", "0", "[0,1]", "[0,2]", "[0,4]", "[0,4]"]
    assert rows[7] == ["7", "1", "1", "1", "[6,7]", "[5,7]", "[3,7]", "[3,7]"]
    assert lines[10] == f"wrote {dot}"

    text = dot.read_text()
    assert text.startswith("graph parallel_groups {") and text.rstrip().endswith("}")
    assert text.count("subgraph cluster_pp") == 2
    assert len(re.findall(r"^\s+r\d+ \[label=", text, re.M)) == 8
    # a chain through each group of size > 1: 4 tp, 4 dp, 4 pp and 4 embedding edges
    for colour, count in (("blue", 4), ("darkgreen", 4), ("red", 4), ("orange", 4)):
        assert len(re.findall(rf"-- r\d+ \[color={colour},", text)) == count, colour
    assert "r0 -- r1 [color=blue" in text and "r1 -- r3 [color=darkgreen" in text


def test_tool_dot_counts_for_a_deeper_pipeline(tmp_path, capsys):
    from tools import parallel_groups

    dot = tmp_path / "g.dot"
    assert parallel_groups.main(
        ["--world-size", "16", "--tp", "2", "--pp", "4", "--ep", "2", "--dot", str(dot)]
    ) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0].split("|")[-1].strip() == "ep group" and len(out) == 2 + 16 + 1
    # the table alone read as a layout a run could use: pretrain_gpt.py refuses ep > 1
    assert ("note: --expert-model-parallel-size 2: the ep groups are the rank arithmetic "
            "only; pretrain_gpt.py refuses expert model parallelism") in captured.err
    rank4 = [c.strip() for c in out[2 + 4].split("|")]
    assert rank4[-2:] == ["-", "[4,6]"]  # stage 1 holds no embedding; ep group = dp group
    text = dot.read_text()
    assert text.count("subgraph cluster_pp") == 4
    assert len(re.findall(r"^\s+r\d+ \[label=", text, re.M)) == 16
    # tp: 8 groups x 1 edge; dp (size 2): 8 x 1; pp (size 4): 4 x 3; embedding: 4 x 1; ep: 8
    counts = (("blue", 8), ("darkgreen", 8), ("red", 12), ("orange", 4), ("purple", 8))
    for colour, count in counts:
        assert len(re.findall(rf"-- r\d+ \[color={colour},", text)) == count, colour


def test_tool_bad_sizes_exit_2_with_the_message(capsys):
    from tools import parallel_groups

    with pytest.raises(SystemExit) as exc:
        parallel_groups.main(["--world-size", "8", "--tp", "3"])
    assert exc.value.code == 2
    assert "world size (8) is not divisible" in capsys.readouterr().err


def test_tool_png_without_graphviz_is_an_error(tmp_path, capsys, monkeypatch):
    from tools import parallel_groups

    monkeypatch.setattr(parallel_groups.shutil, "which", lambda name: None)
    png = tmp_path / "g.png"
    assert parallel_groups.main(["--world-size", "4", "--tp", "2", "--png", str(png)]) == 1
    err = capsys.readouterr().err
    assert "error: Graphviz `dot` is not installed" in err and str(png) in err
    assert not png.exists()


def test_tool_dot_file_that_cannot_be_written_is_an_error(tmp_path, capsys):
    from tools import parallel_groups

    dot = tmp_path / "missing" / "x.dot"
    assert parallel_groups.main(["--world-size", "4", "--tp", "2", "--dot", str(dot)]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 + 4  # the table still comes first
    assert err.startswith(f"error: cannot write --dot {dot} (No such file or directory); ")


def test_tool_png_runs_dot(tmp_path, capsys, monkeypatch):
    from tools import parallel_groups

    fake = tmp_path / "dot"  # stands in for Graphviz: copies its stdin to the -o file
    fake.write_text('#!/bin/sh\n[ "$1" = "-Tpng" ] && [ "$2" = "-o" ] && cat > "$3"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    png = tmp_path / "g.png"
    assert parallel_groups.main(["--world-size", "4", "--pp", "2", "--png", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_text().count("subgraph cluster_pp") == 2


def test_tool_runs_as_a_script():
    script = Path(__file__).resolve().parent.parent / "tools" / "parallel_groups.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--world-size", "4", "--tp", "2"],
        capture_output=True, text=True, timeout=60, cwd=script.parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2 + 4
