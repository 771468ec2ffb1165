"""How a run lays its data out over its processes, recorded with every checkpoint so that a resume under
another launch continues from the same sample.

An epoch is one order of the samples (:class:`~.data.ParallelSampler`: shuffled with ``training.seed +
epoch``); the data-parallel groups take it in turns, one sample each, so after any number of steps the
groups together have consumed a prefix of that order. A checkpoint records the length of that prefix
(``samples_in_epoch``, all groups together) and the :class:`DataLayout` that consumed it. A resume with
another world size, ``sp_size``, ``batch_size`` or ``grad_accum`` continues the same order from the same
sample, and the step count of an epoch-bounded run is recomputed for the new layout. A resume whose data
order differs (another ``training.seed``) in the middle of an epoch is refused: the prefix it stopped at
would be another set of samples.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .shape import RunShape

__all__ = ["DataLayout", "ResumePlace", "check_resume_layout", "epoch_steps_left", "place_resume",
           "resumed_total_steps"]


@dataclass(frozen=True)
class DataLayout:
    """The processes and batches that consume an epoch, and the epoch's order (``order_seed``)."""

    world_size: int
    sp_size: int
    dp_size: int
    batch_size: int
    grad_accum: int
    order_seed: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataLayout:
        return cls(**{k: int(data[k]) for k in cls.__dataclass_fields__})

    @classmethod
    def of(cls, run: RunShape, order_seed: int) -> DataLayout:
        """The layout of a run in the shape ``run`` whose epochs are ordered by ``order_seed``."""
        return cls(run.world_size, run.sp_size, run.dp_size, run.batch_size, run.grad_accum, order_seed)

    @property
    def samples_per_step(self) -> int:
        return self.dp_size * self.batch_size * self.grad_accum

    def describe(self) -> str:
        return (f"world {self.world_size} = {self.dp_size} data-parallel x {self.sp_size} sequence-parallel, "
                f"{self.samples_per_step} samples a step (batch_size {self.batch_size} x grad_accum "
                f"{self.grad_accum} x {self.dp_size}), data order of training.seed={self.order_seed}")


def epoch_steps_left(num_samples: int, position: int, layout: DataLayout) -> int:
    """Optimizer steps ``layout`` needs for the rest of an epoch of ``num_samples`` whose first
    ``position`` samples (all data-parallel groups together) are consumed."""
    per_group = math.ceil(max(num_samples - position, 0) / layout.dp_size)
    return math.ceil(math.ceil(per_group / layout.batch_size) / layout.grad_accum)


def resumed_total_steps(epochs: int, num_samples: int, step: int, epoch: int, position: int,
                        layout: DataLayout) -> int:
    """The step count of an epoch-bounded run (``training.max_steps`` unset) resumed at ``step``, sample
    ``position`` of epoch ``epoch``, under ``layout``: the steps done, the rest of this epoch and the
    epochs after it."""
    if epoch >= epochs:
        return step
    return (step + epoch_steps_left(num_samples, position, layout)
            + (epochs - epoch - 1) * epoch_steps_left(num_samples, 0, layout))


def check_resume_layout(saved: dict[str, Any] | None, now: DataLayout, position: int, epoch: int,
                        resume: Path) -> str:
    """What a resume from ``resume`` (saved under ``saved``, None when it records none, stopped at
    sample ``position`` of epoch ``epoch``) does under ``now``, in words; ConfigError when the epoch's
    order changed mid-epoch (the consumed prefix would be other samples)."""
    where = f"the start of epoch {epoch}" if position == 0 else f"sample {position} of epoch {epoch}"
    if saved is None:
        return (f"continues at {where}" if position == 0 else
                f"{resume} records no data layout: its position in the epoch is taken as counted by this "
                f"run's ({now.describe()})")
    then = DataLayout.from_dict(saved)
    if then.order_seed != now.order_seed and position > 0:
        raise ConfigError(
            f"{resume} stopped at {where} in the order of training.seed={then.order_seed}; this run has "
            f"training.seed={now.order_seed}, which orders the epoch differently, so resuming would train "
            f"some samples twice and skip others. Resume with training.seed={then.order_seed}")
    if then == now:
        return f"continues at {where}"
    return f"continues at {where} under another layout: {then.describe()} then, {now.describe()} now"


@dataclass(frozen=True)
class ResumePlace:
    """Where a resumed run continues: ``note`` (one phrase for the log), ``changed`` (the layout differs
    from the checkpoint's: ``why`` says how, for a schedule refusal) and ``total_steps`` (the run's step
    count, recomputed for an epoch-bounded run)."""

    note: str
    changed: bool
    why: str
    total_steps: int


def place_resume(saved: dict[str, Any], now: DataLayout, num_samples: int, max_steps: int | None,
                 epochs: int, total_steps: int, resume: Path) -> ResumePlace:
    """:func:`check_resume_layout` and :func:`resumed_total_steps` for a checkpoint's completion record
    metadata ``saved`` (with its ``step``); ``total_steps``: the count of a fresh run."""
    position, epoch, layout = saved.get("samples_in_epoch", 0), saved.get("epoch", 0), saved.get("layout")
    note = check_resume_layout(layout, now, position, epoch, resume)
    changed = layout is not None and DataLayout.from_dict(layout) != now
    why = f" (its layout: {DataLayout.from_dict(layout).describe()}; this run's: {now.describe()})" \
        if changed else ""
    if max_steps is None and layout is not None:
        total_steps = resumed_total_steps(epochs, num_samples, saved["step"], epoch, position, now)
    return ResumePlace(note, changed, why, total_steps)
