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
- :class:`GraphShapes`: the op builds one cuDNN graph per (documents, longest sequences, token totals
  rounded to 64, ...) and keeps 128 of them; a build takes 0.1 s. A changing packed stream would build
  on every step, so each call asks for a bucketed shape (documents, longest sequence and, in backward,
  token totals each rounded up to a power of two, query and key sides alike, the documents padded with
  empty ones) or reuses a larger shape already built when that wastes little.

Pure host code: nothing here reads device memory.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .base import DocBlocks, Rows

__all__ = ["GraphShape", "GraphShapes", "KeyPairs", "aligned_calls", "backward_plan", "bucket", "fed_blocks",
           "key_length_hazard", "needs_bottom_right", "padded_cu_seqlens"]

#: cuDNN versions (``major * 10000 + minor * 100 + patch``) whose backward can return NaN dQ for key lengths
#: 64 mod 128 (fixed in 9.26)
NAN_DQ_FIXED = 92600
#: smallest bucketed longest-sequence and token total (the op's tiles are 128 rows)
MIN_LENGTH = 128
#: a built shape serves a smaller call when its grid (documents x longest sequence) is at most this many
#: times the call's own bucketed grid, and its token total at most this many times the call's bucketed total
REUSE_GRID = 4
REUSE_TOKENS = 2
#: shapes remembered per static key (the op caches 128 graphs in all)
REMEMBERED = 24


def key_length_hazard(cudnn_version: int) -> bool:
    """Whether backward calls must avoid key lengths that are 64 mod 128 on this cuDNN."""
    return cudnn_version < NAN_DQ_FIXED


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least ``n`` and ``floor``."""
    n = max(n, floor, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class GraphShape:
    """The shape of one op graph: ``docs`` sequences (``cu_seqlens`` of ``docs + 1`` entries), ``max_len``
    the longest query and key sequence it declares, ``tokens`` the rows of the backward's packed tensors
    (0 in forward, whose graph does not depend on them)."""

    docs: int
    max_len: int
    tokens: int = 0

    def covers(self, other: GraphShape) -> bool:
        return self.docs >= other.docs and self.max_len >= other.max_len and self.tokens >= other.tokens

    @property
    def grid(self) -> int:
        return self.docs * self.max_len

    @classmethod
    def bucketed(cls, blocks: DocBlocks, backward: bool) -> GraphShape:
        """The bucketed shape of a call over ``blocks``."""
        tokens = bucket(max(blocks.total_q, blocks.total_k), MIN_LENGTH) if backward else 0
        return cls(bucket(blocks.num_blocks), bucket(max(blocks.max_q, blocks.max_k), MIN_LENGTH), tokens)


class GraphShapes:
    """The graph shapes this process has asked the op for, per static key (device, dtype, heads, head dims,
    scale, mask flags, forward or backward); :meth:`choose` picks the shape of a call."""

    def __init__(self) -> None:
        self._shapes: dict[tuple, OrderedDict[GraphShape, None]] = {}

    def choose(self, static: tuple, need: GraphShape) -> GraphShape:
        """The smallest remembered shape covering ``need`` within the reuse bounds, else ``need`` itself
        (then remembered; the least recently chosen shape of the key is forgotten past
        :data:`REMEMBERED`)."""
        shapes = self._shapes.setdefault(static, OrderedDict())
        fits = [s for s in shapes if s.covers(need) and s.grid <= REUSE_GRID * need.grid
                and s.tokens <= REUSE_TOKENS * need.tokens]
        chosen = min(fits, key=lambda s: (s.grid, s.tokens)) if fits else need
        shapes[chosen] = None
        shapes.move_to_end(chosen, last=False)
        while len(shapes) > REMEMBERED:
            shapes.popitem()
        return chosen

    def __len__(self) -> int:
        return sum(len(s) for s in self._shapes.values())

    def clear(self) -> None:
        self._shapes.clear()


# --- plans of a layout, cached per blocks object -------------------------------------------------------

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cu: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

Part = tuple[int, int, int, int]  # (first fed row, rows, first fed key, keys), positions in the blocks


def _parts(blocks: DocBlocks) -> list[Part]:
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


def _sub_blocks(blocks: DocBlocks, parts: list[Part], causal: bool) -> DocBlocks:
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
