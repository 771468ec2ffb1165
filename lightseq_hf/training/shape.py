"""The run's shape: how many processes, how they split a sequence and the data, and the tokens that
follow for each rank and each optimizer step.

:func:`run_shape` builds the one :class:`RunShape` of a config launched on a number of processes, and
:func:`check_sizes` is where the sizes are checked to divide (the config's validation calls it before
the world size is known too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["RunShape", "check_sizes", "run_shape"]


@dataclass(frozen=True)
class RunShape:
    """``world_size`` processes: ``dp_size`` data-parallel groups of ``sp_size`` ranks, each group taking
    ``batch_size`` sequences of ``context_length`` tokens per micro-step, ``grad_accum`` micro-steps per
    optimizer step."""

    context_length: int
    sp_size: int
    dp_size: int
    world_size: int
    batch_size: int = 1
    grad_accum: int = 1

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one sequence each rank of a sequence-parallel group holds."""
        return self.context_length // self.sp_size

    @property
    def sequences_per_step(self) -> int:
        """Sequences one optimizer step trains on, every data-parallel group together."""
        return self.batch_size * self.grad_accum * self.dp_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, every data-parallel group together."""
        return self.sequences_per_step * self.context_length

    def describe(self) -> str:
        """``world W = D data-parallel x S sequence-parallel``."""
        return f"world {self.world_size} = {self.dp_size} data-parallel x {self.sp_size} sequence-parallel"


def check_sizes(context_length: int, sp_size: int | None, world_size: int | None) -> None:
    """ConfigError unless ``sp_size`` divides ``world_size`` and ``context_length`` (either unknown: None;
    ``sp_size`` None means every process)."""
    sp = sp_size or world_size
    if world_size is not None and world_size % sp:
        raise ConfigError(
            f"sp_size {sp} does not divide the world size {world_size} (launched processes); choose "
            f"one of {', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)}"
        )
    if sp is not None and context_length % sp:
        raise ConfigError(
            f"context_length {context_length} is not divisible by sp_size {sp}: every rank "
            f"of a sequence-parallel group holds context_length / sp_size tokens"
        )


def run_shape(cfg: Any, world_size: int) -> RunShape:
    """The shape of a run of ``cfg`` (a :class:`~.config.FinetuneConfig`) on ``world_size`` processes;
    ConfigError when its sizes do not divide (:func:`check_sizes`)."""
    check_sizes(cfg.context_length, cfg.sp_size, world_size)
    sp = cfg.sp_size or world_size
    t = cfg.training
    return RunShape(cfg.context_length, sp, world_size // sp, world_size, t.batch_size, t.grad_accum)
