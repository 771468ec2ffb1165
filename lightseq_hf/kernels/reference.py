"""Blockwise attention in plain PyTorch: the exact, portable backend.

Never builds a score matrix larger than ``block_q x block_k`` per (batch, head);
accumulates in float32 (float64 inputs stay float64); GQA reads key/value heads
through a grouped view, never a copy.
"""

from __future__ import annotations

import math

import torch

from .base import attention_delta, check_key_range, merge_into


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


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, s, h, d) -> (b, s, kv_heads, group, d), a view."""
    b, s, h, d = q.shape
    return q.view(b, s, kv_heads, h // kv_heads, d)


class ReferenceKernel:
    """Exact blockwise attention in PyTorch (CPU or GPU, any head dim, any dtype)."""

    name = "reference"
    supports_key_range = True

    def __init__(self, block_q: int = 512, block_k: int = 512) -> None:
        self.block_q = block_q
        self.block_k = block_k

    def forward(self, q, k, v, *, causal, scale, out=None, lse=None, key_range=None):
        check_key_range(key_range, q, k, causal)
        b, lq, h, d = q.shape
        lk, hk = k.shape[1], k.shape[2]
        acc = _acc_dtype(q.dtype)
        shift = lk - lq
        chunk_out = torch.empty(b, lq, h, d, dtype=acc, device=q.device)
        chunk_lse = torch.empty(b, h, lq, dtype=acc, device=q.device)
        qg = _grouped(q, hk)
        for q0 in range(0, lq, self.block_q):
            q1 = min(q0 + self.block_q, lq)
            qb = qg[:, q0:q1].to(acc)  # (b, m, hk, g, d)
            m_run = torch.full((b, hk, h // hk, q1 - q0), -math.inf, dtype=acc, device=q.device)
            l_run = torch.zeros_like(m_run)
            o_run = torch.zeros(b, hk, h // hk, q1 - q0, d, dtype=acc, device=q.device)
            k_start, k_stop = (0, min(lk, q1 + shift) if causal else lk) if key_range is None else \
                _key_span(key_range, q0, q1)
            for k0 in range(k_start, max(k_stop, k_start), self.block_k):
                k1 = min(k0 + self.block_k, k_stop)
                if key_range is not None:
                    mask = _range_mask(*key_range, q0, q1, k0, k1)
                    if not bool(mask.any()):
                        continue
                kb = k[:, k0:k1].to(acc)
                vb = v[:, k0:k1].to(acc)
                s = torch.einsum("bmhgd,bnhd->bhgmn", qb, kb) * scale
                if key_range is not None:
                    s = s.masked_fill(~mask[:, None, None], -math.inf)
                elif causal and k1 - 1 > q0 + shift:
                    mask = _causal_mask(q0, q1, k0, k1, shift, q.device)
                    s = s.masked_fill(~mask, -math.inf)
                m_new = torch.maximum(m_run, s.amax(dim=-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m_run - m_safe)
                l_run = l_run * alpha + p.sum(dim=-1)
                o_run = o_run * alpha[..., None] + torch.einsum("bhgmn,bnhd->bhgmd", p, vb)
                m_run = m_new
            seen = l_run != 0  # a row that saw no key: 0; a NaN row stays NaN (out and lse)
            l_safe = torch.where(seen, l_run, torch.ones_like(l_run))
            o_blk = o_run / l_safe[..., None]
            lse_blk = torch.where(seen, m_run + torch.log(l_safe), torch.full_like(l_run, -math.inf))
            chunk_out[:, q0:q1] = o_blk.permute(0, 3, 1, 2, 4).reshape(b, q1 - q0, h, d)
            chunk_lse[:, :, q0:q1] = lse_blk.reshape(b, h, q1 - q0)
        if out is None:
            return chunk_out.to(q.dtype), chunk_lse.float() if acc != torch.float64 else chunk_lse
        merge_into(out, lse, chunk_out, chunk_lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, delta=None, dq=None, dk=None, dv=None,
                 key_range=None):
        check_key_range(key_range, q, k, causal)
        b, lq, h, d = q.shape
        lk, hk = k.shape[1], k.shape[2]
        g = h // hk
        acc = _acc_dtype(q.dtype)
        shift = lk - lq
        if delta is None:
            delta = attention_delta(dout, out)
        dq_c = torch.zeros(b, lq, h, d, dtype=acc, device=q.device)
        dk_c = torch.zeros(b, lk, hk, d, dtype=acc, device=q.device)
        dv_c = torch.zeros(b, lk, hk, d, dtype=acc, device=q.device)
        qg, dog = _grouped(q, hk), _grouped(dout, hk)
        for q0 in range(0, lq, self.block_q):
            q1 = min(q0 + self.block_q, lq)
            qb = qg[:, q0:q1].to(acc)
            dob = dog[:, q0:q1].to(acc)
            lse_b = lse[:, :, q0:q1].to(acc).reshape(b, hk, g, q1 - q0)
            lse_b = torch.where(torch.isinf(lse_b), torch.full_like(lse_b, math.inf), lse_b)
            delta_b = delta[:, :, q0:q1].to(acc).reshape(b, hk, g, q1 - q0)
            dq_b = torch.zeros(b, hk, g, q1 - q0, d, dtype=acc, device=q.device)
            k_start, k_stop = (0, min(lk, q1 + shift) if causal else lk) if key_range is None else \
                _key_span(key_range, q0, q1)
            for k0 in range(k_start, max(k_stop, k_start), self.block_k):
                k1 = min(k0 + self.block_k, k_stop)
                if key_range is not None:
                    mask = _range_mask(*key_range, q0, q1, k0, k1)
                    if not bool(mask.any()):
                        continue
                kb = k[:, k0:k1].to(acc)
                vb = v[:, k0:k1].to(acc)
                s = torch.einsum("bmhgd,bnhd->bhgmn", qb, kb) * scale
                p = torch.exp(s - lse_b[..., None])
                if key_range is not None:
                    p = p.masked_fill(~mask[:, None, None], 0.0)
                elif causal and k1 - 1 > q0 + shift:
                    mask = _causal_mask(q0, q1, k0, k1, shift, q.device)
                    p = p.masked_fill(~mask, 0.0)
                dv_c[:, k0:k1] += torch.einsum("bhgmn,bmhgd->bnhd", p, dob)
                dp = torch.einsum("bmhgd,bnhd->bhgmn", dob, vb)
                ds = p * (dp - delta_b[..., None]) * scale
                dq_b += torch.einsum("bhgmn,bnhd->bhgmd", ds, kb)
                dk_c[:, k0:k1] += torch.einsum("bhgmn,bmhgd->bnhd", ds, qb)
            dq_c[:, q0:q1] = dq_b.permute(0, 3, 1, 2, 4).reshape(b, q1 - q0, h, d)
        grads = []
        for given, computed in ((dq, dq_c), (dk, dk_c), (dv, dv_c)):
            if given is None:
                grads.append(computed if acc == torch.float64 else computed.float())
            else:
                given += computed
                grads.append(given)
        return tuple(grads)
