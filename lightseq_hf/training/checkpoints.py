"""A run's checkpoints through accelerate: the progress counters, saving ``checkpoint-<step>/``, loading
one back, and a resumed run whose step count differs from the checkpoint's (the crash-safe directory
handling itself is in :mod:`.saving`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from .build import lr_lambda
from .errors import ConfigError
from .log import logger
from .saving import CheckpointError, publish, temporary_path, write_completion_record

__all__ = ["TrainState", "check_same_data", "check_schedule", "load_resume_state", "reconcile_schedule",
           "save_checkpoint", "write_training_state"]


class TrainState:
    """Progress counters, saved with the checkpoint (accelerate ``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0
        self.samples_in_epoch = 0  # samples of the current epoch's order consumed, all data-parallel groups
        self.tokens = 0  # tokens trained on, all data-parallel groups together
        self.schedule_steps: int | None = None  # the step count the learning-rate schedule spans
        self.skipped_steps = 0  # steps whose update was skipped (non-finite, training.on_nonfinite=skip)
        self.data_fingerprint: str | None = None  # of the training data (data.data_fingerprint)
        self.layout: dict | None = None  # the DataLayout that consumed the epoch (layout.DataLayout)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def write_training_state(accelerator: Any, directory: Path) -> None:
    """Every rank's share of what resuming needs (accelerate ``save_state``) under ``directory``."""
    accelerator.save_state(str(directory))


def _write_failed(e: BaseException) -> bool:
    """Whether ``e`` is a file that could not be written: the system's error, safetensors' or torch's
    serializer's (a full disk reads "unexpected pos" there)."""
    if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
        return True
    return isinstance(e, RuntimeError) and any(
        w in str(e) for w in ("inline_container", "PytorchStreamWriter", "file write failed"))


def save_checkpoint(accelerator: Any, model: torch.nn.Module, tokenizer: Any, saving: Any,
                    state: TrainState, out_dir: Path) -> Path:
    """``checkpoint-<step>/``: save_pretrained model (+ tokenizer) and, under ``state/``, everything
    needed to resume (weights, optimizer, scheduler, counters, RNG states of every rank), as the
    ``saving.*`` settings say (``save_optimizer``, ``checksums``).

    Written under ``.checkpoint-<step>.tmp``; once every rank has finished, the main process
    records every file (size, sha256) in ``checkpoint_complete.json`` and renames the directory,
    so a crash at any point leaves either no ``checkpoint-<step>`` or a complete one. A file that cannot
    be written (a full disk) is a CheckpointError in one line naming the directory, its free space and
    the fix."""
    try:
        return _save_checkpoint(accelerator, model, tokenizer, saving, state, out_dir)
    except Exception as e:
        if not _write_failed(e):
            raise
        tmp = temporary_path(out_dir, state.step)
        try:
            free = f"{shutil.disk_usage(tmp if tmp.exists() else out_dir).free / 2**30:.1f} GiB free there"
        except OSError:
            free = "its free space unknown"
        reason = " ".join(str(e).split())[:200]
        raise CheckpointError(
            f"writing checkpoint-{state.step} in {out_dir} failed ({type(e).__name__}: {reason}; {free}); "
            "the checkpoints saved before are intact. Free space there, or save less (saving.every, "
            "saving.save_optimizer=false), then resume with saving.resume_from=latest") from e


def _save_checkpoint(accelerator: Any, model: torch.nn.Module, tokenizer: Any, saving: Any,
                     state: TrainState, out_dir: Path) -> Path:
    step = state.step
    final, tmp = out_dir / f"checkpoint-{step}", temporary_path(out_dir, step)
    if accelerator.is_main_process:
        if tmp.exists():  # left by a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
    del state_dict
    if saving.save_optimizer:
        write_training_state(accelerator, tmp / "state")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_completion_record(tmp, step, {"epoch": state.epoch, "samples_in_epoch": state.samples_in_epoch,
                                            "tokens": state.tokens, "world_size": accelerator.num_processes,
                                            "layout": state.layout, "schedule_steps": state.schedule_steps,
                                            "data_fingerprint": state.data_fingerprint}, saving.checksums)
        aside = publish(tmp, final)
        if aside is not None:
            logger.warning(f"{final.name} already existed (left by another run); moved to {aside.name}")
    accelerator.wait_for_everyone()
    return final


def load_resume_state(accelerator: Any, resume: Path) -> None:
    """Load ``resume/state`` into the prepared model, optimizer, scheduler and counters."""
    try:
        accelerator.load_state(str(resume / "state"))
    except Exception as e:  # a file the completion record could not vouch for (checksums off, old version)
        raise CheckpointError(f"{resume}: loading the training state failed ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e


def check_same_data(saved: str | None, fingerprint: str, resume: Path) -> None:
    """ConfigError when the training data changed since ``resume`` was saved (``saved``: its data
    fingerprint, None for a checkpoint without one): the resumed sampler would continue its position in
    other samples."""
    if saved is not None and saved != fingerprint:
        raise ConfigError(
            f"the training data changed since {resume} was saved (data fingerprint {saved} then, "
            f"{fingerprint} now: the contents of data.paths or the data settings differ), so resuming would "
            "not continue where it stopped. Restore that data, or start a new run from the checkpoint's "
            f"weights with model.path={resume}")


def check_schedule(training: Any, saving: Any, saved: int | None, total_steps: int, step: int, resume: Path,
                   why: str = "") -> bool:
    """Whether the resumed schedule (``saved`` steps, None: unknown) differs from this run's; ConfigError
    when it does and ``saving.on_schedule_change`` is ``error`` (``why``: the cause, when known).
    ``training``, ``saving``: the config's sections."""
    if saved is None or saved == total_steps:
        return False
    if saving.on_schedule_change == "error":
        old_lr = training.lr * lr_lambda(training, saved)(step)
        new_lr = training.lr * lr_lambda(training, total_steps)(step)
        raise ConfigError(
            f"saving.on_schedule_change: {resume} was trained with a learning-rate schedule of {saved} "
            f"steps, this run has {total_steps}{why}; resuming would move the learning rate at step {step} "
            f"from {old_lr:.3g} to {new_lr:.3g}. Set saving.on_schedule_change=keep (finish the old "
            "schedule, then hold its final rate) or =rebuild (stretch the schedule to the new length)"
        )
    return True


def reconcile_schedule(training: Any, saving: Any, state: TrainState, total_steps: int, scheduler: Any,
                       resume: Path, why: str = "") -> None:
    """A resumed run whose step count differs from the checkpoint's: error, or the choice of
    ``saving.on_schedule_change`` (``training``, ``saving``: the config's sections)."""
    saved = state.schedule_steps
    if not check_schedule(training, saving, saved, total_steps, state.step, resume, why):
        state.schedule_steps = total_steps
        return
    choice = saving.on_schedule_change
    old_lr = training.lr * lr_lambda(training, saved)(state.step)
    new_lr = training.lr * lr_lambda(training, total_steps)(state.step)
    if choice == "rebuild":
        state.schedule_steps = total_steps
        logger.info(f"saving.on_schedule_change=rebuild: schedule of {saved} steps rebuilt for "
                    f"{total_steps}; learning rate at step {state.step}: {old_lr:.3g} -> {new_lr:.3g}")
    else:
        logger.info(f"saving.on_schedule_change=keep: the {saved}-step schedule continues (learning rate at "
                    f"step {state.step}: {old_lr:.3g}) for {total_steps} steps")
    scheduler.lr_lambdas = [lr_lambda(training, state.schedule_steps)] * len(scheduler.lr_lambdas)
