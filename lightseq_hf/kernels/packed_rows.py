"""Row plumbing of the document-block backends (``flash_varlen``, ``cudnn_fe``): which rows of a local call's
``(batch, length, heads, dim)`` tensors a :class:`DocBlocks` feeds, gathered into the packed
``(total, heads, dim)`` layout of the variable-length ops, and written or added back.

Nothing here knows documents or schedules: callers build the blocks.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .base import DocBlocks, Rows, make_doc_blocks
from .row_stats import merge_into

__all__ = ["RowMap", "accumulate_dtype", "check_backward_rows", "check_blocks", "gather_rows",
           "gradient_buffers", "in_accumulate_dtype", "merge_rows", "running_buffers", "storage_rows",
           "whole", "whole_rows"]


def whole_rows(batch: int, q_len: int, kv_len: int, causal: bool, device: torch.device | str) -> DocBlocks:
    """Every batch row as one block (plain attention; causal aligned bottom-right); cached."""
    return _whole_rows(batch, q_len, kv_len, causal, str(device))


@lru_cache(maxsize=64)
def _whole_rows(batch: int, q_len: int, kv_len: int, causal: bool, device: str) -> DocBlocks:
    if batch == 0 or q_len == 0 or kv_len == 0:
        return make_doc_blocks((), (), [], [], causal, device)
    return make_doc_blocks((q_len,) * batch, (kv_len,) * batch, slice(0, batch * q_len),
                           slice(0, batch * kv_len), causal, device)


class RowMap:
    """Fed rows of ``(batch, length, ...)`` tensors (flat row ``r`` is ``[r // length, r % length]``):
    views when the rows are a run inside one batch row, else advanced indices."""

    def __init__(self, rows: Rows, batch: int, length: int, device: torch.device) -> None:
        self.view: tuple[int, slice] | None = None
        if isinstance(rows, slice):
            b0 = rows.start // length if length else 0
            if rows.stop - rows.start == 0 or (rows.stop - 1) // length == b0:
                self.view = (b0, slice(rows.start - b0 * length, rows.stop - b0 * length))
                return
            rows = torch.arange(rows.start, rows.stop, device=device)
        self.batch_idx = torch.div(rows, length, rounding_mode="floor")
        self.pos_idx = rows - self.batch_idx * length

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, length, H, D)`` -> ``(total, H, D)`` (a view when possible)."""
        if self.view is not None:
            return x[self.view[0], self.view[1]]
        return x[self.batch_idx, self.pos_idx]

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """``(batch, H, length)`` -> ``(H, total)`` (a view when possible)."""
        if self.view is not None:
            return lse[self.view[0], :, self.view[1]]
        return lse[self.batch_idx, :, self.pos_idx].t()

    def put(self, x: torch.Tensor, values: torch.Tensor, *, accumulate: bool = False) -> None:
        """Write (or add) ``(total, H, D)`` values into the rows of ``(batch, length, H, D)`` ``x`` (a row
        fed twice gets both values added when accumulating)."""
        if self.view is not None:
            dst = x[self.view[0], self.view[1]]
            if accumulate:
                dst.add_(values)
            else:
                dst.copy_(values)
        else:
            x.index_put_((self.batch_idx, self.pos_idx), values.to(x.dtype), accumulate=accumulate)

    def put_lse(self, lse: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``(H, total)`` values into the rows of ``(batch, H, length)`` ``lse``."""
        if self.view is not None:
            lse[self.view[0], :, self.view[1]] = values
        else:
            lse[self.batch_idx, :, self.pos_idx] = values.t().to(lse.dtype)


def storage_rows(x: torch.Tensor) -> int:
    """How many rows of ``x`` ``(batch, length, ...)``'s layout its storage holds from its first row (its own
    rows, and the ones that follow it there when ``x`` is a contiguous view of a longer tensor)."""
    rows = x.shape[0] * x.shape[1]
    if not x.is_contiguous() or rows == 0:
        return rows
    row = x[0, 0].numel()
    return max(rows, (x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()) // max(row, 1))


def gather_rows(x: torch.Tensor, rows: Rows, capacity: int | None = None) -> torch.Tensor:
    """Rows of ``x`` ``(batch, length, H, D)`` flattened, contiguous ``(total, H, D)`` (a view when they are
    one contiguous run of a contiguous ``x``); with ``capacity``, ``capacity`` rows whose first ``total`` are
    those: the run and the rows after it in ``x``'s storage (a view: :func:`storage_rows`) where it has them,
    else a copy padded with zeros."""
    if (isinstance(rows, slice) and capacity is not None and x.is_contiguous()
            and rows.start + capacity <= storage_rows(x)):
        row_shape = x.shape[2:]
        step = x[0, 0].numel()
        return x.as_strided((capacity, *row_shape), (step, *x.stride()[2:]),
                            x.storage_offset() + rows.start * step)
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    picked = flat[rows] if isinstance(rows, slice) else flat.index_select(0, rows)
    if capacity is None or capacity == picked.shape[0]:
        return picked.contiguous()
    total = picked.shape[0]
    buf = torch.empty((capacity, *flat.shape[1:]), dtype=x.dtype, device=x.device)
    buf[:total].copy_(picked)
    buf[total:].zero_()
    return buf


def whole(rows: Rows, x: torch.Tensor) -> bool:
    """Whether ``rows`` are every row of ``x`` ``(batch, length, ...)``, in order."""
    return isinstance(rows, slice) and rows.start == 0 and rows.stop == x.shape[0] * x.shape[1]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs: the dtype of lse and accumulated gradients."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def in_accumulate_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


def check_blocks(blocks: DocBlocks, q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise ValueError when ``blocks`` feeds rows that ``q`` / ``k`` do not have, or lives elsewhere."""
    rows_q, rows_k = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
    for name, rows, total, limit in (("q_rows", blocks.q_rows, blocks.total_q, rows_q),
                                     ("k_rows", blocks.k_rows, blocks.total_k, rows_k)):
        if isinstance(rows, slice) and not (0 <= rows.start <= rows.stop <= limit
                                            and rows.stop - rows.start == total):
            raise ValueError(f"doc_blocks {name} {rows} does not fit {total} fed rows of {limit}.")
        if isinstance(rows, torch.Tensor) and (rows.numel() != total or rows.device != q.device):
            raise ValueError(f"doc_blocks {name} has {rows.numel()} indices on {rows.device}; the blocks "
                             f"feed {total} rows on {q.device}.")
    if blocks.cu_q.device != q.device:
        raise ValueError(f"doc_blocks live on {blocks.cu_q.device}; the tensors on {q.device}.")


def running_buffers(q: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                    lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(out, lse, accumulate)`` of a forward: the given running buffers (accumulate mode), else fresh ones
    (out 0 in ``q``'s dtype, lse ``-inf``: rows fed to no block keep them)."""
    if (out is None) != (lse is None):
        raise ValueError("accumulate mode needs both the running out and lse; pass both or neither.")
    if out is not None:
        return out, lse, True
    b, lq, h = q.shape[:3]
    out = torch.zeros((b, lq, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, lq), -math.inf, dtype=accumulate_dtype(q.dtype), device=q.device)
    return out, lse, False


def merge_rows(rows: RowMap, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
               part_lse: torch.Tensor, accumulate: bool) -> None:
    """Put one call's ``(total, H, D)`` output and ``(H, total)`` lse into the fed rows of ``out`` / ``lse``:
    written into fresh buffers, merged into running ones (views in place; gathered rows merged, then
    written back)."""
    if not accumulate:
        rows.put(out, part_out)
        rows.put_lse(lse, part_lse.to(lse.dtype))
        return
    run_out, run_lse = rows.take(out).unsqueeze(0), rows.take_lse(lse).unsqueeze(0)
    merge_into(run_out, run_lse, part_out.unsqueeze(0), part_lse.unsqueeze(0))
    if rows.view is None:
        rows.put(out, run_out[0])
        rows.put_lse(lse, run_lse[0])


def gradient_buffers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor | None,
                     dk: torch.Tensor | None, dv: torch.Tensor | None,
                     dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """The ``(dq, dk, dv)`` a backward adds into: the given ones, else zeros in ``dtype`` (None: float32,
    float64 for float64 inputs)."""
    dtype = dtype or accumulate_dtype(q.dtype)
    return tuple(torch.zeros(like.shape, dtype=dtype, device=q.device) if given is None else given
                 for given, like in ((dq, q), (dk, k), (dv, v)))


def check_backward_rows(backend: str, dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise ValueError unless the output rows are given and ``dout`` / ``out`` have ``q``'s shape."""
    if out is None:
        raise ValueError(f"backend {backend!r} needs the attention output in backward (not only delta).")
    if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"dout and out must have q's shape {tuple(q.shape)}; got {tuple(dout.shape)}, "
                         f"{tuple(out.shape)}.")
