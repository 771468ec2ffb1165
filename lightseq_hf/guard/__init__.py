"""A correctness guard: prove at the first step that sequence parallelism changed nothing.

:func:`check_parity` compares one forward and backward of the patched model with the same computation
unsharded on each rank; :func:`sync_gradients` averages gradients in loops without DDP/FSDP;
:class:`ParityCallback` runs the check at the start of a Hugging Face ``Trainer`` (or TRL) run.
"""

from .gradients import sync_gradients
from .parity import DEFAULT_RTOL, ParityError, check_parity, default_max_tokens

__all__ = ["DEFAULT_RTOL", "ParityError", "check_parity", "default_max_tokens", "sync_gradients"]
