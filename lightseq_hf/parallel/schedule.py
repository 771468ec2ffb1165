"""The attention schedule: a pure function of (world size, causal, kind), or of the document
boundaries for packed rows (:func:`~lightseq_hf.parallel.segment_schedule.build_segment_schedule`, which
builds on :class:`SpanTask` and :func:`block_work` here).

Rank ``r`` of ``P`` holds the contiguous chunk ``r`` of queries, keys and values. A
*task* is one (query chunk, key/value chunk) block, or a slice of its query rows,
computed by one rank at one step. Cost units: a full block is 1, a causal diagonal
block 1/2, a row slice its fraction of that.

Kinds (causal):
- ``"ring"``: the paper's Algorithm 1. At step ``t`` rank ``p >= t`` computes
  ``(q_p, kv_{p-t})``; the others idle. Critical path ``P - 1/2``.
- ``"paper"``: Algorithm 2 with whole blocks. Step ``t <= P/2``: rank ``p >= t`` does
  its own block at distance ``t``; rank ``p < t`` helps, computing ``(q_{p-t+P}, kv_p)``
  (distance ``P - t``) and returning the partial result. For even ``P`` the last step
  has nobody to help: critical path ``(P + 1) / 2``.
- ``"balanced"`` (ours): as ``"paper"``, but for even ``P`` the last step's blocks
  ``(q_i, kv_{i-P/2})`` are split by query rows between the query owner ``i`` and the
  (otherwise idle) key owner ``i - P/2``, which already holds the keys and needs only
  half the query rows. Critical path ``P / 2`` for every ``P``: the ideal.
- ``"pipelined"``: ``"balanced"`` with its last step run as two half-size steps
  (:func:`_pipeline_last_step`), so the results of the first half travel while the second
  half computes and only a half-size transfer is left after the last compute.

Non-causal attention is a plain ring for every kind: ``P`` steps of full blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cache

import torch

from .._values import is_positive_int
from .segments import visible_pairs

__all__ = [
    "BackwardWork", "SCHEDULES", "Schedule", "SpanTask", "Task", "backward_work", "block_work",
    "build_schedule", "required_blocks",
]

SCHEDULES = ("balanced", "paper", "ring", "pipelined")


@dataclass(frozen=True)
class Task:
    """Attention of query chunk ``q_owner`` (rows slice ``part`` of ``parts``) on chunk ``kv_owner`` (keys
    slice ``key_part`` of ``key_parts``)."""

    q_owner: int
    kv_owner: int
    diagonal: bool = False
    part: int = 0
    parts: int = 1
    key_part: int = 0
    key_parts: int = 1

    @property
    def cost(self) -> Fraction:
        return Fraction(1, 2 if self.diagonal else 1) / (self.parts * self.key_parts)

    def rows(self, length: int) -> tuple[int, int]:
        """The query rows ``[start, stop)`` of a chunk of ``length`` rows this task covers."""
        return _slice(length, self.part, self.parts)

    def keys(self, length: int) -> tuple[int, int]:
        """The keys ``[start, stop)`` of a chunk of ``length`` keys this task reads."""
        return _slice(length, self.key_part, self.key_parts)


def _slice(length: int, part: int, parts: int) -> tuple[int, int]:
    return length * part // parts, length * (part + 1) // parts


@dataclass(frozen=True)
class Schedule:
    """``steps[t][rank]`` is the task ``rank`` computes at step ``t`` (``None``: idle).

    Segment schedules (kind ``"segments"``) hold :class:`SpanTask` and count cost in visible pairs.
    """

    world: int
    causal: bool
    kind: str
    steps: tuple[tuple[Task | SpanTask | None, ...], ...]

    def load(self, rank: int) -> Fraction | int:
        """Total cost computed by ``rank``."""
        return sum((s[rank].cost for s in self.steps if s[rank] is not None), Fraction(0))

    def critical_path(self) -> Fraction | int:
        """Cost of the slowest rank summed over steps (steps run in lock-step)."""
        slowest = (max((t.cost for t in step if t is not None), default=Fraction(0)) for step in self.steps)
        return sum(slowest, Fraction(0))


@cache
def build_schedule(world: int, causal: bool = True, kind: str = "balanced") -> Schedule:
    """The schedule for ``world`` ranks (``world >= 1``)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}.")
    if not is_positive_int(world):
        raise ValueError(f"world size must be an int >= 1, got {world!r}.")
    if kind == "pipelined":
        return _pipeline_last_step(build_schedule(world, causal, "balanced"), 2, kind)
    if not causal:
        steps = [tuple(Task(p, (p - t) % world) for p in range(world)) for t in range(world)]
        return Schedule(world, False, kind, tuple(steps))
    steps = [tuple(Task(p, p, diagonal=True) for p in range(world))]
    if kind == "ring":
        for t in range(1, world):
            steps.append(tuple(Task(p, p - t) if p >= t else None for p in range(world)))
        return Schedule(world, True, kind, tuple(steps))
    half = world // 2
    for t in range(1, half + 1):
        last_even = world % 2 == 0 and t == half
        step: list[Task | None] = []
        for p in range(world):
            if last_even:
                if kind == "paper":
                    step.append(Task(p, p - t) if p >= t else None)
                elif p >= t:
                    step.append(Task(p, p - t, part=0, parts=2))
                else:
                    step.append(Task(p + t, p, part=1, parts=2))
            elif p >= t:
                step.append(Task(p, p - t))
            else:
                step.append(Task(p - t + world, p))
        steps.append(tuple(step))
    return Schedule(world, True, kind, tuple(steps))


def _pipeline_last_step(schedule: Schedule, pieces: int, kind: str | None = None) -> Schedule:
    """``schedule`` with its last step run as ``pieces`` steps of ``1 / pieces`` the work each.

    After the last compute only the last piece's results are left to travel: a task on another rank's
    query rows (whose output, lse and dq return to their owner) is cut by query rows; a task on this
    rank's own rows (whose dk/dv return to the key owner in backward) is cut by keys, so no partial is
    sent twice. Every pair is still computed exactly once, and each rank's load is unchanged.
    """
    if len(schedule.steps) < 2 or pieces == 1:
        return replace(schedule, kind=kind or schedule.kind)
    last = schedule.steps[-1]
    if any(t is not None and t.diagonal for t in last):
        raise ValueError("the last step of a schedule with communication holds no diagonal block")

    def piece(rank: int, task: Task | None, i: int) -> Task | None:
        if task is None:
            return None
        if task.q_owner == rank:
            return replace(task, key_part=task.key_part * pieces + i, key_parts=task.key_parts * pieces)
        return replace(task, part=task.part * pieces + i, parts=task.parts * pieces)

    tail = tuple(tuple(piece(r, t, i) for r, t in enumerate(last)) for i in range(pieces))
    return replace(schedule, kind=kind or schedule.kind, steps=schedule.steps[:-1] + tail)


@dataclass(frozen=True)
class BackwardWork:
    """One rank's share of the backward of a causal :func:`build_schedule` (block units as ``cost``).

    The backward runs the forward's tasks (whoever computed a block computes its gradient, with
    the global out/lse of its query rows, recomputing the block's probabilities inside the kernel):
    ``blocks`` is the same cost as the forward's. The gradients of a helped block travel to their
    owners and are added there in float32: ``dq_merged`` counts the query-chunk fractions and
    ``dkv_merged`` the key/value chunk fractions (each one dk and one dv) this rank receives and adds;
    ``dq_sent`` / ``dkv_sent`` what it computes for others. ``shapes``: per step, the kernel call
    ``(diagonal, query-row fraction)`` (``None``: idle).
    """

    blocks: Fraction
    dq_merged: Fraction
    dkv_merged: Fraction
    dq_sent: Fraction
    dkv_sent: Fraction
    shapes: tuple[tuple[bool, Fraction] | None, ...]


def backward_work(schedule: Schedule) -> list[BackwardWork]:
    """Per rank, the backward's kernel work and gradient traffic of ``schedule`` (pure)."""
    world = schedule.world
    blocks = [Fraction(0)] * world
    dq_merged, dq_sent = [Fraction(0)] * world, [Fraction(0)] * world
    dkv_merged, dkv_sent = [Fraction(0)] * world, [Fraction(0)] * world
    shapes: list[list] = [[] for _ in range(world)]
    for step in schedule.steps:
        for rank, task in enumerate(step):
            if task is None:
                shapes[rank].append(None)
                continue
            rows = Fraction(1, task.parts)
            blocks[rank] += task.cost
            shapes[rank].append((task.diagonal, rows))
            if task.q_owner != rank:
                dq_sent[rank] += rows
                dq_merged[task.q_owner] += rows
            if task.kv_owner != rank:
                keys = Fraction(1, task.key_parts)
                dkv_sent[rank] += keys
                dkv_merged[task.kv_owner] += keys
    return [BackwardWork(blocks[r], dq_merged[r], dkv_merged[r], dq_sent[r], dkv_sent[r], tuple(shapes[r]))
            for r in range(world)]


def required_blocks(world: int, causal: bool) -> set[tuple[int, int]]:
    """Every (query chunk, key chunk) pair attention needs."""
    return {(i, j) for i in range(world) for j in range(world) if not causal or j <= i}


# --- Packed documents, padding, sliding windows -------------------------------------------------------


@dataclass(frozen=True)
class SpanTask:
    """Query rows ``[row_start, row_stop)`` of chunk ``q_owner`` against chunk ``kv_owner``.

    ``work`` is the number of visible query-key pairs in it (summed over batch rows); the
    kernel takes the mask from the key ranges of the segments, not from ``diagonal``. The task reads
    only keys ``[key_start, key_stop)`` of the chunk (``None``: to its end): the ones its rows see, so
    only those travel, and only their gradients come back.
    """

    q_owner: int
    kv_owner: int
    row_start: int
    row_stop: int
    work: int
    diagonal: bool = False
    key_start: int = 0
    key_stop: int | None = None

    @property
    def cost(self) -> int:
        return self.work

    def rows(self, length: int) -> tuple[int, int]:
        return self.row_start, self.row_stop

    def keys(self, length: int) -> tuple[int, int]:
        return self.key_start, length if self.key_stop is None else self.key_stop


def block_work(
    lo: torch.Tensor, hi: torch.Tensor, world: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """``W[i][j]``: visible pairs of query chunk ``i`` against key chunk ``j``, and per block the
    prefix sums of that work over the chunk's query rows (length ``chunk + 1``)."""
    n = lo.shape[1] // world
    work, prefix = [], []
    for i in range(world):
        rows_lo, rows_hi = lo[:, i * n:(i + 1) * n], hi[:, i * n:(i + 1) * n]
        w_row, p_row = [], []
        for j in range(world):
            per_row = visible_pairs(rows_lo, rows_hi, j * n, (j + 1) * n).sum(0)
            p = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(per_row, 0, out=p[1:])
            w_row.append(int(p[-1]))
            p_row.append(p)
        work.append(w_row)
        prefix.append(p_row)
    return work, prefix
