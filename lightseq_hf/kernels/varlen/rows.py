"""Rows and document blocks of the variable-length backends (``flash_varlen``, ``cudnn_fe``): a
:class:`DocBlocks` built from host lists, the cuts of its blocks into the op calls a vendor op computes
exactly, and the rows it feeds of a local call's ``(batch, length, heads, dim)`` tensors, gathered into the
ops' packed ``(total, heads, dim)`` layout and written or added back.

- Building: :func:`make_doc_blocks` (row indices become a ``slice`` where they are one run, so the ops read
  views), :func:`whole_rows` (plain attention: every batch row one block), :func:`check_blocks`.
- Cutting, on the host, once per blocks object (cached): :func:`fed_blocks` drops the rows that see no key
  (the first ``m - n`` rows of a causal ``m x n`` block: they keep out 0 and lse ``-inf`` and get no
  gradient); :func:`aligned_calls` computes causal blocks with more keys than rows (rows that start inside
  their document) as square causal blocks, whose bottom-right and top-left rules agree, and the key prefixes
  every row sees, without a mask; :func:`backward_plan` takes the first key out of blocks whose key length
  is 64 mod 128 and returns its (row, key) pairs (:class:`KeyPairs`) for the caller to compute. Results of
  the cut calls merge by lse and their gradients add, so they equal the uncut blocks'. Which cut an op
  needs, and why, its backend says (:mod:`.cudnn`).
- Moving rows: :class:`RowMap` (views where the rows are one run inside a batch row), :func:`gather_rows`
  (with a capacity: the rows after the run in the tensor's storage, :func:`storage_rows`, as a view),
  :func:`running_buffers` / :func:`merge_rows` (the forward's running out and lse),
  :func:`gradient_buffers` / :func:`check_backward_rows` (the backward's).

Nothing here knows documents, schedules or a vendor's op: callers build the blocks.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..base import DocBlocks, Rows
from ..row_stats import merge_into

__all__ = ["KeyPairs", "RowMap", "accumulate_dtype", "aligned_calls", "backward_plan", "check_backward_rows",
           "check_blocks", "fed_blocks", "gather_rows", "gradient_buffers", "in_accumulate_dtype",
           "make_doc_blocks", "merge_rows", "needs_bottom_right", "running_buffers", "storage_rows", "whole",
           "whole_rows"]

# --- building blocks ----------------------------------------------------------------------------------

def make_doc_blocks(
    q_lens: tuple[int, ...],
    k_lens: tuple[int, ...],
    q_rows: list[int] | range | slice | torch.Tensor,
    k_rows: list[int] | range | slice | torch.Tensor,
    causal: bool,
    device: torch.device | str,
) -> DocBlocks:
    """A :class:`DocBlocks` from host lists or index tensors (row indices become a ``slice`` when
    contiguous)."""
    if len(q_lens) != len(k_lens) or min((*q_lens, *k_lens), default=1) < 1:
        raise ValueError(
            f"blocks need equal counts of positive query and key lengths; got {q_lens}, {k_lens}."
        )

    def rows(r, total: int) -> Rows:
        if isinstance(r, slice):
            return r
        if isinstance(r, range) and r.step == 1:
            return slice(r.start, r.stop)
        if isinstance(r, torch.Tensor):
            if r.numel() != total:
                raise ValueError(f"{r.numel()} row indices for {total} rows of the blocks.")
            return r.to(device=device, dtype=torch.int64)
        r = list(r)
        if len(r) != total:
            raise ValueError(f"{len(r)} row indices for {total} rows of the blocks.")
        if r and r == list(range(r[0], r[0] + len(r))):
            return slice(r[0], r[0] + len(r))
        return torch.tensor(r, dtype=torch.int64).to(device)

    return DocBlocks(tuple(q_lens), tuple(k_lens), rows(q_rows, sum(q_lens)), rows(k_rows, sum(k_lens)),
                     _cumulative(q_lens, device), _cumulative(k_lens, device), bool(causal))


def _cumulative(lens: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """The int32 cumulative lengths ``[0, l0, l0 + l1, ...]`` on ``device``."""
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def whole_rows(batch: int, q_len: int, kv_len: int, causal: bool, device: torch.device | str) -> DocBlocks:
    """Every batch row as one block (plain attention; causal aligned bottom-right); cached."""
    return _whole_rows(batch, q_len, kv_len, causal, str(device))


@lru_cache(maxsize=64)
def _whole_rows(batch: int, q_len: int, kv_len: int, causal: bool, device: str) -> DocBlocks:
    if batch == 0 or q_len == 0 or kv_len == 0:
        return make_doc_blocks((), (), [], [], causal, device)
    return make_doc_blocks((q_len,) * batch, (kv_len,) * batch, slice(0, batch * q_len),
                           slice(0, batch * kv_len), causal, device)


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


# --- cutting blocks into op calls (host code, cached per blocks object) ---------------------------------

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_Part = tuple[int, int, int, int]  # (first fed row, rows, first fed key, keys), positions in the blocks


def _parts(blocks: DocBlocks) -> list[_Part]:
    parts, qa, ka = [], 0, 0
    for m, n in zip(blocks.q_lens, blocks.k_lens):
        parts.append((qa, m, ka, n))
        qa, ka = qa + m, ka + n
    return parts


def fed_blocks(blocks: DocBlocks) -> DocBlocks:
    """``blocks`` without the rows that see no key (the first ``m - n`` rows of a causal ``m x n`` block);
    cached."""
    plans = _plans.setdefault(blocks, {})
    if "fed" not in plans:
        if blocks.causal and any(m > n for m, n in zip(blocks.q_lens, blocks.k_lens)):
            parts = [(qa + max(0, m - n), min(m, n), ka, n) for qa, m, ka, n in _parts(blocks)]
            plans["fed"] = _sub_blocks(blocks, parts, True)
        else:
            plans["fed"] = blocks
    return plans["fed"]


def aligned_calls(blocks: DocBlocks) -> tuple[DocBlocks, ...]:
    """The op calls computing ``blocks`` (already :func:`fed_blocks`) with square causal blocks only (see the
    module docstring): ``(blocks,)``, or the causal square parts and the unmasked key prefixes; their
    results merge by lse and their gradients add. Cached."""
    plans = _plans.setdefault(blocks, {})
    if "aligned" not in plans:
        parts = _parts(blocks)
        if not needs_bottom_right(blocks) or any(m > n for _, m, _, n in parts):
            plans["aligned"] = (blocks,)
        else:
            square = [(qa, m, ka + n - m, m) for qa, m, ka, n in parts]
            prefix = [(qa, m, ka, n - m) for qa, m, ka, n in parts if n > m]
            plans["aligned"] = (_sub_blocks(blocks, square, True), _sub_blocks(blocks, prefix, False))
    return plans["aligned"]


def needs_bottom_right(blocks: DocBlocks) -> bool:
    """Whether the causal rule of ``blocks`` differs between bottom-right and top-left alignment."""
    return blocks.causal and any(m != n for m, n in zip(blocks.q_lens, blocks.k_lens))


@dataclass(frozen=True, eq=False)
class KeyPairs:
    """Query rows each paired with one key, as flat indices into the call's ``(batch * q_len)`` rows and
    ``(batch * kv_len)`` keys (int64, on the blocks' device)."""

    q_rows: torch.Tensor
    k_rows: torch.Tensor


def backward_plan(blocks: DocBlocks, avoid_hazard: bool) -> tuple[DocBlocks, KeyPairs | None]:
    """The blocks of the backward op call over ``blocks`` (already :func:`fed_blocks`) and the pairs the
    caller computes itself: ``(blocks, None)``, or, when ``avoid_hazard`` and some key length is 64 mod 128,
    the split of the module docstring; cached."""
    plans = _plans.setdefault(blocks, {})
    key = ("backward", avoid_hazard)
    if key not in plans:
        hit = avoid_hazard and any(n % 128 == 64 for n in blocks.k_lens)
        plans[key] = _without_first_keys(blocks) if hit else (blocks, None)
    return plans[key]


def _without_first_keys(blocks: DocBlocks) -> tuple[DocBlocks, KeyPairs]:
    parts, pair_rows, pair_keys = [], [], []
    for qa, m, ka, n in _parts(blocks):
        if n % 128 != 64:
            parts.append((qa, m, ka, n))
            continue
        # rows before the last m - (n - 1) of a causal block see only the first key: not fed
        fed = min(m, n - 1) if blocks.causal else m
        parts.append((qa + m - fed, fed, ka + 1, n - 1))
        pair_rows.append((qa, m))
        pair_keys.append((ka, m))  # the first key, once per row of the block
    device = blocks.cu_q.device
    keys = torch.repeat_interleave(torch.tensor([ka for ka, _ in pair_keys], dtype=torch.int64),
                                   torch.tensor([m for _, m in pair_keys], dtype=torch.int64))
    pairs = KeyPairs(_indices(_pick(blocks.q_rows, _positions(pair_rows), device), device),
                     _indices(_pick(blocks.k_rows, keys, device), device))
    return _sub_blocks(blocks, parts, blocks.causal), pairs


def _indices(rows: Rows, device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 index tensor on ``device``."""
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows.to(device)


def _positions(runs: list[tuple[int, int]]) -> slice | torch.Tensor:
    """Positions ``[start, start + n)`` of each run, in order: a slice when the runs abut, else int64."""
    if all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:])):
        return slice(runs[0][0], runs[-1][0] + runs[-1][1]) if runs else slice(0, 0)
    return torch.cat([torch.arange(a, a + n, dtype=torch.int64) for a, n in runs])


def _pick(rows: Rows, pos: slice | torch.Tensor, device: torch.device) -> Rows:
    """The fed rows at positions ``pos`` of ``rows`` (a slice or a view when ``pos`` is a slice)."""
    if isinstance(pos, slice):
        if isinstance(rows, slice):
            return slice(rows.start + pos.start, rows.start + pos.stop)
        return rows[pos]
    if isinstance(rows, slice):
        return (pos + rows.start).to(device)
    return rows[pos.to(device)]


def _sub_blocks(blocks: DocBlocks, parts: list[_Part], causal: bool) -> DocBlocks:
    device = blocks.cu_q.device
    q_lens = tuple(m for _, m, _, _ in parts)
    k_lens = tuple(n for _, _, _, n in parts)
    q_rows = _pick(blocks.q_rows, _positions([(qa, m) for qa, m, _, _ in parts]), device)
    k_rows = _pick(blocks.k_rows, _positions([(ka, n) for _, _, ka, n in parts]), device)
    return DocBlocks(q_lens, k_lens, q_rows, k_rows, _cumulative(q_lens, device), _cumulative(k_lens, device),
                     causal)


# --- moving rows ----------------------------------------------------------------------------------------

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
