"""The schedule of packed documents, balanced under a tile cost model (a pure function of the boundaries).

Why tiles: the kernels work in ``tile_m x tile_n`` tiles (Triton ``BLOCK_M x BLOCK_N``; cuDNN/flash alike).
A tile with one visible pair costs as much as a full one, every kernel launch has a fixed overhead
(launch latency, the ops around it, the tail of its last wave), and the backward costs about 2.5x the
forward per tile (its dq and dk/dv passes). Balancing visible pairs exactly (:data:`PAIRS`) left a
9.8% per-rank busy-time spread on 2 x H200 at 64K (2026-11-23): the rank with more tasks and more partial
tiles was slower. :class:`TileCost` models that; :func:`build_segment_schedule` minimizes the busiest
rank's cost under it (:data:`PAIRS` is pair balance as a cost model: 1x1 tiles, no launch cost).

Tiles counted are the ones the ranged kernels visit: query tiles start at a task's first row, key tiles at
its key chunk's first key (the kernels get exactly those slices), and a query tile visits every key tile
from the one holding its first row's first key to the one holding its last row's last key
(``ranged_tiles`` in ``kernels/triton_common.py``); a tile no row of it sees is skipped. With documents
and windows (no padding between documents) that is exactly the tiles holding a visible pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .schedule import Schedule, SpanTask, block_work
from .segments import Segments, key_ranges, local_key_range

__all__ = [
    "BlockTiles", "DEFAULT_COST", "HAND_SET", "PAIRS", "TileCost", "block_tiles", "build_segment_schedule",
    "modeled_loads", "segment_blocks",
]


@dataclass(frozen=True)
class TileCost:
    """Cost of attention blocks, in units of one forward ``tile_m x tile_n`` tile.

    A task (query rows of one query chunk against one key chunk) costs
    ``(forward + backward) * tiles + masked * masked_tiles + launches * launch
    + row_tile * ceil(rows / tile_m)``, where ``tiles`` are the tiles its kernels visit, ``masked_tiles``
    those of them that need a mask (a document edge or the causal diagonal crosses them),
    ``launches`` = 1 forward + 2 backward (dq, dk/dv), and ``row_tile`` charges each query tile's loads and
    stores. A task computed away from its query rows' owner adds ``helper_row`` per row to the rank that
    computes it (its partial output and dq, converted and sent) and ``owner_row`` per row to the owner
    (merging them in).
    """

    tile_m: int = 128
    tile_n: int = 128
    forward: float = 1.0
    backward: float = 2.5
    #: per kernel launch (fixed overhead: launch, the small ops around it, the kernel's last wave)
    launch: float = 32.0
    launches: int = 3
    row_tile: float = 1.0
    masked: float = 0.0
    helper_row: float = 0.0
    owner_row: float = 0.0

    def __post_init__(self) -> None:
        if self.tile_m < 1 or self.tile_n < 1:
            raise ValueError(f"tile sizes must be >= 1, got {self.tile_m} x {self.tile_n}.")
        costs = (self.forward, self.backward, self.launch, self.row_tile, self.masked, self.helper_row,
                 self.owner_row)
        if min(costs) < 0 or self.launches < 0:
            raise ValueError("tile, launch and row costs must be >= 0.")
        if self.forward + self.backward <= 0:
            raise ValueError("forward + backward cost per tile must be > 0.")

    def task_cost(self, tiles: int, rows: int, masked_tiles: int = 0, helper: bool = False) -> float:
        """Modeled cost of one task visiting ``tiles`` tiles (``masked_tiles`` of them masked) over ``rows``
        query rows (0 rows: nothing), to the rank computing it (``helper``: not the rows' owner)."""
        if rows <= 0:
            return 0.0
        return ((self.forward + self.backward) * tiles + self.masked * masked_tiles
                + self.launches * self.launch + self.row_tile * math.ceil(rows / self.tile_m)
                + (self.helper_row * rows if helper else 0.0))


#: Pair balance: visible query-key pairs (1 x 1 tiles, no fixed costs).
PAIRS = TileCost(tile_m=1, tile_n=1, forward=1.0, backward=0.0, launch=0.0, launches=0, row_tile=0.0)
#: A hand-set tile model (128 x 128 tiles, constants not fitted; kept for comparisons).
HAND_SET = TileCost()
#: Fitted to each rank's compute-only forward+backward time of the Triton kernels (32/8 heads, head dim
#: 128, bf16), replayed rank by rank on one H200 for 96 packed rows of 64K and 128K tokens at P = 2 and 4
#: (``scripts/fit_tile_cost.py benchmarks/results/raw/replay-packed-h200-2026-11-23-dkdv-split.jsonl``):
#: a task costs about 0.63 ms beyond its tiles (launches, the ops around them, the kernels' last waves),
#: as much as 235 tiles; masked tiles cost no more than others once counted.
DEFAULT_COST = TileCost(tile_m=128, tile_n=128, forward=1.0, backward=4.0, launch=391.976, launches=3,
                        row_tile=6.649, masked=0.0, helper_row=0.08209, owner_row=0.15574)


class BlockTiles:
    """Tile counts of row spans of one (query chunk, key chunk) block, from its local key ranges.

    ``lo``/``hi``: int64 ``(batch, rows)``, the block's key ranges in key-chunk coordinates, monotone along
    each row (what :func:`local_key_range` gives the kernels).
    """

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, tile_m: int, tile_n: int) -> None:
        # numpy: the schedule asks thousands of small questions, each a few vector ops
        self.lo, self.hi = lo.long().numpy(), hi.long().numpy()
        self.tile_m, self.tile_n = tile_m, tile_n
        self.seen_prefix = np.zeros((self.lo.shape[0], self.lo.shape[1] + 1), dtype=np.int64)
        np.cumsum(self.hi > self.lo, axis=1, out=self.seen_prefix[:, 1:])
        self.seen_total = self.seen_prefix.sum(0)  # rows that see a key, over the batch, non-decreasing
        self.rows = lo.shape[1]

    def tiles(self, start: int, stop: int) -> int:
        """Tiles the kernels visit for query rows ``[start, stop)`` (query tiles aligned at ``start``)."""
        return self.tile_counts(start, stop)[0]

    def tile_counts(self, start: int, stop: int) -> tuple[int, int]:
        """``(visited, masked)`` tiles of query rows ``[start, stop)`` (query tiles aligned at ``start``):
        a query tile visits key tiles from the one holding its rows' first key to the one holding their
        last; those every row sees entirely need no mask (``ranged_tiles`` in the kernels)."""
        if stop <= start:
            return 0, 0
        tn = self.tile_n
        first = np.arange(start, stop, self.tile_m)
        last = np.minimum(first + self.tile_m, stop) - 1
        any_seen = (self.seen_prefix[:, last + 1] - self.seen_prefix[:, first]) > 0
        # ranges are monotone along the rows: a tile's smallest and largest lo / hi are at its ends
        lo_first, lo_last = self.lo[:, first], self.lo[:, last]
        hi_first, hi_last = self.hi[:, first], self.hi[:, last]
        key_first = lo_first // tn * tn
        key_stop = np.maximum(hi_last, key_first)
        full_lo = np.minimum(np.maximum(-(-lo_last // tn) * tn, key_first), key_stop)
        full_hi = np.minimum(np.maximum(hi_first // tn * tn, full_lo), key_stop)
        visited = np.where(any_seen, (key_stop - key_first + tn - 1) // tn, 0)
        masked = visited - np.where(any_seen, (full_hi - full_lo) // tn, 0)
        return int(visited.sum()), int(masked.sum())

    def key_span(self, start: int, stop: int) -> tuple[int, int]:
        """The keys ``[first, last)`` of the block that rows ``[start, stop)`` see (none: ``(0, 0)``)."""
        lo, hi = self.lo[:, start:stop], self.hi[:, start:stop]
        seen = hi > lo
        if not seen.any():
            return 0, 0
        return int(lo[seen].min()), int(hi[seen].max())

    def seen_rows(self, start: int, stop: int) -> tuple[int, int]:
        """``[start, stop)`` trimmed to its first and last rows that see a key (empty: ``(start, start)``)."""
        total = self.seen_total
        if total[stop] == total[start]:
            return start, start
        first = int(np.searchsorted(total, total[start], side="right")) - 1
        last = int(np.searchsorted(total, total[stop], side="left"))
        return max(first, start), min(last, stop)


def block_tiles(segments: Segments, world: int, causal: bool, window: int | None, q_chunk: int, kv_chunk: int,
                model: TileCost) -> BlockTiles:
    """The :class:`BlockTiles` of block ``(q_chunk, kv_chunk)`` when ``segments`` is split over ``world``."""
    n = segments.length // world
    lo, hi = key_ranges(segments, causal=causal, window=window)
    rows = slice(q_chunk * n, (q_chunk + 1) * n)
    lo_l, hi_l = local_key_range(lo[:, rows], hi[:, rows], kv_chunk * n, n)
    return BlockTiles(lo_l, hi_l, model.tile_m, model.tile_n)


@dataclass(eq=False)  # identity: two pieces with equal rows are still two pieces
class _Piece:
    q_owner: int
    kv_owner: int
    row_start: int
    row_stop: int


def build_segment_schedule(
    world: int,
    segments: Segments,
    causal: bool = True,
    window: int | None = None,
    tolerance: float = 0.01,
    cost: TileCost = DEFAULT_COST,
) -> Schedule:
    """The schedule of attention over packed documents (a pure function of the boundaries, cached).

    Only blocks with a visible pair become tasks, trimmed to the query rows that see a key of the block
    (a block whose chunks share no document is neither computed nor sent, and a task ships only the rows
    it needs). Each block starts with its query owner; then, while the busiest rank is more than
    ``tolerance`` above the mean modeled ``cost``, the tail query rows of one of its pieces move to the
    idlest rank, at the split that minimizes the larger of the two ranks' costs (counting the extra
    task it creates); the move must lower that maximum. Among equal moves, a piece whose keys the idle
    rank holds is preferred (it then needs only the query rows). Every visible pair is computed exactly
    once. Each rank computes its own diagonal block at step 0 (local), then its other tasks, costliest
    first. The greedy runs from the owners' blocks and from the pair-balanced split (refined under the
    model); the lower modeled maximum wins, so the tile model is never worse than balancing pairs.
    ``SpanTask.work`` stays the visible pairs; :func:`modeled_loads` gives the modeled costs.
    """
    return _segment_schedule(world, segments, causal, window, tolerance, cost)


class _Blocks:
    """Lazily built :class:`BlockTiles` and pair prefix sums of every block (schedule internals)."""

    def __init__(self, segments: Segments, world: int, causal: bool, window: int | None, cost: TileCost,
                 like: _Blocks | None = None):
        self.n = segments.length // world
        self.world, self.cost = world, cost
        self.lo, self.hi = key_ranges(segments, causal=causal, window=window)
        if like is not None:  # the same blocks under another cost: share the pair counts
            self.work, self.prefix = like.work, like.prefix
        else:
            self.work, self.prefix = block_work(self.lo, self.hi, world)
        self._tiles: dict[tuple[int, int], BlockTiles] = {}

    def tiles(self, i: int, j: int) -> BlockTiles:
        if (i, j) not in self._tiles:
            n = self.n
            rows = slice(i * n, (i + 1) * n)
            lo_l, hi_l = local_key_range(self.lo[:, rows], self.hi[:, rows], j * n, n)
            self._tiles[(i, j)] = BlockTiles(lo_l, hi_l, self.cost.tile_m, self.cost.tile_n)
        return self._tiles[(i, j)]

    def pairs(self, i: int, j: int, start: int, stop: int) -> int:
        pre = self.prefix[i][j]
        return int(pre[stop] - pre[start])

    def trim(self, i: int, j: int, start: int, stop: int) -> tuple[int, int]:
        return self.tiles(i, j).seen_rows(start, stop)

    def span_cost(self, i: int, j: int, start: int, stop: int, trim: bool = True,
                  helper: bool = False) -> float:
        """Modeled cost of rows ``[start, stop)`` of block ``(i, j)`` as one task (``trim``: of its rows
        that see a key; a task with no visible pair costs nothing: it is never scheduled), to the rank
        computing it (``helper``: not rank ``i``)."""
        first, last = self.trim(i, j, start, stop)
        if last <= first:
            return 0.0
        if trim:
            start, stop = first, last
        visited, masked = self.tiles(i, j).tile_counts(start, stop)
        return self.cost.task_cost(visited, stop - start, masked, helper)

    def owner_cost(self, i: int, j: int, start: int, stop: int) -> float:
        """What merging rows ``[start, stop)`` of block ``(i, j)``, computed elsewhere, costs their owner."""
        first, last = self.trim(i, j, start, stop)
        return self.cost.owner_row * max(0, last - first)

    def piece_cost(self, p: _Piece, rank: int) -> float:
        """Cost of piece ``p`` to ``rank``, which computes it."""
        return self.span_cost(p.q_owner, p.kv_owner, p.row_start, p.row_stop, helper=rank != p.q_owner)

    def loads(self, pieces: list[list[_Piece]]) -> list[float]:
        """Every rank's modeled cost: the tasks its pieces make (adjacent ones of a block merged), and
        merging its rows computed elsewhere."""
        loads = [0.0] * len(pieces)
        for rank, own in enumerate(pieces):
            for i, j, a, b in _merged_runs(self, own):
                loads[rank] += self.span_cost(i, j, a, b, helper=rank != i)
                if i != rank:
                    loads[i] += self.owner_cost(i, j, a, b)
        return loads


def _best_split(blocks: _Blocks, piece: _Piece, over: int, under: int,
                loads: list[float]) -> tuple[float, int]:
    """The split row ``s`` of ``piece`` (computed by ``over``; rows ``[s, stop)`` move to ``under``)
    minimizing the larger of the two ranks' new costs (merges into an owner among them counted); returns
    (that maximum, s)."""
    i, j, a, b = piece.q_owner, piece.kv_owner, piece.row_start, piece.row_stop
    over_rest = loads[over] - blocks.piece_cost(piece, over)
    under_rest = loads[under] - (blocks.owner_cost(i, j, a, b) if i == under else 0.0)  # under merged it all

    def sides(s: int) -> tuple[float, float]:
        head = over_rest + blocks.span_cost(i, j, a, s, helper=i != over)
        tail = under_rest + blocks.span_cost(i, j, s, b, helper=i != under)
        if i == over:
            head += blocks.owner_cost(i, j, s, b)  # over now merges the tail computed by under
        elif i == under:
            tail += blocks.owner_cost(i, j, a, s)  # under still merges the head computed by over
        return head, tail

    def outcome(s: int) -> float:
        return max(sides(s))

    # head cost grows with s, tail cost shrinks (up to tile alignment): bisect the crossing, then look around
    left, right = a, b
    while right - left > 1:
        mid = (left + right) // 2
        head, tail = sides(mid)
        if head < tail:
            left = mid
        else:
            right = mid
    candidates = {a, b, left, right, *range(max(a, left - 2), min(b, right + 2) + 1)}
    m = blocks.cost.tile_m
    for base in (left, right):  # tile-aligned neighbours of the crossing (fewer partial tiles)
        aligned = a + ((base - a) // m) * m
        candidates.update(x for x in (aligned, aligned + m) if a <= x <= b)
    best = min(candidates, key=lambda s: (outcome(s), -s))
    return outcome(best), best


@lru_cache(maxsize=128)
def _segment_schedule(world: int, segments: Segments, causal: bool, window: int | None, tolerance: float,
                      cost: TileCost) -> Schedule:
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}.")
    if segments.length % world:
        raise ValueError(
            f"the sequence of {segments.length} tokens does not split into {world} equal shards; pad it "
            "to a multiple of the group size (lightseq_hf.pad_to_multiple)."
        )
    blocks = _Blocks(segments, world, causal, window, cost)
    n = blocks.n
    owned: list[list[_Piece]] = [[] for _ in range(world)]
    for i in range(world):
        for j in range(world):
            if blocks.work[i][j] > 0:
                owned[i].append(_Piece(i, j, *blocks.trim(i, j, 0, n)))
    pieces = _balance(blocks, _copy(owned), tolerance)
    if cost != PAIRS:
        # the greedy moves only tails to the idlest rank; also refine the pair-balanced split, keep the better
        pair_blocks = _Blocks(segments, world, causal, window, PAIRS, like=blocks)
        paired = _balance(pair_blocks, _copy(owned), tolerance)
        for other in (_balance(blocks, _copy(paired), tolerance), paired):
            if _max_load(blocks, other) < _max_load(blocks, pieces) - 1e-9:
                pieces = other

    per_rank: list[list[SpanTask | None]] = []
    for rank in range(world):
        tasks = [SpanTask(i, j, a, b, blocks.pairs(i, j, a, b), i == j, *blocks.tiles(i, j).key_span(a, b))
                 for i, j, a, b in _merged_runs(blocks, pieces[rank])]
        local = [t for t in tasks if t.q_owner == t.kv_owner == rank]
        if len(local) > 1:
            raise AssertionError("a rank's own diagonal block must stay one task")
        remote = sorted((t for t in tasks if t not in local), key=lambda t: (
            -blocks.span_cost(t.q_owner, t.kv_owner, t.row_start, t.row_stop), t.q_owner, t.kv_owner,
            t.row_start))
        per_rank.append([*local, *remote] if local else [None, *remote])
    num_steps = max(1, *(len(t) for t in per_rank))
    steps = tuple(
        tuple(per_rank[r][t] if t < len(per_rank[r]) else None for r in range(world))
        for t in range(num_steps)
    )
    return Schedule(world, causal, "segments", steps)


def _copy(pieces: list[list[_Piece]]) -> list[list[_Piece]]:
    return [[_Piece(p.q_owner, p.kv_owner, p.row_start, p.row_stop) for p in rank] for rank in pieces]


def _max_load(blocks: _Blocks, pieces: list[list[_Piece]]) -> float:
    return max(blocks.loads(pieces))


def _balance(blocks: _Blocks, pieces: list[list[_Piece]], tolerance: float) -> list[list[_Piece]]:
    """Greedy: while the busiest rank is above ``tolerance`` over the mean, move the tail rows of one of
    its pieces to the idlest rank at the split minimizing the larger of the two, if that lowers it."""
    world = len(pieces)
    loads = blocks.loads(pieces)
    for _ in range(8 * world * world + 8):
        over = max(range(world), key=lambda r: (loads[r], -r))
        under = min(range(world), key=lambda r: (loads[r], r))
        if loads[over] <= sum(loads) / world * (1 + tolerance):
            break
        best = None
        for piece in pieces[over]:
            if piece.q_owner == piece.kv_owner == under:
                continue  # the idle rank's own diagonal block must stay one (local) task
            own = blocks.piece_cost(piece, over)
            new_max, split = _best_split(blocks, piece, over, under, loads)
            key = (new_max, piece.kv_owner != under, -own, piece.q_owner, piece.kv_owner, piece.row_start)
            if split < piece.row_stop and (best is None or key < best[0]):
                best = (key, piece, split)
        if best is None or best[0][0] >= loads[over] - 1e-9:
            break  # no move lowers the busiest rank
        _, piece, split = best
        i, j = piece.q_owner, piece.kv_owner
        tail = _Piece(i, j, *blocks.trim(i, j, split, piece.row_stop))
        piece.row_start, piece.row_stop = blocks.trim(i, j, piece.row_start, split)
        if piece.row_stop <= piece.row_start:
            pieces[over].remove(piece)
        pieces[under].append(tail)
        loads = blocks.loads(pieces)
    return pieces


def _merged_runs(blocks: _Blocks, pieces: list[_Piece]) -> list[tuple[int, int, int, int]]:
    """One rank's pieces as tasks: adjacent pieces of one block merged, each trimmed, none empty."""
    merged: dict[tuple[int, int], list[_Piece]] = {}
    for p in pieces:
        merged.setdefault((p.q_owner, p.kv_owner), []).append(p)
    runs = []
    for (i, j), group in merged.items():
        group.sort(key=lambda p: p.row_start)
        spans = [[group[0].row_start, group[0].row_stop]]
        for p in group[1:]:
            if blocks.pairs(i, j, spans[-1][1], p.row_start) == 0:  # only unseen rows between: one task
                spans[-1][1] = p.row_stop
            else:
                spans.append([p.row_start, p.row_stop])
        for a, b in spans:
            a, b = blocks.trim(i, j, a, b)
            if b > a:
                runs.append((i, j, a, b))
    return runs


def modeled_loads(schedule: Schedule, segments: Segments, causal: bool = True, window: int | None = None,
                  cost: TileCost = DEFAULT_COST) -> list[float]:
    """Each rank's modeled cost of ``schedule`` (built from the same ``segments``) under ``cost``: its tasks
    as given (also schedules whose tasks were not trimmed to the rows that see keys)."""
    blocks = _Blocks(segments, schedule.world, causal, window, cost)
    loads = [0.0] * schedule.world
    for step in schedule.steps:
        for rank, task in enumerate(step):
            if task is not None:
                i, j, a, b = task.q_owner, task.kv_owner, task.row_start, task.row_stop
                loads[rank] += blocks.span_cost(i, j, a, b, trim=False, helper=i != rank)
                if i != rank:
                    loads[i] += blocks.owner_cost(i, j, a, b)
    return loads


def segment_blocks(world: int, segments: Segments, causal: bool, window: int | None) -> dict[
        tuple[int, int], int]:
    """Every (query chunk, key chunk) block with visible pairs, and how many (for tests and tables)."""
    lo, hi = key_ranges(segments, causal=causal, window=window)
    work, _ = block_work(lo, hi, world)
    return {(i, j): work[i][j] for i in range(world) for j in range(world) if work[i][j] > 0}
