"""Blockwise attention in plain PyTorch: the exact, portable backend.

Never builds a score matrix larger than ``block_q x block_k`` per (batch, head); accumulates in float32
(float64 inputs stay float64); GQA reads key/value heads through a grouped view, never a copy. Takes
every mask kind, logit soft-capping and a value head dim of its own.

Non-finite inputs stay with the pairs that see them: a product over keys (or rows) skips the pairs the
mask hides, so a NaN in one document's values, or in a padding token, never turns another document's
outputs or gradients into NaN (a plain matrix product would: 0 x NaN is NaN).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .base import AttentionMask, Capabilities, KernelBase, check_key_range
from .row_stats import attention_delta, merge_into
from .working_memory import BackwardMemory, Workspace

__all__ = ["ReferenceKernel"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, shift: int, device) -> torch.Tensor:
    """True where query row i may see key j (bottom-right aligned: j <= i + shift)."""
    rows = torch.arange(q_start, q_stop, device=device)[:, None]
    cols = torch.arange(k_start, k_stop, device=device)[None, :]
    return cols <= rows + shift


def _range_mask(lo: torch.Tensor, hi: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """``(batch, m, n)``: True where query row i of ``[q0, q1)`` sees key j of ``[k0, k1)``
    (``lo[i] <= j < hi[i]``)."""
    cols = torch.arange(k0, k1, device=lo.device)[None, None, :]
    return (cols >= lo[:, q0:q1, None]) & (cols < hi[:, q0:q1, None])


def _key_span(key_range, q0: int, q1: int) -> tuple[int, int]:
    """Keys ``[start, stop)`` any of the query rows ``[q0, q1)`` may see (ranges are monotone)."""
    lo, hi = key_range
    return int(lo[:, q0].min()), int(hi[:, q1 - 1].max())


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, s, h, d) -> (b, s, kv_heads, group, d), a view."""
    b, s, h, d = x.shape
    return x.view(b, s, kv_heads, h // kv_heads, d)


def _nonfinite(x: torch.Tensor) -> torch.Tensor | None:
    """Where ``x`` is NaN or infinite, or None when it is finite everywhere (the usual case)."""
    bad = ~torch.isfinite(x)
    return bad if bool(bad.any()) else None


def _scores(qb, kb, scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``(b, hk, g, m, n)`` of a block and, with ``softcap``, ``tanh(raw / softcap)`` (for the
    backward: d capped / d raw = 1 - tanh^2)."""
    s = torch.einsum("bmhgd,bnhd->bhgmn", qb, kb) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, t


def _to_rows(w: torch.Tensor, x: torch.Tensor, bad: torch.Tensor | None, vis: torch.Tensor | None):
    """``sum_n w[b,h,g,m,n] x[b,n,h,d]`` -> ``(b, h, g, m, d)``; a non-finite ``x[n]`` reaches only the rows
    that see key ``n`` (``vis``: ``(b, m, n)``, None when every pair is visible)."""
    if bad is None or vis is None:
        return torch.einsum("bhgmn,bnhd->bhgmd", w, x)
    y = torch.einsum("bhgmn,bnhd->bhgmd", w, x.masked_fill(bad, 0))
    hit = torch.einsum("bmn,bnhd->bhmd", vis.to(y.dtype), bad.to(y.dtype)) > 0
    return y.masked_fill(hit[:, :, None], math.nan)


def _to_keys(w: torch.Tensor, x: torch.Tensor, bad: torch.Tensor | None, vis: torch.Tensor | None):
    """``sum_{g,m} w[b,h,g,m,n] x[b,m,h,g,d]`` -> ``(b, n, h, d)``; a non-finite ``x[m]`` reaches only the
    keys that row ``m`` sees."""
    if bad is None or vis is None:
        return torch.einsum("bhgmn,bmhgd->bnhd", w, x)
    y = torch.einsum("bhgmn,bmhgd->bnhd", w, x.masked_fill(bad, 0))
    hit = torch.einsum("bmn,bmhgd->bnhd", vis.to(y.dtype), bad.to(y.dtype)) > 0
    return y.masked_fill(hit, math.nan)


class ReferenceKernel(KernelBase):
    """Exact blockwise attention in PyTorch (any device, head dim and dtype)."""

    name = "reference"
    capabilities = Capabilities(
        devices=None,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        supports_key_range=True,
        supports_window=True,
        supports_softcap=True,
        supports_value_head_dim=True,
        # its float32 dq/dk/dv and one block pair's scores, probabilities and gradients with the
        # temporaries between them (7 of them at once, measured on the CPU: tests/test_planner.py)
        backward_memory=BackwardMemory("reference kernel", workspace=(
            Workspace("accumulators, one block pair", "qkv", "float32", tiles=7, tile=512),)),
    )

    def __init__(self, block_q: int = 512, block_k: int = 512) -> None:
        self.block_q = block_q
        self.block_k = block_k

    def _key_blocks(self, mask: AttentionMask, q0: int, q1: int, lk: int, shift: int, batch: int,
                    device) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        """``(k0, k1, visible)`` for the key blocks rows ``[q0, q1)`` may see; ``visible`` is ``(batch, m,
        n)`` bool, or None when every pair of the block is visible. Blocks with no visible pair are
        skipped."""
        if mask.key_range is not None:
            start, stop = _key_span(mask.key_range, q0, q1)
        else:
            start, stop = 0, min(lk, q1 + shift) if mask.causal else lk
        for k0 in range(start, max(stop, start), self.block_k):
            k1 = min(k0 + self.block_k, stop)
            vis = None
            if mask.key_range is not None:
                vis = _range_mask(*mask.key_range, q0, q1, k0, k1)
                if not bool(vis.any()):
                    continue
            elif mask.causal and k1 - 1 > q0 + shift:
                vis = _causal_mask(q0, q1, k0, k1, shift, device).expand(batch, -1, -1)
            yield k0, k1, vis

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        check_key_range(mask.key_range, q)
        b, lq, h, _ = q.shape
        lk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
        acc = _acc_dtype(q.dtype)
        chunk_out = torch.empty(b, lq, h, dv, dtype=acc, device=q.device)
        chunk_lse = torch.empty(b, h, lq, dtype=acc, device=q.device)
        bad_v = _nonfinite(v)
        qg = _grouped(q, hk)
        for q0 in range(0, lq, self.block_q):
            q1 = min(q0 + self.block_q, lq)
            qb = qg[:, q0:q1].to(acc)  # (b, m, hk, g, d)
            m_run = torch.full((b, hk, h // hk, q1 - q0), -math.inf, dtype=acc, device=q.device)
            l_run = torch.zeros_like(m_run)
            o_run = torch.zeros(b, hk, h // hk, q1 - q0, dv, dtype=acc, device=q.device)
            for k0, k1, vis in self._key_blocks(mask, q0, q1, lk, lk - lq, b, q.device):
                s, _ = _scores(qb, k[:, k0:k1].to(acc), scale, mask.softcap)
                if vis is not None:
                    s = s.masked_fill(~vis[:, None, None], -math.inf)
                m_new = torch.maximum(m_run, s.amax(dim=-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m_run - m_safe)
                l_run = l_run * alpha + p.sum(dim=-1)
                bad = None if bad_v is None else bad_v[:, k0:k1]
                o_run = o_run * alpha[..., None] + _to_rows(p, v[:, k0:k1].to(acc), bad, vis)
                m_run = m_new
            seen = l_run != 0  # a row that saw no key: 0; a NaN row stays NaN (out and lse)
            l_safe = torch.where(seen, l_run, torch.ones_like(l_run))
            lse_blk = torch.where(seen, m_run + torch.log(l_safe), torch.full_like(l_run, -math.inf))
            o_blk = o_run / l_safe[..., None]
            chunk_out[:, q0:q1] = o_blk.permute(0, 3, 1, 2, 4).reshape(b, q1 - q0, h, dv)
            chunk_lse[:, :, q0:q1] = lse_blk.reshape(b, h, q1 - q0)
        if out is None:
            return chunk_out.to(q.dtype), chunk_lse.float() if acc != torch.float64 else chunk_lse
        merge_into(out, lse, chunk_out, chunk_lse)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        check_key_range(mask.key_range, q)
        b, lq, h, d = q.shape
        lk, hk = k.shape[1], k.shape[2]
        g = h // hk
        acc = _acc_dtype(q.dtype)
        if delta is None:
            delta = attention_delta(dout, out)
        dq_c = torch.zeros(b, lq, h, d, dtype=acc, device=q.device)
        dk_c = torch.zeros(b, lk, hk, d, dtype=acc, device=q.device)
        dv_c = torch.zeros(b, lk, hk, v.shape[3], dtype=acc, device=q.device)
        qg, dog = _grouped(q, hk), _grouped(dout, hk)
        bad_q, bad_k, bad_do = (_nonfinite(x) for x in (qg, k, dog))
        for q0 in range(0, lq, self.block_q):
            q1 = min(q0 + self.block_q, lq)
            qb, dob = qg[:, q0:q1].to(acc), dog[:, q0:q1].to(acc)
            rows_bad_q = None if bad_q is None else bad_q[:, q0:q1]
            rows_bad_do = None if bad_do is None else bad_do[:, q0:q1]
            lse_b = lse[:, :, q0:q1].to(acc).reshape(b, hk, g, q1 - q0)
            lse_b = torch.where(torch.isinf(lse_b), torch.full_like(lse_b, math.inf), lse_b)
            delta_b = delta[:, :, q0:q1].to(acc).reshape(b, hk, g, q1 - q0)
            dq_b = torch.zeros(b, hk, g, q1 - q0, d, dtype=acc, device=q.device)
            for k0, k1, vis in self._key_blocks(mask, q0, q1, lk, lk - lq, b, q.device):
                kb, vb = k[:, k0:k1].to(acc), v[:, k0:k1].to(acc)
                s, t = _scores(qb, kb, scale, mask.softcap)
                p = torch.exp(s - lse_b[..., None])
                hidden = None if vis is None else ~vis[:, None, None]
                if hidden is not None:
                    p = p.masked_fill(hidden, 0.0)
                dv_c[:, k0:k1] += _to_keys(p, dob, rows_bad_do, vis)
                dp = torch.einsum("bmhgd,bnhd->bhgmn", dob, vb)
                ds = p * (dp - delta_b[..., None]) * scale
                if t is not None:
                    ds = ds * (1 - t * t)
                if hidden is not None:  # a hidden pair's dp may be NaN (0 x NaN): keep it out
                    ds = ds.masked_fill(hidden, 0.0)
                dq_b += _to_rows(ds, kb, None if bad_k is None else bad_k[:, k0:k1], vis)
                dk_c[:, k0:k1] += _to_keys(ds, qb, rows_bad_q, vis)
            dq_c[:, q0:q1] = dq_b.permute(0, 3, 1, 2, 4).reshape(b, q1 - q0, h, d)
        grads = []
        for given, computed in ((dq, dq_c), (dk, dk_c), (dv, dv_c)):
            if given is None:
                grads.append(computed if acc == torch.float64 else computed.float())
            else:
                given += computed
                grads.append(given)
        return tuple(grads)
