"""The tile cost model of the packed-document schedule: its tile counts against brute force, and the
schedule balancing it (pure functions, no processes)."""

from __future__ import annotations

import math

import pytest
import torch
from doc_reference import random_docs
from test_segment_schedule import coverage_errors

from lightseq_hf.parallel.segment_schedule import (
    PAIRS,
    BlockTiles,
    TileCost,
    build_segment_schedule,
    modeled_loads,
)
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range


def brute_tiles(lo, hi, start, stop, tile_m, tile_n, n_keys, *, kernel_rule):
    """Tiles of query rows ``[start, stop)`` (query tiles aligned at ``start``) against keys ``[0, n_keys)``
    of every batch row, counted one tile at a time. ``kernel_rule=False``: tiles holding a visible pair
    (checked pair by pair); ``True``: the tiles the ranged kernels visit (``ranged_tiles``): from the tile
    holding the smallest ``lo`` of the query tile's rows (padding rows included) to its largest ``hi``,
    when any row of it sees a key."""
    total = 0
    for r in range(lo.shape[0]):
        for q0 in range(start, stop, tile_m):
            rows = range(q0, min(q0 + tile_m, stop))
            if kernel_rule:
                if any(int(hi[r, i]) > int(lo[r, i]) for i in rows):
                    first, last = min(int(lo[r, i]) for i in rows), max(int(hi[r, i]) for i in rows)
                    total += sum(1 for k0 in range(0, n_keys, tile_n) if k0 + tile_n > first and k0 < last)
                continue
            for k0 in range(0, n_keys, tile_n):
                keys = range(k0, min(k0 + tile_n, n_keys))
                total += any(int(lo[r, i]) <= j < int(hi[r, i]) for i in rows for j in keys)
    return total


def brute_masked(lo, hi, start, stop, tile_m, tile_n, n_keys):
    """Of the tiles the ranged kernels visit, those not seen entirely by every row of the query tile
    (the kernels mask them), counted one tile at a time."""
    masked = 0
    for r in range(lo.shape[0]):
        for q0 in range(start, stop, tile_m):
            rows = range(q0, min(q0 + tile_m, stop))
            if not any(int(hi[r, i]) > int(lo[r, i]) for i in rows):
                continue
            first, last = min(int(lo[r, i]) for i in rows), max(int(hi[r, i]) for i in rows)
            for k0 in range(0, n_keys, tile_n):
                if k0 + tile_n > first and k0 < last:
                    masked += not all(int(lo[r, i]) <= k0 and int(hi[r, i]) >= k0 + tile_n for i in rows)
    return masked


def lognormal_segments(gen, length, median, sigma=1.0):
    docs, t = [], 0
    while t < length:
        size = max(1, round(math.exp(math.log(median) + sigma * float(torch.randn(1, generator=gen)))))
        docs.append((t, min(length, t + size)))
        t += size
    return Segments(length, (tuple(docs),))


def test_tile_count_matches_brute_force():
    gen = torch.Generator().manual_seed(3)
    cases = 0
    for trial in range(12):
        world, n = (2, 3, 4)[trial % 3], 20 + trial
        length = world * n
        padded = trial >= 6
        docs = random_docs(gen, 2, length, pad_left=padded, pad_right=padded, max_len=[6, 25][trial % 2])
        causal, window = [(True, None), (True, 5), (False, None), (False, 4)][trial % 4]
        tile_m, tile_n = [(4, 4), (8, 4), (3, 5), (16, 16), (1, 1)][trial % 5]
        lo, hi = key_ranges(Segments(length, docs), causal=causal, window=window)
        for i in range(world):
            for j in range(world):
                rows = slice(i * n, (i + 1) * n)
                lo_l, hi_l = local_key_range(lo[:, rows], hi[:, rows], j * n, n)
                tiles = BlockTiles(lo_l, hi_l, tile_m, tile_n)
                for start, stop in ((0, n), (3, n), (1, n - 2), (5, 6), (7, 7)):
                    counted = tiles.tiles(start, stop)
                    visited = brute_tiles(lo_l, hi_l, start, stop, tile_m, tile_n, n, kernel_rule=True)
                    holding = brute_tiles(lo_l, hi_l, start, stop, tile_m, tile_n, n, kernel_rule=False)
                    assert counted == visited, (trial, i, j, start, stop)
                    masked = brute_masked(lo_l, hi_l, start, stop, tile_m, tile_n, n)
                    assert tiles.tile_counts(start, stop) == (visited, masked), (trial, i, j, start, stop)
                    # without padding the kernels visit exactly the tiles holding a visible pair; padding
                    # rows (empty ranges at their own position) can widen a query tile's key span
                    assert counted == holding if not padded else counted >= holding, (trial, i, j, start)
                    cases += 1
    assert cases > 300


def test_tile_count_follows_the_kernel_span_across_interior_padding():
    # padding between two documents: a query tile holding both visits the key tiles between them too
    seg = Segments(32, (((0, 5), (13, 20), (27, 32)), ((2, 30),)))
    lo, hi = key_ranges(seg, causal=True)
    lo_l, hi_l = local_key_range(lo, hi, 0, 32)
    tiles = BlockTiles(lo_l, hi_l, 16, 4)
    visited = brute_tiles(lo_l, hi_l, 0, 32, 16, 4, 32, kernel_rule=True)
    assert tiles.tiles(0, 32) == visited > brute_tiles(lo_l, hi_l, 0, 32, 16, 4, 32, kernel_rule=False)


def test_one_by_one_tiles_count_visible_pairs():
    seg = Segments(60, random_docs(torch.Generator().manual_seed(1), 2, 60, max_len=17))
    for world in (2, 3):
        for causal, window in ((True, None), (True, 6), (False, None)):
            pair_sched = build_segment_schedule(world, seg, causal, window, cost=PAIRS)
            loads = modeled_loads(pair_sched, seg, causal, window, cost=PAIRS)
            assert loads == [float(pair_sched.load(r)) for r in range(world)]


def test_task_cost_terms():
    model = TileCost(tile_m=128, tile_n=128, forward=1.0, backward=2.5, launch=10.0, launches=3, row_tile=0.5)
    assert model.task_cost(100, 300) == 3.5 * 100 + 30.0 + 0.5 * 3
    assert model.task_cost(0, 0) == 0.0
    with pytest.raises(ValueError, match="tile sizes"):
        TileCost(tile_m=0)
    with pytest.raises(ValueError, match=">= 0"):
        TileCost(launch=-1.0)


# Tile size 16 on 4K tokens (median document 256) has the granularity of 128 on 32K (median 2K).
SMALL = TileCost(tile_m=16, tile_n=16, launch=4.0, row_tile=1.0)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_modeled_cost_balanced_for_lognormal_mixes(world):
    gen = torch.Generator().manual_seed(100 + world)
    for trial in range(4):
        # 256-2048 rows of 16-row tiles per rank: the granularity of 128-row tiles at 32K-256K tokens
        length = 4096 * (1 + trial % 2) // world * world
        seg = lognormal_segments(gen, length, median=256)
        sched = build_segment_schedule(world, seg, True, None, cost=SMALL)
        assert not coverage_errors(sched, seg, True, None)
        loads = modeled_loads(sched, seg, cost=SMALL)
        assert max(loads) <= 1.03 * min(loads), (trial, loads)
        # never worse than balancing visible pairs, under the model
        pair_sched = build_segment_schedule(world, seg, True, None, cost=PAIRS)
        pair_loads = modeled_loads(pair_sched, seg, cost=SMALL)
        assert max(loads) <= max(pair_loads) + 1e-9, (trial, loads, pair_loads)


def test_rows_that_see_no_key_of_a_block_are_not_scheduled():
    # a document crossing from shard 0 into shard 1: block (1, 0) is computed for its rows in shard 1 only
    seg = Segments(64, (((0, 24), (24, 40), (40, 64)),))
    for cost in (PAIRS, TileCost(tile_m=4, tile_n=4, launch=0.0)):
        sched = build_segment_schedule(2, seg, True, None, cost=cost)
        cross = [t for s in sched.steps for t in s if t is not None and (t.q_owner, t.kv_owner) == (1, 0)]
        assert cross and all(0 <= t.row_start and t.row_stop <= 8 for t in cross), cross
        assert sum(t.row_stop - t.row_start for t in cross) == 8
        assert not coverage_errors(sched, seg, True, None)


def test_launch_cost_avoids_needless_tasks():
    # rank 0 holds one 128-token document, rank 1 two of 64: with a launch cost above the gain, no split
    seg = Segments(256, (((0, 128), (128, 192), (192, 256)),))
    costly = TileCost(tile_m=16, tile_n=16, launch=1000.0)
    sched = build_segment_schedule(2, seg, True, None, cost=costly)
    assert [sum(1 for s in sched.steps if s[r] is not None) for r in range(2)] == [1, 1]
    cheap = build_segment_schedule(2, seg, True, None, cost=TileCost(tile_m=16, tile_n=16, launch=0.0))
    assert sum(t is not None for s in cheap.steps for t in s) > 2


def test_default_model_pure_and_cached():
    seg = lognormal_segments(torch.Generator().manual_seed(9), 8192, median=512)
    a = build_segment_schedule(4, seg, True, None)
    assert a is build_segment_schedule(4, Segments(seg.length, seg.docs), True, None)
    assert a is not build_segment_schedule(4, seg, True, None, cost=PAIRS)
    assert not coverage_errors(a, seg, True, None)
