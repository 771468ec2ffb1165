"""Per-row softmax statistics of attention results, outside any kernel: the merge of two partial results by
their log-sum-exp (the forward's rescale, the paper's Algorithm 3), delta = rowsum(dout * out) that a
backward needs, and an output stand-in with the same row sums for kernels that read the output only
through them."""

from __future__ import annotations

import torch

__all__ = ["ROW_PASS", "attention_delta", "merge_into", "stand_in_output"]

#: rows per pass of :func:`attention_delta` and :func:`stand_in_output`: their float32 temporaries stay
#: this many rows (times heads x head dim) whatever the length
ROW_PASS = 4096


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
    out.mul_(w_old).addcmul_(part_out, w_new)  # part_out may be in a lower precision (bf16 on the wire)
    lse.copy_(new_lse)


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)`` as float32 ``(batch, heads, q_len)`` (float64 for float64 inputs), a pass of
    :data:`ROW_PASS` rows at a time (its float32 products never span the sequence)."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    delta = torch.empty(out.shape[0], out.shape[2], out.shape[1], dtype=acc, device=out.device)
    for start in range(0, out.shape[1], ROW_PASS):
        stop = min(start + ROW_PASS, out.shape[1])
        rows = (dout[:, start:stop].to(acc) * out[:, start:stop].to(acc)).sum(dim=-1)
        delta[:, :, start:stop] = rows.transpose(1, 2)
    return delta


def stand_in_output(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Rows ``o`` in ``dout``'s layout and dtype with ``rowsum(dout * o) == delta``: ``o = delta / |dout|^2 *
    dout`` (zero where a row of ``dout`` is zero, whose delta is zero too). A backward that reads the output
    only through these row sums (SDPA's, FlashAttention's) gives the same gradients with it, so a helper
    receives one number per row and head instead of the output rows. Each row is scaled by its largest
    entry first, so no square overflows or underflows; ``|o| <= |out|`` row by row (Cauchy-Schwarz)."""
    acc = delta.dtype
    o = torch.empty_like(dout)
    for start in range(0, dout.shape[1], ROW_PASS):
        stop = min(start + ROW_PASS, dout.shape[1])
        rows = dout[:, start:stop].to(acc)
        peak = rows.abs().amax(-1)  # (batch, rows, heads)
        peak = torch.where(peak > 0, peak, 1)
        unit = rows / peak.unsqueeze(-1)
        norm = unit.square().sum(-1)  # between 1 and head_dim, or 0 for a zero row
        scale = delta[:, :, start:stop].transpose(1, 2) / (torch.where(norm > 0, norm, 1) * peak)
        o[:, start:stop] = (unit * scale.unsqueeze(-1)).to(o.dtype)
    return o
