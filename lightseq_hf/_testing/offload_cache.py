"""The checkpoint offloader's hand-back of a cached attention tensor, callable without a GPU. Private: not
API."""

from __future__ import annotations

from typing import Any

import torch

from ..offload import _refill_cache_entry

__all__ = ["refill_cache_entry"]


def refill_cache_entry(entry: Any, tensor: torch.Tensor, copy_done: Any) -> None:
    """What the offloader does in backward with a tensor the selective-checkpoint cache kept: ``entry`` (the
    cache's version-checked wrapper) gets ``tensor`` back while its host-to-device copy (event
    ``copy_done``) may still run; the compute stream waits for that copy at the entry's first read."""
    _refill_cache_entry(entry, tensor, copy_done)
