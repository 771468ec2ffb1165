"""Per-task document blocks for the flash varlen kernels, built on the host from the segments.

Without a sliding window, the mask of every task (query rows ``[row_start, row_stop)`` of chunk
``q_owner`` against its keys of chunk ``kv_owner``, ``task.keys``) splits into one block per document:

- keys before the query rows (a key chunk before the query chunk) or non-causal attention: each query row
  of the document sees *all* the document's keys in the key chunk: a full block;
- causal, key chunk = query chunk (the diagonal task): the document's query rows ``[qa, qb)`` see its keys
  ``[ka, kb)`` of the chunk trimmed to ``kb <= qb``; then ``kb == qb``, so FlashAttention's bottom-right
  causal rule (local key ``j`` visible from local query ``i`` when ``j <= i + (kb - ka) - (qb - qa)``) is
  exactly ``ka + j <= qa + i``: causal blocks.

Documents with no query row or no visible key in the task are dropped, and padding rows are never fed.
A window is not one block per document (use the key-range kernels). Pure functions, cached per
``(segments, task, chunk, causal, device)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..kernels.base import DocBlocks
from ..kernels.varlen.rows import make_doc_blocks
from .schedule import SpanTask
from .segments import Segments

__all__ = ["DocSpan", "doc_spans", "task_doc_blocks"]


@dataclass(frozen=True)
class DocSpan:
    """One document's block in global token coordinates: batch ``row``, query rows ``[q_start, q_stop)``
    against keys ``[k_start, k_stop)``."""

    row: int
    q_start: int
    q_stop: int
    k_start: int
    k_stop: int


def doc_spans(
    segments: Segments, q_start: int, q_stop: int, k_start: int, k_stop: int, causal: bool
) -> tuple[tuple[DocSpan, ...], bool]:
    """The documents' blocks of query rows ``[q_start, q_stop)`` against keys ``[k_start, k_stop)`` (global
    positions, every batch row), and whether they need the (bottom-right) causal mask.

    Raises ValueError when some blocks need the causal mask and others a full one that it would cut
    (not expressible in one varlen call; never the case for the tasks of a schedule).
    """
    spans: list[DocSpan] = []
    needs_causal = False
    for r, row in enumerate(segments.docs):
        for start, stop in row:
            if stop <= q_start:
                continue
            if start >= q_stop:
                break
            qa, qb = max(start, q_start), min(stop, q_stop)
            ka, kb = max(start, k_start), min(stop, k_stop)
            if causal:
                kb = min(kb, qb)
            if kb <= ka:
                continue
            if causal and kb - 1 > qa:  # some query row does not see every key
                needs_causal = True
            spans.append(DocSpan(r, qa, qb, ka, kb))
    if needs_causal:
        for s in spans:
            if s.k_stop != s.q_stop:  # the causal rule would hide keys that its rows see
                raise ValueError(
                    f"document block {s} does not end its keys at its last query row while other blocks "
                    "of the call need the causal mask; one flash varlen call cannot mix them."
                )
    return tuple(spans), needs_causal


def task_doc_blocks(
    segments: Segments, task: SpanTask, chunk: int, causal: bool, device: torch.device | str
) -> DocBlocks:
    """The :class:`DocBlocks` of ``task`` for a kernel given the task's query rows (``row_stop - row_start``
    rows of each batch row) and its keys (``task.keys(chunk)`` of each batch row)."""
    key_start, key_stop = task.keys(chunk)
    return _task_doc_blocks(segments, task.q_owner, task.kv_owner, task.row_start, task.row_stop, key_start,
                            key_stop, chunk, causal, str(device))


@lru_cache(maxsize=512)  # a step's tasks, reused by every layer (tiny host lists, small device tensors)
def _task_doc_blocks(segments: Segments, q_owner: int, kv_owner: int, row_start: int, row_stop: int,
                     key_start: int, key_stop: int, chunk: int, causal: bool, device: str) -> DocBlocks:
    q0 = q_owner * chunk + row_start
    k0 = kv_owner * chunk + key_start
    spans, needs_causal = doc_spans(segments, q0, q_owner * chunk + row_stop, k0,
                                    kv_owner * chunk + key_stop, causal)
    rows, keys = row_stop - row_start, key_stop - key_start
    q_runs = [(s.row * rows + s.q_start - q0, s.q_stop - s.q_start) for s in spans]
    k_runs = [(s.row * keys + s.k_start - k0, s.k_stop - s.k_start) for s in spans]
    return make_doc_blocks(tuple(n for _, n in q_runs), tuple(n for _, n in k_runs), _fed_rows(q_runs),
                           _fed_rows(k_runs), needs_causal, device)


def _fed_rows(runs: list[tuple[int, int]]) -> slice | torch.Tensor:
    """Rows ``[start, start + n)`` of each run, in order: a slice when the runs abut, else int64 indices."""
    if all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:])):
        return slice(runs[0][0], runs[-1][0] + runs[-1][1]) if runs else slice(0, 0)
    return torch.cat([torch.arange(a, a + n, dtype=torch.int64) for a, n in runs])

