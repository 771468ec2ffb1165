"""The key a user meant when the config names one the schema does not have."""

from __future__ import annotations

import difflib

__all__ = ["KEY_ALIASES", "meant_key"]

#: what Hugging Face's TrainingArguments (and common scripts) call keys of this schema
KEY_ALIASES = {"learning_rate": "lr", "gradient_accumulation_steps": "grad_accum",
               "per_device_train_batch_size": "batch_size", "num_train_epochs": "epochs",
               "lr_scheduler_type": "lr_schedule", "logging_steps": "every", "save_steps": "every",
               "resume_from_checkpoint": "resume_from", "gradient_checkpointing": "checkpointing",
               "max_seq_length": "context_length", "max_length": "context_length",
               "seq_len": "context_length", "sequence_parallel_size": "sp_size", "warmup": "warmup_steps"}


def meant_key(key: str, known: list[str]) -> str | None:
    """The one of ``known`` that ``key`` stands for (its alias) or is a close spelling of; None."""
    alias = KEY_ALIASES.get(key)
    if alias in known:
        return alias
    close = difflib.get_close_matches(key, known, n=1)
    return close[0] if close else None
