"""Pipeline schedules as data, checked without processes: the plans of all ranks are run
against each other by `simulate` (a send completes only once its receive is posted, each
rank's batches complete in posting order), which fails on a deadlock, on a message
received as something else than was sent, on a compute before its input arrived, and on
missing forwards/backwards. Also the stage layout (which layers live where), and the
names the watchdog's messages give actions and transfers."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from megatron.core.models.gpt.stages import stage_layout
from megatron.core.pipeline_parallel import action_phase, tensor_shape, transfer_name
from megatron.core.pipeline_parallel.schedules import (
    BACKWARD,
    COMM,
    FORWARD,
    WAIT,
    Action,
    ScheduleError,
    add_communication,
    build_schedule,
    compute_order,
    compute_slots,
    max_in_flight,
    schedule_name,
    simulate,
)


def _layouts():
    for pp in range(1, 7):
        for vpp in ([1] if pp == 1 else [1, 2, 3]):
            for m in range(1, 13):
                if vpp == 1 or m % pp == 0:
                    yield pp, vpp, m


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_every_plan_runs_to_completion(forward_only, overlap):
    """Every forward has its backward, every send its receive (same message, same order),
    no rank talks to itself, nobody deadlocks: for pp 1..6, vpp 1..3, 1..12 micro-batches."""
    for pp, vpp, m in LAYOUTS:
        plans = build_schedule(pp, m, vpp, forward_only, overlap)
        assert len(plans) == pp
        simulate(plans, vpp, m, forward_only)
        for plan in plans:
            kinds = [a.kind for a in plan]
            assert kinds.count(FORWARD) == m * vpp
            assert kinds.count(BACKWARD) == (0 if forward_only else m * vpp)
            posted = {a.batch for a in plan if a.kind == COMM}
            assert posted == {a.batch for a in plan if a.kind == WAIT}, "every batch waited"


def test_no_pipelining_is_plain_gradient_accumulation():
    (plan,) = build_schedule(1, 4)
    assert [(a.kind, a.microbatch) for a in plan] == [
        (k, m) for m in range(4) for k in (FORWARD, BACKWARD)]
    assert schedule_name(1) == "no pipelining" and schedule_name(4, 1) == "1F1B"
    assert schedule_name(2, 2) == "interleaved 1F1B"


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 8), (4, 3), (4, 4), (4, 16), (6, 7)])
def test_1f1b_holds_at_most_pp_microbatches(pp, m):
    """Rank r warms up with pp - r - 1 forwards, so it holds min(pp - r, m) activation
    sets at most (counted over the plan)."""
    for r, plan in enumerate(build_schedule(pp, m, 1)):
        assert max_in_flight(plan) == min(pp - r, m) <= pp
    # without pipelining-aware scheduling (all forwards first) it would be m
    assert max_in_flight([a for a in build_schedule(pp, m, 1, True)[0]]) == m


def test_1f1b_order_of_a_middle_rank():
    order = [(a.kind[0].upper(), a.microbatch) for a in compute_order(4, 1, 5)]
    assert order == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                     ("B", 2), ("B", 3), ("B", 4)]


def test_interleaved_order_follows_megatron():
    """pp 2, 2 chunks, 4 micro-batches, rank 0: groups of pp micro-batches per chunk;
    warm-up (pp - r - 1) * 2 + (vpp - 1) * pp = 4 forwards; backward chunks reversed."""
    order = [(a.kind[0].upper(), a.microbatch, a.chunk) for a in compute_order(2, 0, 4, 2)]
    assert order[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert order[4:8] == [("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1)]
    assert order[-2:] == [("B", 2, 0), ("B", 3, 0)]
    # micro-batches == pp: all forwards first
    order = [a.kind for a in compute_order(4, 2, 4, 3)]
    assert order == [FORWARD] * 12 + [BACKWARD] * 12


def test_interleaved_steady_state_needs_paired_exchange():
    """Communicating between the forward and the backward of an interleaved steady-state
    step makes neighbours send to each other at once: a deadlock when sends wait for
    their receives. The real plan exchanges both directions in one batch."""
    pp, m, vpp = 2, 4, 2
    naive = [add_communication([[a] for a in compute_order(pp, r, m, vpp)], pp, r, vpp)
             for r in range(pp)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(naive, vpp, m)
    simulate(build_schedule(pp, m, vpp), vpp, m)


def _without(plan, pred):
    return [a for a in plan if not pred(a)]


def test_simulator_catches_broken_plans():
    plans = [list(p) for p in build_schedule(3, 4)]
    simulate(plans, 1, 4)
    # a forgotten backward
    bad = [plans[0], plans[1], _without(plans[2], lambda a: a.kind == BACKWARD and a.microbatch == 3)]
    with pytest.raises(ScheduleError):
        simulate(bad, 1, 4)
    # a send that is never posted: its receiver waits forever
    first_comm = next(a for a in plans[0] if a.kind == COMM)
    bad = [[a if a is not first_comm else dataclasses.replace(a, ops=()) for a in plans[0]],
           plans[1], plans[2]]
    with pytest.raises(ScheduleError):
        simulate(bad, 1, 4)
    # two micro-batches sent in the wrong order
    sends = [a for a in plans[0] if a.kind == COMM]
    swapped = {sends[0].batch: sends[1].ops, sends[1].batch: sends[0].ops}
    bad = [[dataclasses.replace(a, ops=swapped[a.batch]) if a.kind == COMM and a.batch in swapped
            else a for a in plans[0]], plans[1], plans[2]]
    with pytest.raises(ScheduleError, match="sent as"):
        simulate(bad, 1, 4)
    # a backward before its forward
    bad = [[Action(BACKWARD, 0, 0)] + plans[0], plans[1], plans[2]]
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate(bad, 1, 4)


def test_simulator_rejects_compute_before_input_arrives():
    plans = [list(p) for p in build_schedule(2, 2)]
    plans[1] = _without(plans[1], lambda a: a.kind == WAIT)
    with pytest.raises(ScheduleError, match="before its input arrived"):
        simulate(plans, 1, 2)


def test_interleaved_needs_microbatches_multiple_of_pp():
    with pytest.raises(ValueError, match=r"number of micro-batches \(6\).*size \(4\)"):
        compute_slots(4, 0, 6, 2)
    with pytest.raises(ValueError, match="size >= 2"):
        compute_slots(1, 0, 4, 2)


@pytest.mark.parametrize("pp", [0, -1])
def test_pipeline_size_below_one_is_refused_not_an_empty_plan(pp):
    # Ported code calling build_schedule(0, M) got () back: no rank, nothing trained.
    with pytest.raises(ValueError, match=rf"pipeline-model-parallel size {pp} must be >= 1"):
        build_schedule(pp, 4)
    assert len(build_schedule(1, 4)) == 1


def test_overlap_defers_waits_only_for_send_only_batches():
    plain = build_schedule(4, 8, 1, False, False)[0]
    overlapped = build_schedule(4, 8, 1, False, True)[0]
    assert [a for a in plain if a.kind != WAIT] == [a for a in overlapped if a.kind != WAIT]
    # rank 0 warm-up sends (no receive) are not waited for before the next forward
    first = [a.kind for a in overlapped[:4]]
    assert first == [FORWARD, COMM, FORWARD, COMM]


# --------------------------------------------------------------------------- stage layout
def test_stage_layout_splits_layers_by_index():
    specs = [stage_layout(8, 4, r) for r in range(4)]
    assert [(s[0].layer_offset, s[0].num_layers) for s in specs] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s[0].pre_process, s[0].post_process) for s in specs] == [
        (True, False), (False, False), (False, False), (False, True)]
    assert stage_layout(4, 1, 0)[0] == stage_layout(4, 1, 0, 1)[0]
    assert stage_layout(4, 1, 0)[0].pre_process and stage_layout(4, 1, 0)[0].post_process


def test_stage_layout_virtual_stages():
    """8 layers, pp 2, 2 chunks: chunk c of rank r is virtual stage 2c + r with 2 layers."""
    r0, r1 = stage_layout(8, 2, 0, 2), stage_layout(8, 2, 1, 2)
    assert [(s.virtual_stage, s.layer_offset) for s in r0] == [(0, 0), (2, 4)]
    assert [(s.virtual_stage, s.layer_offset) for s in r1] == [(1, 2), (3, 6)]
    assert r0[0].pre_process and not r0[1].pre_process and r1[1].post_process
    assert not any(s.post_process for s in r0)


def test_stage_layout_standalone_embedding():
    specs = [stage_layout(6, 3, r, standalone_embedding_stage=True)[0] for r in range(3)]
    assert [(s.layer_offset, s.num_layers) for s in specs] == [(0, 0), (0, 3), (3, 3)]
    assert specs[0].pre_process and specs[2].post_process


def test_stage_layout_errors_name_the_sizes():
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible .* \\(4\\)"):
        stage_layout(6, 4, 0)
    with pytest.raises(ValueError, match="virtual stages"):
        stage_layout(8, 2, 0, 3)
    with pytest.raises(ValueError, match="standalone-embedding-stage"):
        stage_layout(8, 1, 0, standalone_embedding_stage=True)


def test_tensor_shape():
    assert tensor_shape(16, 2, 32) == (16, 2, 32)
    assert tensor_shape(16, 2, 32, tp_size=4, sequence_parallel=True) == (4, 2, 32)
    with pytest.raises(ValueError, match="not divisible"):
        tensor_shape(10, 2, 32, tp_size=4, sequence_parallel=True)


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 6), (4, 2, 8), (3, 3, 6)])
def test_a_transfer_has_one_name_at_both_ends(pp, vpp, m):
    """The watchdog checks each rank in under the names of the transfers it posts, and
    compares the two ends: every name a sender posts, its receiver posts, as often."""
    sends, recvs = Counter(), Counter()
    for rank, plan in enumerate(build_schedule(pp, m, vpp, False, False)):
        for a in plan:
            for op in a.ops:
                side = sends if op.kind.startswith("send") else recvs
                side[transfer_name(op, rank, pp, vpp)] += 1
    assert sends == recvs and len(sends) == 2 * m * (pp * vpp - 1)
    assert set(sends.values()) == {1}


def test_action_phases_name_the_micro_batch_and_the_stage():
    plan = build_schedule(2, 4, 1, False, False)
    assert action_phase(plan[1][2], 1, 2) == "micro-batch 0 forward (pipeline stage 1)"
    batch = plan[0][4]  # rank 0 sends micro-batch 1's activation, gets micro-batch 0's grad
    assert action_phase(batch, 0, 2) == (
        "pipeline transfers (micro-batch 1 activation from pipeline stage 0 to 1, "
        "micro-batch 0 gradient from pipeline stage 1 to 0)")
    assert action_phase(Action(BACKWARD, 3, 0), 0, 1) == "micro-batch 3 backward"
    assert action_phase(Action(FORWARD, 2, 1), 0, 2, 2) == \
        "micro-batch 2 forward (virtual pipeline stage 2)"
