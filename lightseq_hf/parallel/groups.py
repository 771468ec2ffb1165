"""Sequence-parallel and data-parallel process groups.

The world of ``W`` ranks is cut into ``W / sp_size`` sequence-parallel groups of
consecutive ranks (``[0, sp)``, ``[sp, 2 sp)``, ...): consecutive ranks share a node
first, so attention traffic stays on NVLink. Ranks with the same position in their
sequence-parallel group form a data-parallel group.

A launcher (torchrun, ``accelerate launch``, ``lightseq-finetune --nproc``) tells each process how many it
started in ``WORLD_SIZE``; this module reads it (:func:`launched_world_size`) so that a launch whose
processes never joined a process group is refused instead of running whole sequences on every process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from .._values import is_positive_int

__all__ = [
    "ParallelGroups", "check_launched", "current_groups", "init_sequence_parallel", "launched_world_size",
    "process_rank", "release_groups",
]


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups and coordinates."""

    sp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int


_current: ParallelGroups | None = None


def launched_world_size() -> int:
    """How many processes the launcher started (its ``WORLD_SIZE``; 1 without a launcher)."""
    value = os.environ.get("WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() else 1


def process_rank() -> int:
    """This process's global rank: the process group's, else the launcher's ``RANK`` (0 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK", "").strip()
    return int(value) if value.isdigit() else 0


def check_launched(what: str) -> None:
    """RuntimeError when a launcher started several processes but torch.distributed has no process group:
    ``what`` would then run whole sequences on every process, nothing split."""
    if dist.is_available() and dist.is_initialized():
        return
    world = launched_world_size()
    if world > 1:
        raise RuntimeError(
            f"{what}: WORLD_SIZE={world} says a launcher started {world} processes, but torch.distributed "
            "has no process group, so every process would run whole sequences alone; call "
            "torch.distributed.init_process_group() first on every process (then "
            "lightseq_hf.init_sequence_parallel(sp_size) for groups smaller than the world), or unset "
            "WORLD_SIZE if no launcher started this process.")


def init_sequence_parallel(sp_size: int | None = None,
                           timeout: datetime.timedelta | float | None = None) -> ParallelGroups:
    """Create (once) the groups for ``sp_size`` ranks per sequence (default: the whole world).

    Every rank must call it with the same ``sp_size``. Without torch.distributed the
    result is a single rank with no groups. ``timeout`` (a timedelta or seconds) bounds every wait
    of the new groups: a peer that stops answering ends the call with an error after it (default:
    the default group's timeout).
    """
    if isinstance(timeout, (int, float)):
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout}")
        timeout = datetime.timedelta(seconds=timeout)
    global _current
    if sp_size is not None and not is_positive_int(sp_size):
        raise ValueError(f"sp_size must be a positive int (ranks per sequence) or None (every rank); "
                         f"got {sp_size!r}.")
    if not (dist.is_available() and dist.is_initialized()):
        check_launched("lightseq_hf.init_sequence_parallel")
        if sp_size not in (None, 1):
            raise ValueError(
                f"sp_size={sp_size} needs torch.distributed: launch with `accelerate launch` or "
                "torchrun (or call torch.distributed.init_process_group first), or use sp_size=1."
            )
        _current = ParallelGroups(None, None, 1, 0, 1, 0)
        return _current
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_size = world if sp_size is None else sp_size
    if sp_size < 1 or world % sp_size != 0:
        raise ValueError(
            f"sequence-parallel size {sp_size} does not divide the world size {world}; choose an "
            f"sp_size among the divisors of {world} ({', '.join(str(d) for d in _divisors(world))})."
        )
    if _current is not None and _current.sp_size == sp_size and _current.sp_group is not None:
        return _current
    dp_size = world // sp_size
    sp_group = dp_group = None
    for start in range(0, world, sp_size):  # new_group is collective: every rank creates every group
        ranks = list(range(start, start + sp_size))
        group = dist.new_group(ranks, timeout=timeout) if sp_size < world else dist.group.WORLD
        if rank in ranks:
            sp_group = group
    for offset in range(sp_size):
        ranks = list(range(offset, world, sp_size))
        group = dist.new_group(ranks, timeout=timeout) if dp_size < world else dist.group.WORLD
        if rank in ranks:
            dp_group = group
    _current = ParallelGroups(sp_group, dp_group, sp_size, rank % sp_size, dp_size, rank // sp_size)
    return _current


def current_groups() -> ParallelGroups | None:
    """The groups made by the last :func:`init_sequence_parallel`, if any."""
    return _current


def release_groups() -> int:
    """Forget the groups of :func:`init_sequence_parallel` (at exit: see ``teardown``); how many were
    held."""
    global _current
    held = 0 if _current is None else sum(g is not None for g in (_current.sp_group, _current.dp_group))
    _current = None
    return held


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
