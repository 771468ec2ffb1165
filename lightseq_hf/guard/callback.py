"""``ParityCallback``: the parity check at the start of a Hugging Face ``Trainer`` (or TRL) run."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .gradients import sync_gradients
from .parity import ParityError, check_parity, summary
from .verdict import passed_line

__all__ = ["ParityCallback"]


def _first_batch(dataloader: Any) -> dict[str, Any]:
    """The loader's collated first ``batch_size`` samples of its dataset, read without iterating the loader
    (its sampler and epoch state stay untouched); the same on every rank."""
    dataset = getattr(dataloader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ValueError("ParityCallback needs a map-style training dataset (with __len__ and __getitem__).")
    size = getattr(dataloader, "batch_size", None) or getattr(
        getattr(dataloader, "batch_sampler", None), "batch_size", None) or 1
    return dataloader.collate_fn([dataset[i] for i in range(min(size, len(dataset)))])


def _trainer_gradient_sync(args: Any, model: torch.nn.Module):
    """How the Trainer will average this model's gradients, as ``check_parity``'s ``sync``.

    The callback gets the unwrapped model: under DDP (the Trainer's choice with several processes) its
    backward alone leaves each rank's share, so DDP's average over all ranks is applied with
    :func:`sync_gradients`. FSDP shards the model in place and averages in its own backward.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if getattr(args, "deepspeed", None):
        raise ValueError("ParityCallback does not support DeepSpeed, which keeps gradients in its own "
                         "buffers; remove the callback or run lightseq_hf.check_parity without DeepSpeed.")
    if getattr(args, "fsdp", None) or any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return None
    return sync_gradients


class ParityCallback(TrainerCallback):
    """Run :func:`lightseq_hf.check_parity` on the first batch when training begins.

    ``Trainer(..., callbacks=[lightseq_hf.ParityCallback()])``. On failure every rank stops: rank 0
    prints the check's one-line message and the processes exit with status 1 (``on_failure="raise"``
    raises :class:`~lightseq_hf.ParityError` instead). A pass is printed in one line by rank 0. The report
    is kept in ``.report`` and appended to ``state.log_history`` (``trainer_state.json``) as ``parity_*``
    entries.
    """

    def __init__(self, *, max_tokens: int | None = None, rtol: float | None = None,
                 on_failure: str = "exit") -> None:
        if on_failure not in ("exit", "raise"):
            raise ValueError(f"on_failure={on_failure!r}: choose 'exit' or 'raise'.")
        self.max_tokens, self.rtol, self.on_failure = max_tokens, rtol, on_failure
        self.report: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        try:
            self.report = check_parity(model, _first_batch(train_dataloader), max_tokens=self.max_tokens,
                                       rtol=self.rtol, sync=_trainer_gradient_sync(args, model))
        except ParityError as err:
            self.report = err.report
            if self.on_failure == "raise":
                raise
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(str(err), file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if self.report.get("passed") and (not dist.is_initialized() or dist.get_rank() == 0):
            print(passed_line(self.report), flush=True)  # once, whatever the logging setup
        state.log_history.append({"step": state.global_step, **summary(self.report)})
        return control

