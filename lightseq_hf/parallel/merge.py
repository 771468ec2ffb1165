"""Numerically stable merge of partial attention results (the paper's rescale)."""

from __future__ import annotations

import torch


def merge_into(
    out: torch.Tensor,
    lse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> None:
    """Merge ``(part_out, part_lse)`` into the running ``(out, lse)`` in place.

    ``out``/``part_out`` are ``(batch, seq, heads, dim)``; ``lse``/``part_lse`` are
    ``(batch, heads, seq)``. Rows whose lse is ``-inf`` (no key seen yet) contribute
    nothing; a row with ``-inf`` on both sides stays ``-inf`` with a zero output.
    """
    new_lse = torch.logaddexp(lse, part_lse.to(lse.dtype))
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(part_lse.to(lse.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(part_out.to(out.dtype) * w_new)
    lse.copy_(new_lse)


def empty_running(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A running (out, lse) that has seen no key: zeros and ``-inf`` (float32, or float64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    return out, lse
