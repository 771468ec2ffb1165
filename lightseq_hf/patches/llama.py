"""The module name of the first release (Llama family only): the same API, from :mod:`.model`."""

from __future__ import annotations

from typing import Any

from . import batch, forward, model, state
from .batch import check_same_batch as _check_same_batch  # noqa: F401
from .forward import LOSS_CHUNK_TOKENS  # noqa: F401
from .model import patch, patch_llama, patch_model, unpatch, unpatch_llama  # noqa: F401
from .state import ATTN_IMPLEMENTATION, resolve_sp_group, unsharded  # noqa: F401


def __getattr__(name: str) -> Any:
    """Module state (``_settings``) and helpers live in the new modules; read them there."""
    for module in (state, model, forward, batch):
        if name in vars(module):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
