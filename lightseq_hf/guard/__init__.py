"""A correctness guard: prove at the first step that sequence parallelism changed nothing.

:func:`check_parity` compares one forward and backward of the patched model with the unpatched model's
on each rank; :func:`sync_gradients` averages gradients in loops without DDP/FSDP;
:class:`ParityCallback` (imported on first use: it needs Transformers' Trainer) runs the check at the start
of a Hugging Face ``Trainer`` or TRL run; :func:`run_first_step_check` is the fine-tune loop's call.
"""

from typing import Any

from .gradients import sync_gradients
from .parity import DEFAULT_RTOL, ParityError, check_parity, default_max_tokens

__all__ = ["DEFAULT_RTOL", "ParityCallback", "ParityError", "check_parity", "default_max_tokens",
           "run_first_step_check", "sync_gradients"]


def __getattr__(name: str) -> Any:
    if name == "ParityCallback":
        from .callback import ParityCallback

        return ParityCallback
    if name == "run_first_step_check":
        from .first_step import run_first_step_check

        return run_first_step_check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
