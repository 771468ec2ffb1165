"""Read-only views of the library's internal state, for tests and benchmarks. Private: not API."""

from __future__ import annotations

import torch

from ..offload import HostBufferPool

__all__ = ["pooled_host_buffers"]


def pooled_host_buffers(pool: HostBufferPool) -> list[torch.Tensor]:
    """The host buffers ``pool`` holds for reuse (those no step is using now)."""
    return [buffer for free in pool._free.values() for buffer in free]
