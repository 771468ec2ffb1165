"""Document segments of packed and padded rows: one description, built from Hugging Face inputs.

A :class:`Segments` lists, for each batch row of the *full* (unsharded) sequence, the documents
as half-open token intervals ``[start, stop)``, sorted and disjoint. Tokens in no document are
padding: they attend to nothing and nothing attends to them (their outputs are zero, their
gradients zero). Key ``j`` is visible from query ``i`` when both lie in one document and, when
causal, ``j <= i``; a sliding ``window`` further requires ``i - window < j`` (and, non-causal,
``j < i + window``).

Every rule above is a contiguous *key range per query row*, ``lo[i] <= j < hi[i]``, with ``lo``
and ``hi`` non-decreasing along the row (padding rows get the empty range ``[i, i)``). That is
what the kernels take (:func:`key_ranges`), and what the schedule counts work with
(:func:`visible_pairs`): both are pure functions of the boundaries.

Builders: :meth:`Segments.from_cu_seqlens` (``cu_seqlens`` / ``cu_seq_lens_q`` over the flattened
batch, as flash-attn and HF's flattening collator give them), :func:`segments_from_hf` (any mix of
a 2-D padding ``attention_mask``, restarting ``position_ids`` and ``cu_seq_lens_*`` kwargs).
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "Segments", "as_segments", "decode_segments", "key_ranges", "local_key_range", "segments_from_hf",
    "visible_pairs",
]

_Doc = tuple[int, int]


@dataclass(frozen=True)
class Segments:
    """Documents ``[start, stop)`` of each batch row of a full sequence of ``length`` tokens."""

    length: int
    docs: tuple[tuple[_Doc, ...], ...]

    def __post_init__(self) -> None:
        try:
            length = operator.index(self.length)
            docs = tuple(tuple((operator.index(a), operator.index(b)) for a, b in row) for row in self.docs)
        except (TypeError, ValueError):
            raise ValueError(
                f"Segments takes an int length and, per batch row, a sequence of (start, stop) int pairs, "
                f"e.g. Segments(8, (((0, 3), (3, 8)),)); got length {self.length!r}, docs {self.docs!r}."
            ) from None
        object.__setattr__(self, "length", length)
        object.__setattr__(self, "docs", docs)
        if self.length < 0:
            raise ValueError(f"segment length must be >= 0, got {self.length}.")
        for r, row in enumerate(self.docs):
            prev = 0
            for start, stop in row:
                if not (prev <= start < stop <= self.length):
                    raise ValueError(
                        f"row {r}: document [{start}, {stop}) is empty, overlaps the previous one or lies "
                        f"outside [0, {self.length}); documents must be sorted, disjoint, non-empty "
                        "intervals of the full row."
                    )
                prev = stop

    @property
    def batch(self) -> int:
        return len(self.docs)

    @classmethod
    def full(cls, batch: int, length: int) -> Segments:
        """One document spanning each row (a plain sequence)."""
        return cls(length, tuple(((0, length),) if length else () for _ in range(batch)))

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor | Sequence[int], batch: int, length: int
    ) -> Segments:
        """Documents from cumulative lengths over the flattened ``batch * length`` tokens.

        ``cu_seqlens`` starts at 0 and increases; tokens after its last entry are padding. A
        document may not cross from one row into the next.
        """
        cu = _whole_numbers(cu_seqlens)
        total = batch * length
        if not cu or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            raise ValueError(
                f"cu_seqlens must start at 0, strictly increase and end at most at batch * length = "
                f"{total}; got {cu[:8]}{'...' if len(cu) > 8 else ''} (last {cu[-1] if cu else None})."
            )
        rows: list[list[_Doc]] = [[] for _ in range(batch)]
        for start, stop in zip(cu, cu[1:]):
            row = start // length
            if (stop - 1) // length != row:
                raise ValueError(
                    f"cu_seqlens document [{start}, {stop}) crosses from batch row {row} into the next "
                    f"(rows have {length} tokens); split it at the row boundary or use batch size 1."
                )
            rows[row].append((start - row * length, stop - row * length))
        return cls(length, tuple(tuple(r) for r in rows))

    def padded(self, length: int) -> Segments:
        """The same documents in rows extended to ``length`` tokens (the extra tokens are padding)."""
        if length < self.length:
            raise ValueError(f"cannot pad segments of length {self.length} down to {length}.")
        return Segments(length, self.docs)

    def is_full(self) -> bool:
        """True when every row is one document of the whole row (no packing, no padding)."""
        return all(row == ((0, self.length),) for row in self.docs)

    def encode(self) -> list[int]:
        """A flat integer list (for custom-op arguments): length, batch, then per row its count and
        boundaries."""
        flat = [self.length, self.batch]
        for row in self.docs:
            flat.append(len(row))
            for start, stop in row:
                flat += [start, stop]
        return flat

    def checksum(self) -> int:
        """A deterministic 32-bit digest (ranks compare it to catch disagreeing segments)."""
        return zlib.crc32(torch.tensor(self.encode(), dtype=torch.int64).numpy().tobytes())


def _has_fraction(t: torch.Tensor) -> bool:
    """True for a floating-point tensor holding a value that is not a whole number."""
    return t.is_floating_point() and not bool((t == t.round()).all())


def _whole_numbers(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """``cu_seqlens`` as a list of ints; ValueError unless it is 1-D and holds whole numbers."""
    try:
        t = torch.as_tensor(cu_seqlens).detach().cpu()
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        t = None
    if t is None or t.dim() != 1 or t.dtype == torch.bool or t.is_complex() or _has_fraction(t):
        shown = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else repr(cu_seqlens)[:80]
        raise ValueError(
            f"cu_seqlens must be a 1-D list or tensor of whole token counts (int32 or int64, like "
            f"[0, 5, 12]); got {type(cu_seqlens).__name__} {shown}"
            f"{'' if t is None else f' of dtype {t.dtype}'}."
        )
    return [int(x) for x in t.tolist()]


@lru_cache(maxsize=256)
def _decode_cached(flat: tuple[int, ...]) -> Segments:
    length, batch = flat[0], flat[1]
    docs, i = [], 2
    for _ in range(batch):
        n = flat[i]
        docs.append(tuple((flat[i + 1 + 2 * d], flat[i + 2 + 2 * d]) for d in range(n)))
        i += 1 + 2 * n
    return Segments(length, tuple(docs))


def decode_segments(flat: Sequence[int]) -> Segments:
    """Inverse of :meth:`Segments.encode`."""
    return _decode_cached(tuple(int(x) for x in flat))


def key_ranges(
    segments: Segments, *, causal: bool, window: int | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global key ranges ``(lo, hi)``, int64 ``(batch, length)``: query ``i`` sees keys ``lo <= j < hi``.

    Both are non-decreasing along each row; padding rows get ``lo = hi = i``.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (or None), got {window}.")
    return _key_ranges_cached(segments, causal, window, str(device))


@lru_cache(maxsize=8)  # every layer of a step reuses one entry; old batches' GPU tensors go soon
def _key_ranges_cached(segments: Segments, causal: bool, window: int | None, device: str):
    b, n = segments.batch, segments.length
    pos = torch.arange(n, dtype=torch.int64)
    lo = pos.repeat(b, 1)
    hi = pos.repeat(b, 1)
    for r, row in enumerate(segments.docs):
        for start, stop in row:
            idx = pos[start:stop]
            row_lo = torch.full_like(idx, start)
            row_hi = idx + 1 if causal else torch.full_like(idx, stop)
            if window is not None:
                row_lo = torch.maximum(row_lo, idx - window + 1)
                if not causal:
                    row_hi = torch.minimum(row_hi, idx + window)
            lo[r, start:stop] = row_lo
            hi[r, start:stop] = row_hi
    return lo.to(device), hi.to(device)


def visible_pairs(lo: torch.Tensor, hi: torch.Tensor, key_start: int, key_stop: int) -> torch.Tensor:
    """Per query row, how many keys of ``[key_start, key_stop)`` it sees (same shape as ``lo``)."""
    return (hi.clamp(max=key_stop) - lo.clamp(min=key_start)).clamp_min(0)


def local_key_range(
    lo: torch.Tensor, hi: torch.Tensor, key_start: int, key_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ranges restricted to the key chunk ``[key_start, key_start + key_len)``, in chunk
    coordinates, int32 (what the kernels take). Monotone ranges stay monotone."""
    lo_l = (lo - key_start).clamp(0, key_len)
    hi_l = (hi - key_start).clamp(0, key_len)
    return lo_l.to(torch.int32).contiguous(), torch.maximum(hi_l, lo_l).to(torch.int32).contiguous()


def _runs(valid: torch.Tensor, starts: torch.Tensor) -> tuple[_Doc, ...]:
    """Maximal runs of ``valid`` tokens (bool ``(length,)``), also split before every ``starts`` token."""
    if valid.numel() == 0:
        return ()
    brk = ~valid | starts
    begin = valid & torch.cat([torch.tensor([True]), brk[1:] | ~valid[:-1]])
    last = valid & torch.cat([brk[1:], torch.tensor([True])])
    b_idx = begin.nonzero().flatten().tolist()
    e_idx = (last.nonzero().flatten() + 1).tolist()
    return tuple(zip(b_idx, e_idx))


def segments_from_hf(
    *,
    batch: int,
    length: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seq_lens_k: torch.Tensor | Sequence[int] | None = None,
) -> Segments | None:
    """Segments from Hugging Face inputs, or ``None`` for plain rows (one document each, no padding).

    - ``attention_mask`` ``(batch, length)`` of 0/1: right or left padding (zeros at the ends of a
      row); zeros between ones are refused (that is not padding).
    - ``position_ids`` ``(batch, length)`` or ``(length,)``: a new document starts wherever the position
      does not continue the previous one by +1 (``DataCollatorWithFlattening``, TRL padding-free).
    - ``cu_seq_lens_q`` / ``cu_seq_lens_k``: flash-attn cumulative lengths over the flattened batch
      (tensors or lists); they must agree (self-attention). Tokens after the last document are padding.
    """
    valid = torch.ones(batch, length, dtype=torch.bool)
    starts = torch.zeros(batch, length, dtype=torch.bool)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} is not a 2-D padding mask; pass "
                "(batch, seq) 0/1 masks (custom 4-D masks are not supported under sequence parallelism)."
            )
        if tuple(attention_mask.shape) != (batch, length):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, inputs are ({batch}, {length})."
            )
        valid = attention_mask.detach().cpu() != 0
        count = valid.sum(-1)
        first = valid.int().argmax(-1)
        holes = (count > 0) & (valid.int().flip(-1).argmax(-1) != length - first - count)
        if bool(holes.any()):
            r = int(holes.nonzero()[0, 0])
            raise ValueError(
                f"attention_mask row {r} has zeros between ones; only left or right padding is "
                "supported. Pack documents with restarting position_ids (or cu_seq_lens_q/k) "
                "instead of masking inside a row."
            )
    if position_ids is not None:
        pos = position_ids.detach().cpu()
        if _has_fraction(pos):
            raise ValueError("position_ids must be whole numbers (token positions, int64); got fractional "
                             "values.")
        pos = pos.long()
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.dim() != 2 or pos.shape[-1] != length or pos.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids have shape {tuple(position_ids.shape)}; expected ({batch}, {length})."
            )
        pos = pos.expand(batch, length)
        # positions of padding tokens (HF fills them with 1) break nothing: only valid neighbours count
        breaks = (pos[:, 1:] != pos[:, :-1] + 1) & valid[:, 1:] & valid[:, :-1]
        starts[:, 1:] |= breaks
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        valid, starts = _cu_documents(cu_seq_lens_q, cu_seq_lens_k, batch, length, valid, starts)
    if bool(valid.all()) and not bool(starts[:, 1:].any()):
        return None
    return Segments(length, tuple(_runs(valid[r], starts[r]) for r in range(batch)))


def _cu_documents(cu_q: torch.Tensor | Sequence[int] | None, cu_k: torch.Tensor | Sequence[int] | None,
                  batch: int, length: int, valid: torch.Tensor,
                  starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``valid`` and ``starts`` with the documents of flash-attn's cumulative lengths; ``starts`` holds the
    document starts the position ids gave, each of which must also start a document here (flash-attn
    would attend across a restart the lengths do not have; splitting there instead would mix the two)."""
    if cu_q is None or cu_k is None or _whole_numbers(cu_q) != _whole_numbers(cu_k):
        raise ValueError(
            "cu_seq_lens_q and cu_seq_lens_k must both be given and equal (causal self-attention of "
            "packed documents)."
        )
    covered = torch.zeros(batch, length, dtype=torch.bool)
    cu_starts = torch.zeros(batch, length, dtype=torch.bool)
    for r, row in enumerate(Segments.from_cu_seqlens(cu_q, batch, length).docs):
        for start, stop in row:
            covered[r, start:stop] = True
            cu_starts[r, start] = True
    stray = starts & ~cu_starts & valid & covered
    if bool(stray.any()):
        r, t = (int(i) for i in stray.nonzero()[0])
        raise ValueError(
            f"position_ids restart at token {t} of row {r}, where cu_seq_lens_q/k start no document: the two "
            "describe different documents. Pass position_ids that restart exactly where cu_seq_lens_q/k "
            "start a document (or leave one of them out)."
        )
    return valid & covered, starts | cu_starts


def as_segments(
    cu_seqlens: torch.Tensor | Sequence[int] | Segments | None, batch: int, length: int
) -> Segments | None:
    """``Segments`` from what a caller passed (``None``, a ``Segments``, or flattened ``cu_seqlens``)."""
    if cu_seqlens is None or isinstance(cu_seqlens, Segments):
        return cu_seqlens
    return Segments.from_cu_seqlens(cu_seqlens, batch, length)
