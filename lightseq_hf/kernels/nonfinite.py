"""Keep a NaN or infinity inside the rows and keys that see it, for kernels that multiply whole tiles.

A tiled kernel with per-row key ranges (packed documents, windows) multiplies every key of a tile by every
row's probability, zeros included, and ``0 x NaN`` is NaN: one bad value would reach rows of other
documents and the padding. The kernel runs on inputs whose non-finite tokens are zeroed; afterwards a NaN is
written exactly where one belongs: a row's output when the row sees a bad key, a row's dq when it is bad or
sees a bad key, a key's dk/dv when it is bad or a bad row sees it (rows and keys that see nothing stay 0).

Detection costs one read of the inputs and one host synchronisation per call; inputs that are all finite
are passed on untouched (the kernels run bit for bit as without this module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["backward_inputs", "forward_inputs", "poison_backward", "poison_forward"]

_Ranges = tuple[torch.Tensor, torch.Tensor]  # int32 (batch, rows): each row's keys [lo, hi)
_Tensor = torch.Tensor


def _bad_tokens(*tensors: torch.Tensor) -> torch.Tensor:
    """``(batch, seq, heads)`` bool: the tokens with a non-finite value in any of ``tensors`` (same layout
    ``(batch, seq, heads, dim)``); a sum over ``dim`` is non-finite exactly then (short of overflow)."""
    bad = None
    for t in tensors:
        found = ~torch.isfinite(t.sum(-1, dtype=torch.float32))
        bad = found if bad is None else bad | found
    return bad


def _zeroed(t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return t.masked_fill(bad[..., None], 0)


def _seen(bad: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``(batch, rows, heads)`` bool: whether ``[lo, hi)`` of each row (``(batch, rows)``) holds a ``bad``
    entry (``(batch, cols, heads)``), by prefix counts."""
    counts = torch.nn.functional.pad(bad.to(torch.int32).cumsum(1), (0, 0, 1, 0))
    heads = bad.shape[2]
    upper = counts.gather(1, hi.long()[..., None].expand(-1, -1, heads))
    lower = counts.gather(1, lo.long()[..., None].expand(-1, -1, heads))
    return upper > lower


def _to_heads(flags: torch.Tensor, heads: int) -> torch.Tensor:
    """Key-head flags ``(batch, seq, kv_heads)`` repeated for the query heads of each group."""
    return flags.repeat_interleave(heads // flags.shape[2], dim=2)


def _any_group(flags: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Query-head flags ``(batch, seq, heads)`` or-ed over each key head's group."""
    b, s, h = flags.shape
    return flags.view(b, s, kv_heads, h // kv_heads).any(-1)


def forward_inputs(k: _Tensor, v: _Tensor) -> tuple[_Tensor, _Tensor, _Tensor | None]:
    """``(k, v, bad_keys)``: the inputs unchanged and None when all finite, else with the bad keys zeroed."""
    bad = _bad_tokens(k, v)
    if not bool(bad.any()):
        return k, v, None
    return _zeroed(k, bad), _zeroed(v, bad), bad


def poison_forward(out: torch.Tensor, bad_keys: torch.Tensor, key_range: _Ranges) -> None:
    """Write NaN into the output rows that see a bad key (in place)."""
    seen = _seen(bad_keys, *key_range)
    out.masked_fill_(_to_heads(seen, out.shape[2])[..., None], float("nan"))


@dataclass
class _BackwardContainment:
    """The non-finite tokens of one backward call: keys ``(batch, lk, kv_heads)``, rows ``(batch, lq,
    heads)`` (a bad q, dout, lse or delta; a row that sees no key is zeroed but never poisoned)."""

    bad_keys: torch.Tensor
    bad_rows: torch.Tensor


def backward_inputs(q: _Tensor, k: _Tensor, v: _Tensor, dout: _Tensor, lse: _Tensor, delta: _Tensor,
                    ) -> tuple[_Tensor, _Tensor, _Tensor, _Tensor, _Tensor, _Tensor,
                               _BackwardContainment | None]:
    """``(q, k, v, dout, lse, delta, containment)``: unchanged and None when all finite, else the bad
    tokens zeroed (lse and delta of bad rows set to 0) and what was found."""
    bad_keys = _bad_tokens(k, v)
    stats = torch.isfinite(delta) & (torch.isfinite(lse) | (lse == float("-inf")))  # -inf: sees no key
    bad_rows = _bad_tokens(q, dout) | ~stats.transpose(1, 2)
    if not bool(bad_keys.any() | bad_rows.any()):
        return q, k, v, dout, lse, delta, None
    rows_t = bad_rows.transpose(1, 2)
    return (_zeroed(q, bad_rows), _zeroed(k, bad_keys), _zeroed(v, bad_keys), _zeroed(dout, bad_rows),
            lse.masked_fill(rows_t, 0.0), delta.masked_fill(rows_t, 0.0),
            _BackwardContainment(bad_keys, bad_rows))


def poison_backward(found: _BackwardContainment, key_range: _Ranges, query_range: _Ranges,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Write NaN into dq of bad rows and of rows that see a bad key, and into dk/dv of bad keys that a row
    sees and of keys that a bad row sees (in place)."""
    lo, hi = key_range
    has_keys = (hi > lo)[..., None]
    rows = found.bad_rows | _to_heads(_seen(found.bad_keys, lo, hi), dq.shape[2])
    dq.masked_fill_((rows & has_keys)[..., None], float("nan"))
    q_lo, q_hi = query_range
    seen_by_rows = (q_hi > q_lo)[..., None]
    keys = (found.bad_keys & seen_by_rows) | _seen(_any_group(found.bad_rows, dk.shape[2]), q_lo, q_hi)
    for grad in (dk, dv):
        grad.masked_fill_(keys[..., None], float("nan"))
