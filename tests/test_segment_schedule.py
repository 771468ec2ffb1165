"""The schedule for packed documents: a pure function of the boundaries, tested without processes."""

from __future__ import annotations

import pytest
import torch
from doc_reference import random_docs

from lightseq_hf.parallel.segment_schedule import PAIRS, build_segment_schedule, segment_blocks
from lightseq_hf.parallel.segments import Segments, key_ranges, visible_pairs


def coverage_errors(schedule, segments, causal, window):
    """Every visible pair is computed exactly once: per block, task rows are disjoint and cover every
    row that sees a key of that block; no task is empty or needless."""
    world, n = schedule.world, segments.length // schedule.world
    lo, hi = key_ranges(segments, causal=causal, window=window)
    errors = []
    blocks = segment_blocks(world, segments, causal, window)
    covered = {}
    for step in schedule.steps:
        for task in step:
            if task is None:
                continue
            if (task.q_owner, task.kv_owner) not in blocks:
                errors.append(f"task {task} computes a block with no visible pair")
            cover = covered.setdefault((task.q_owner, task.kv_owner), torch.zeros(n, dtype=torch.int64))
            cover[task.row_start:task.row_stop] += 1
            rows = slice(task.q_owner * n + task.row_start, task.q_owner * n + task.row_stop)
            keys = (task.kv_owner * n, (task.kv_owner + 1) * n)
            work = int(visible_pairs(lo[:, rows], hi[:, rows], *keys).sum())
            if work != task.work or work == 0:
                errors.append(f"task {task} claims {task.work} pairs, holds {work}")
            # the task reads exactly the keys its rows see: all pairs inside, its first and last key seen
            ka, kb = (keys[0] + x for x in task.keys(n))
            inside = visible_pairs(lo[:, rows], hi[:, rows], ka, kb)
            first_seen = visible_pairs(lo[:, rows], hi[:, rows], ka, ka + 1).sum()
            last_seen = visible_pairs(lo[:, rows], hi[:, rows], kb - 1, kb).sum()
            if int(inside.sum()) != work or not (first_seen > 0 and last_seen > 0):
                errors.append(f"task {task}: keys [{ka}, {kb}) are not the span its rows see")
    for i, j in blocks:
        per_row = visible_pairs(lo[:, i * n:(i + 1) * n], hi[:, i * n:(i + 1) * n], j * n, (j + 1) * n).sum(0)
        cover = covered.get((i, j), torch.zeros(n, dtype=torch.int64))
        if bool((cover > 1).any()):
            errors.append(f"block {(i, j)}: rows computed twice")
        if bool(((cover == 0) & (per_row > 0)).any()):
            errors.append(f"block {(i, j)}: visible rows never computed")
    total = sum(schedule.load(r) for r in range(world))
    if total != sum(blocks.values()):
        errors.append(f"total work {total} != visible pairs {sum(blocks.values())}")
    for r in range(world):
        first = schedule.steps[0][r]
        if first is not None and not first.q_owner == first.kv_owner == r:
            errors.append(f"rank {r}'s step 0 is not local")
    return errors


def imbalance(schedule):
    loads = [schedule.load(r) for r in range(schedule.world)]
    return max(loads) / (sum(loads) / len(loads)) - 1


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal, window", [(True, None), (True, 7), (False, None)])
def test_every_visible_pair_once_and_balanced(world, causal, window):
    gen = torch.Generator().manual_seed(world)
    for trial in range(6):
        length = 48 * world
        docs = random_docs(gen, 2, length, pad_left=trial % 2 == 0, pad_right=trial % 3 == 0,
                           max_len=[8, 40, length][trial % 3])
        seg = Segments(length, docs)
        # the default (tile) model at these tiny sizes sees one tile per block: coverage only
        assert not coverage_errors(build_segment_schedule(world, seg, causal, window), seg, causal, window)
        sched = build_segment_schedule(world, seg, causal, window, cost=PAIRS)
        assert not coverage_errors(sched, seg, causal, window)
        # rows of single tokens cap the granularity; with 96+ rows per rank balance is within 5%
        assert imbalance(sched) <= 0.05, (trial, [sched.load(r) for r in range(world)])


def test_documents_inside_shards_need_no_communication():
    # equal work per shard, every document inside one shard: only local diagonal tasks
    seg = Segments(64, (((0, 10), (10, 16), (16, 26), (26, 32), (32, 42), (42, 48), (48, 58), (58, 64)),))
    sched = build_segment_schedule(4, seg, True, None)
    assert len(sched.steps) == 1
    assert all(t.q_owner == t.kv_owner == r and t.rows(16) == (0, 16) for r, t in enumerate(sched.steps[0]))


def test_blocks_without_shared_documents_are_skipped():
    # one document per shard except one crossing from shard 1 into shard 2
    seg = Segments(64, (((0, 16), (16, 40), (40, 48), (48, 64)),))
    assert set(segment_blocks(4, seg, True, None)) == {(0, 0), (1, 1), (2, 2), (3, 3), (2, 1)}
    sched = build_segment_schedule(4, seg, True, None)
    pairs = {(t.q_owner, t.kv_owner) for s in sched.steps for t in s if t is not None}
    assert pairs <= {(0, 0), (1, 1), (2, 2), (3, 3), (2, 1)}
    # a window keeps only the neighbouring shard's blocks
    assert set(segment_blocks(4, Segments.full(1, 64), True, 16)) == {(0, 0), (1, 1), (2, 2), (3, 3), (1, 0),
                                                                      (2, 1), (3, 2)}


def test_one_long_document_balances_like_the_causal_schedule():
    for world in (2, 3, 4, 8):
        seg = Segments.full(1, 64 * world)
        sched = build_segment_schedule(world, seg, True, None, cost=PAIRS)
        assert not coverage_errors(sched, seg, True, None)
        assert imbalance(sched) <= 0.02


def test_a_long_document_on_one_rank_is_shared_out():
    # rank 0 holds one 64-token document, the others only single tokens: the others help rank 0
    docs = ((0, 64), *((t, t + 1) for t in range(64, 256)))
    seg = Segments(256, (docs,))
    sched = build_segment_schedule(4, seg, True, None, cost=PAIRS)
    assert not coverage_errors(sched, seg, True, None)
    assert imbalance(sched) <= 0.05
    helpers = {r for s in sched.steps for r, t in enumerate(s) if t is not None and t.q_owner == 0 and r != 0}
    assert helpers == {1, 2, 3}


def test_all_padding_schedules_nothing():
    sched = build_segment_schedule(3, Segments(30, ((), ())), True, None)
    assert all(t is None for s in sched.steps for t in s)


def test_pure_and_deterministic():
    seg = Segments(40, random_docs(torch.Generator().manual_seed(5), 2, 40, max_len=9))
    again = Segments(40, seg.docs)
    assert build_segment_schedule(4, seg, True, 3) is build_segment_schedule(4, again, True, 3)


def test_length_not_divisible_is_refused():
    with pytest.raises(ValueError, match="multiple of the group size"):
        build_segment_schedule(3, Segments.full(1, 10), True, None)
