"""How the ``cudnn_fe`` backend lays out a call for cuDNN's variable-length attention op: host-side planning,
once per layout (a :class:`DocBlocks`), and the graph shapes the op is asked for.

- :func:`fed_blocks`: a causal block with more query rows than keys (bottom-right aligned) has first rows
  that see no key; they are not fed (they keep out 0 and lse ``-inf``, and get no gradient), so the op
  never computes a row without a key.
- :func:`aligned_calls`: the op's backward with ``causal_bottom_right`` runs 1.7x slower than with its
  default top-left alignment (cuDNN 9.19 on an H100, 64K tokens in 9 documents: 46.6 against 27.3 ms
  forward+backward; the forward is the same), and the two agree on square blocks. A causal ``m x n`` block
  with ``n > m`` (rows that start inside their document) is computed as its last ``m`` keys under the
  causal mask and its first ``n - m`` keys, which every row sees, in a second call without a mask.
- :func:`backward_plan`: cuDNN before 9.26 can return NaN in dQ on Hopper when a sequence's key length is
  64 mod 128 and a row's lse is below -88.7. Where that can happen (:func:`key_length_hazard`, every GPU
  to be safe), a block with such a key length ``n`` goes to the op without its first key (``n - 1`` keys;
  a causal block keeps its bottom-right mask and drops a row that saw only that key), and the pairs of its
  rows with that first key, which every row sees, are returned as :class:`KeyPairs` for the caller to
  compute directly. Both use the rows' global lse, so the two add up to the block's gradients exactly, in
  one op call of the same shape as the forward's.
- :class:`GraphShapes`: the op builds one cuDNN graph per (documents, longest sequences, and in backward
  the rows of its query-side and key-side tensors rounded to 64, ...) and keeps 128 of them; a build
  takes 0.1 s. A changing packed stream would build on every step, so each call asks for a bucketed shape
  (documents and longest sequence rounded up to a power of two, the documents padded with empty ones) or
  reuses a larger shape already built when that wastes little. The backward's tensors need no copy to
  get there (:func:`backward_tokens`): where the storage of the tensor holding a side's rows continues for
  the bucket's rows from the first fed one, the op reads a view of them (it reads no row past the last
  sequence); where every row of a tensor is fed and its count is a run's local length, a view of the
  tensor; only other runs are copied into a bucket-sized buffer (a ring task's keys that end its chunk,
  rows received from another rank).

Pure host code: nothing here reads device memory.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .base import DocBlocks, Rows

__all__ = ["GraphShape", "GraphShapes", "KeyPairs", "aligned_calls", "backward_plan", "backward_tokens",
           "bucket", "fed_blocks", "key_length_hazard", "needs_bottom_right", "padded_cu_seqlens"]

#: cuDNN versions (``major * 10000 + minor * 100 + patch``) whose backward can return NaN dQ for key lengths
#: 64 mod 128 (fixed in 9.26)
_NAN_DQ_FIXED = 92600
#: smallest bucketed longest-sequence and token total (the op's tiles are 128 rows)
_MIN_LENGTH = 128
#: a built shape serves a smaller call when its grid (documents x longest sequence) is at most this many
#: times the call's own bucketed grid, and (a copied side) its rows at most this many times the bucket
_REUSE_GRID = 4
_REUSE_TOKENS = 2
#: shapes remembered per static key (the op caches 128 graphs in all)
_REMEMBERED = 24


def key_length_hazard(cudnn_version: int) -> bool:
    """Whether backward calls must avoid key lengths that are 64 mod 128 on this cuDNN."""
    return cudnn_version < _NAN_DQ_FIXED


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least ``n`` and ``floor``."""
    n = max(n, floor, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class GraphShape:
    """The shape of one op graph: ``docs`` sequences (``cu_seqlens`` of ``docs + 1`` entries), ``max_len``
    the longest query and key sequence it declares, ``q_tokens`` / ``k_tokens`` the rows of the
    backward's query-side and key-side tensors (0 in forward, whose graph does not depend on them)."""

    docs: int
    max_len: int
    q_tokens: int = 0
    k_tokens: int = 0

    @property
    def grid(self) -> int:
        return self.docs * self.max_len

    @classmethod
    def bucketed(cls, blocks: DocBlocks, tokens: tuple[int, int] = (0, 0)) -> GraphShape:
        """The bucketed shape of a call over ``blocks`` with backward tensors of ``tokens`` rows."""
        return cls(bucket(blocks.num_blocks), bucket(max(blocks.max_q, blocks.max_k), _MIN_LENGTH), *tokens)


_Span = tuple[int, int]  # the token counts [lo, hi] a side's tensor may have
#: a tensor whose rows all go to the op keeps its own row count as the graph's when that count is a multiple
#: of this (a run's local length: one graph for every call); other counts are rounded up to a bucket
_WHOLE_UNIT = 1024


def backward_tokens(rows: Rows, total: int, tensor_rows: int, storage_rows: int) -> tuple[int, _Span]:
    """The rows of one side's backward tensor for ``total`` fed ``rows`` of a tensor of ``tensor_rows`` rows
    followed in its storage by ``storage_rows - tensor_rows`` more, and the span of counts an already built
    graph may have for that side (see the module docstring): the bucket where the storage reaches it from
    the first fed row (a view; any count up to what it reaches), the tensor's own rows where they are all
    fed and their count is a multiple of :data:`_WHOLE_UNIT` (a view), else the bucket (copied; up to
    :data:`_REUSE_TOKENS` times it)."""
    need = bucket(total, _MIN_LENGTH)
    if isinstance(rows, slice):
        if rows.start + need <= storage_rows:
            return need, (total, storage_rows - rows.start)
        if rows.start == 0 and rows.stop == tensor_rows and tensor_rows % _WHOLE_UNIT == 0:
            return tensor_rows, (tensor_rows, tensor_rows)
    return need, (need, _REUSE_TOKENS * need)


class GraphShapes:
    """The graph shapes this process has asked the op for, per static key (device, dtype, heads, head dims,
    scale, mask flags, forward or backward); :meth:`choose` picks the shape of a call."""

    def __init__(self) -> None:
        self._shapes: dict[tuple, OrderedDict[GraphShape, None]] = {}

    def choose(self, static: tuple, need: GraphShape, spans: tuple[_Span, _Span] | None = None) -> GraphShape:
        """The smallest remembered shape covering ``need`` within the reuse bounds (its token counts inside
        ``spans``; None: equal to ``need``'s), else ``need`` itself (then remembered; the least recently
        chosen shape of the key is forgotten past :data:`_REMEMBERED`)."""
        shapes = self._shapes.setdefault(static, OrderedDict())
        spans = spans or ((need.q_tokens, need.q_tokens), (need.k_tokens, need.k_tokens))
        (q_lo, q_hi), (k_lo, k_hi) = spans
        fits = [s for s in shapes if s.docs >= need.docs and s.max_len >= need.max_len
                and s.grid <= _REUSE_GRID * need.grid and q_lo <= s.q_tokens <= q_hi
                and k_lo <= s.k_tokens <= k_hi]
        chosen = min(fits, key=lambda s: (s.grid, s.q_tokens + s.k_tokens)) if fits else need
        shapes[chosen] = None
        shapes.move_to_end(chosen, last=False)
        while len(shapes) > _REMEMBERED:
            shapes.popitem()
        return chosen

    def __len__(self) -> int:
        return sum(len(s) for s in self._shapes.values())

    def clear(self) -> None:
        self._shapes.clear()


# --- plans of a layout, cached per blocks object -------------------------------------------------------

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cu: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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

    def cumulative(lens: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)

    q_rows = _pick(blocks.q_rows, _positions([(qa, m) for qa, m, _, _ in parts]), device)
    k_rows = _pick(blocks.k_rows, _positions([(ka, n) for _, _, ka, n in parts]), device)
    return DocBlocks(q_lens, k_lens, q_rows, k_rows, cumulative(q_lens), cumulative(k_lens), causal)


def padded_cu_seqlens(blocks: DocBlocks, docs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks``' cumulative query and key lengths padded to ``docs`` sequences with empty ones (the last
    total repeated), int32 on the blocks' device; cached."""
    per_blocks = _cu.setdefault(blocks, {})
    if docs not in per_blocks:
        extra = docs - blocks.num_blocks
        if extra < 0:
            raise ValueError(f"a graph of {docs} sequences cannot take {blocks.num_blocks} blocks.")
        per_blocks[docs] = tuple(torch.cat([cu, cu[-1:].expand(extra)]) for cu in (blocks.cu_q, blocks.cu_k))
    return per_blocks[docs]
