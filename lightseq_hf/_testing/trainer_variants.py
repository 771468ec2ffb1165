"""The fine-tune's trainer with one behaviour changed, to measure what the library's choice saves
(``scripts/check_finetune_memory.py``). Private: not API. Each is a context manager that restores the
trainer when its block ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["keep_parameter_lists", "no_sync_until_last_micro_batch"]


@contextlib.contextmanager
def keep_parameter_lists() -> Iterator[list]:
    """Inside the block the trainer's optimizer is built as usual, but a list of the model's parameters from
    before ``prepare`` stays alive (what a trainer that builds AdamW's groups in its own frame does);
    yields that list."""
    from ..training import loop

    held: list = []
    original = loop.build_optimizer

    def build_and_keep(model: Any, cfg: Any, total_steps: int) -> Any:
        held.extend(model.parameters())
        return original(model, cfg, total_steps)

    loop.build_optimizer = build_and_keep
    try:
        yield held
    finally:
        loop.build_optimizer = original


@contextlib.contextmanager
def no_sync_until_last_micro_batch() -> Iterator[None]:
    """Inside the block gradient accumulation skips the gradient reduction (``no_sync``) on every
    micro-batch but the last, under FSDP too (the trainer reduces every micro-batch under FSDP)."""
    from ..training import loop

    original = loop.Trainer._gradient_sync

    def no_sync_until_last(self: Any, last: bool) -> Any:
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    loop.Trainer._gradient_sync = no_sync_until_last
    try:
        yield
    finally:
        loop.Trainer._gradient_sync = original
