"""Merging partial attention results (the paper's rescale) and the empty running result."""

from __future__ import annotations

import torch

from ..kernels.row_stats import merge_into

__all__ = ["empty_running", "merge_into"]


def empty_running(q: torch.Tensor, value_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A running (out, lse) that has seen no key: zeros and ``-inf`` (float32, or float64); ``out`` has
    ``value_dim`` features per head (default: ``q``'s head dim)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, s, h, d = q.shape
    d = d if value_dim is None else value_dim
    out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    return out, lse
