"""The attention schedule: a pure function of (world size, causal, kind).

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

Non-causal attention is a plain ring for every kind: ``P`` steps of full blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cache

SCHEDULES = ("balanced", "paper", "ring")


@dataclass(frozen=True)
class Task:
    """Attention of query chunk ``q_owner`` (rows slice ``part`` of ``parts``) on chunk ``kv_owner``."""

    q_owner: int
    kv_owner: int
    diagonal: bool = False
    part: int = 0
    parts: int = 1

    @property
    def cost(self) -> Fraction:
        return Fraction(1, 2 if self.diagonal else 1) / self.parts

    def rows(self, length: int) -> tuple[int, int]:
        """The query rows ``[start, stop)`` of a chunk of ``length`` rows this task covers."""
        start = length * self.part // self.parts
        stop = length * (self.part + 1) // self.parts
        return start, stop


@dataclass(frozen=True)
class Schedule:
    """``steps[t][rank]`` is the task ``rank`` computes at step ``t`` (``None``: idle)."""

    world: int
    causal: bool
    kind: str
    steps: tuple[tuple[Task | None, ...], ...]

    def load(self, rank: int) -> Fraction:
        """Total cost computed by ``rank``."""
        return sum((s[rank].cost for s in self.steps if s[rank] is not None), Fraction(0))

    def critical_path(self) -> Fraction:
        """Cost of the slowest rank summed over steps (steps run in lock-step)."""
        slowest = (max((t.cost for t in step if t is not None), default=Fraction(0)) for step in self.steps)
        return sum(slowest, Fraction(0))


@cache
def build_schedule(world: int, causal: bool = True, kind: str = "balanced") -> Schedule:
    """The schedule for ``world`` ranks (``world >= 1``)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}.")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}.")
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


def required_blocks(world: int, causal: bool) -> set[tuple[int, int]]:
    """Every (query chunk, key chunk) pair attention needs."""
    return {(i, j) for i in range(world) for j in range(world) if not causal or j <= i}
