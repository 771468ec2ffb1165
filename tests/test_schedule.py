"""The schedule is a pure function: coverage, per-rank load and critical path, no processes."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from lightseq_hf.parallel.schedule import SCHEDULES, backward_work, build_schedule, required_blocks

WORLDS = range(1, 17)


ROW_CELLS, KEY_CELLS = 4, 2  # every block cut into 4 row slices x 2 key slices


def computed_cells(schedule):
    """Counter of (q chunk, kv chunk, row cell, key cell) over every task."""
    seen = Counter()
    for step in schedule.steps:
        for task in step:
            if task is None:
                continue
            for r in range(ROW_CELLS):
                for c in range(KEY_CELLS):
                    rows = Fraction(task.part, task.parts), Fraction(task.part + 1, task.parts)
                    keys = (Fraction(task.key_part, task.key_parts),
                            Fraction(task.key_part + 1, task.key_parts))
                    if (rows[0] <= Fraction(r, ROW_CELLS) and Fraction(r + 1, ROW_CELLS) <= rows[1]
                            and keys[0] <= Fraction(c, KEY_CELLS) and Fraction(c + 1, KEY_CELLS) <= keys[1]):
                        seen[(task.q_owner, task.kv_owner, r, c)] += 1
    return seen


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", WORLDS)
def test_every_needed_block_is_computed_exactly_once(world, causal, kind):
    schedule = build_schedule(world, causal, kind)
    expected = Counter({(i, j, r, c): 1 for i, j in required_blocks(world, causal)
                        for r in range(ROW_CELLS) for c in range(KEY_CELLS)})
    assert computed_cells(schedule) == expected
    for step in schedule.steps:
        for rank, task in enumerate(step):
            if task is not None:  # a rank only computes with a query or a key chunk it owns
                assert rank in (task.q_owner, task.kv_owner)
                assert task.diagonal == (causal and task.q_owner == task.kv_owner)
    assert all(task is None or task.q_owner == rank for rank, task in enumerate(schedule.steps[0]))
    assert all(task.kv_owner == rank for rank, task in enumerate(schedule.steps[0]))


@pytest.mark.parametrize("kind", ["balanced", "pipelined"])
@pytest.mark.parametrize("world", WORLDS)
def test_balanced_reaches_the_ideal(world, kind):
    schedule = build_schedule(world, True, kind)
    assert schedule.critical_path() == Fraction(world, 2)
    assert all(schedule.load(r) == Fraction(world, 2) for r in range(world))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", range(2, 9))
def test_pipelined_cuts_the_last_step_so_each_partial_travels_once(world, causal):
    """The last step becomes two half-size steps: a task on this rank's own query rows is cut by keys (its
    dk/dv partials go to the key owner, each key once), a task on another rank's rows by rows (its out,
    lse and dq go to the query owner, each row once); the steps before are the balanced schedule's."""
    balanced = build_schedule(world, causal, "balanced")
    pipelined = build_schedule(world, causal, "pipelined")
    assert pipelined.steps[:-2] == balanced.steps[:-1]
    for rank, task in enumerate(balanced.steps[-1]):
        first, second = pipelined.steps[-2][rank], pipelined.steps[-1][rank]
        if task is None:
            assert first is None and second is None
            continue
        assert first.cost == second.cost == task.cost / 2
        own_rows = task.q_owner == rank
        assert (first.rows(12), second.rows(12)) == ((task.rows(12),) * 2 if own_rows else
                                                     ((task.rows(12)[0], sum(task.rows(12)) // 2),
                                                      (sum(task.rows(12)) // 2, task.rows(12)[1])))
        assert (first.keys(12), second.keys(12)) == (((0, 6), (6, 12)) if own_rows else ((0, 12),) * 2)
    work = backward_work(pipelined)
    assert [w.blocks for w in work] == [w.blocks for w in backward_work(balanced)]
    assert [w.dkv_sent for w in work] == [w.dkv_sent for w in backward_work(balanced)]
    assert [w.dq_sent for w in work] == [w.dq_sent for w in backward_work(balanced)]


def test_pipelining_a_single_step_changes_nothing():
    assert build_schedule(1, True, "pipelined").steps == build_schedule(1, True, "balanced").steps


@pytest.mark.parametrize("world", WORLDS)
def test_ring_critical_path(world):
    schedule = build_schedule(world, True, "ring")
    assert schedule.critical_path() == world - Fraction(1, 2)
    assert [schedule.load(r) for r in range(world)] == [r + Fraction(1, 2) for r in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_paper_schedule_is_balanced_for_odd_worlds_only(world):
    schedule = build_schedule(world, True, "paper")
    expected = Fraction(world, 2) if world % 2 else Fraction(world + 1, 2)
    assert schedule.critical_path() == expected


@pytest.mark.parametrize("world", WORLDS)
def test_non_causal_is_a_balanced_ring(world):
    schedule = build_schedule(world, False)
    assert len(schedule.steps) == world
    assert schedule.critical_path() == world
    assert all(schedule.load(r) == world for r in range(world))


def test_p2_is_balanced_by_splitting_query_rows():
    schedule = build_schedule(2, True, "balanced")
    last = schedule.steps[1]
    assert (last[0].q_owner, last[0].kv_owner, last[0].part) == (1, 0, 1)
    assert (last[1].q_owner, last[1].kv_owner, last[1].part) == (1, 0, 0)
    assert last[0].rows(10) == (5, 10) and last[1].rows(10) == (0, 5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule(4, True, "zigzag")
    with pytest.raises(ValueError, match="world size"):
        build_schedule(0)


@pytest.mark.parametrize("world", range(2, 9))
def test_balanced_backward_is_balanced_and_every_gradient_computed_once(world):
    """Backward mirrors forward: the same per-rank block work (so within 3%: exactly P/2 each), every
    block's dq/dk/dv computed once (by whoever computed the block: coverage above), each rank's kernel
    calls of the same shape at every step, and every gradient computed for another rank added there."""
    schedule = build_schedule(world, True, "balanced")
    work = backward_work(schedule)
    assert [w.blocks for w in work] == [schedule.load(r) for r in range(world)]
    assert max(w.blocks for w in work) / min(w.blocks for w in work) - 1 <= 0.03
    assert len({w.shapes for w in work}) == 1  # diagonal, then full blocks, then row halves: same on all
    assert sum(w.dq_sent for w in work) == sum(w.dq_merged for w in work)
    assert sum(w.dkv_sent for w in work) == sum(w.dkv_merged for w in work)


def test_p4_backward_work_and_gradient_merges():
    """The numbers behind the backward analysis at P = 4: every rank 2 block units with the same
    kernel shapes (a causal diagonal, a full block, half a block's rows); only the float32 gradient
    merges differ: key owners 0 and 1 add two dk/dv pairs each, ranks 2 and 3 one pair and half a dq,
    or one and a half dq."""
    work = backward_work(build_schedule(4, True, "balanced"))
    assert [w.blocks for w in work] == [2, 2, 2, 2]
    assert work[0].shapes == ((True, 1), (False, 1), (False, Fraction(1, 2)))
    assert [w.dkv_merged for w in work] == [2, 2, 1, 0]
    assert [w.dq_merged for w in work] == [0, 0, Fraction(1, 2), Fraction(3, 2)]
    assert [w.dkv_sent for w in work] == [0, 1, 2, 2]
    assert [w.dq_sent for w in work] == [Fraction(3, 2), Fraction(1, 2), 0, 0]

