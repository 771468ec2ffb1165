"""Triton FlashAttention forward that carries softmax statistics (the paper's Algorithm 3).

One program computes ``BLOCK_M`` query rows of one (batch, head) against every key
it may see. In accumulate mode it starts the online softmax from the running
``(out, lse)`` of those rows and writes them back: chunks merge with no extra pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    LN2,
    RCP_LN2,
    configs,
    in_range,
    key_block_bounds,
    ranged_tiles,
    row_tiles,
    tune_bench,
    visible,
)

__all__ = ["FWD_CONFIGS"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages): a short list; the autotuner picks per bucket.
FWD_CONFIGS = configs(
    [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3)],
    interp=(32, 16),
)


@triton.jit
def _fwd_inner(m_i, l_i, acc, q,  #
               desc_k, desc_v, b, hk,  #
               start, stop, offs_m, offs_n,  #
               Lk, shift, qk_scale,  #
               PREC: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,  #
               MASK: tl.constexpr, CAUSAL: tl.constexpr,  #
               row_lo=None, row_hi=None):
    """The online softmax (log2 domain) over the key blocks ``[start, stop)``; K/V tiles come by TMA (zero
    past the edges). ``MASK``: the blocks hold hidden pairs: keys outside ``[row_lo[i], row_hi[i])`` for
    query row ``i`` when the ranges are given (document / window masks), else past the sequence end or,
    when ``CAUSAL``, after the diagonal."""
    for start_n in range(start, stop, BLOCK_N):
        k = desc_k.load([b, start_n, hk, 0]).reshape([BLOCK_N, D_PAD])
        v = desc_v.load([b, start_n, hk, 0]).reshape([BLOCK_N, D_PAD])
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if MASK:
            if row_lo is not None:
                keep = in_range(row_lo, row_hi, start_n + offs_n)
            else:
                keep = visible(offs_m, offs_n, start_n, Lk, shift, CAUSAL=CAUSAL)
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = m_new
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.autotune(
    configs=FWD_CONFIGS,
    key=["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "CAUSAL", "ACCUM", "RANGED"],
    restore_value=["Out", "Lse"],
    do_bench=tune_bench,
)
@triton.jit(do_not_specialize=["Lq", "Lk", "shift"])
def _attn_fwd(Q, K, V, Out, Lse,  #
              KLo, KHi,  #
              sqb, sqs, sqh, sqd,  #
              skb, sks, skh, skd,  #
              svb, svs, svh, svd,  #
              sob, sos, soh, sod,  #
              slb, slh, sls,  #
              Lq, Lk, shift, group, qk_scale,  #
              LQ_BUCKET, LK_BUCKET,  #
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,  #
              CAUSAL: tl.constexpr, ACCUM: tl.constexpr, PREC: tl.constexpr,  #
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
              RANGED: tl.constexpr = False):
    """``RANGED``: ``KLo``/``KHi`` (int32, contiguous ``(batch, Lq)``, non-decreasing along rows) give each
    query row its keys ``[lo, hi)``; otherwise they are ``None`` and ``CAUSAL`` decides."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the heaviest query blocks (most keys) start first
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = h // group
    m0 = pid_m * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d[None, :] < HEAD_DIM
    mask_m = offs_m < Lq

    q_base = Q + b * sqb + h.to(tl.int64) * sqh + m0.to(tl.int64) * sqs
    q_ptrs = q_base + tl.arange(0, BLOCK_M)[:, None] * sqs + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d, other=0.0)

    o_base = Out + b * sob + h.to(tl.int64) * soh + m0.to(tl.int64) * sos
    o_ptrs = o_base + tl.arange(0, BLOCK_M)[:, None] * sos + offs_d[None, :] * sod
    lse_ptrs = Lse + b * slb + h.to(tl.int64) * slh + offs_m * sls

    if ACCUM:
        # Continue the running softmax: m = lse (log2), l = 1, acc = normalized running out.
        lse_run = tl.load(lse_ptrs, mask=mask_m, other=float("-inf"))
        m_i = lse_run * RCP_LN2
        l_i = tl.where(lse_run == float("-inf"), 0.0, 1.0)
        acc = tl.load(o_ptrs, mask=mask_m[:, None] & mask_d, other=0.0).to(tl.float32)
        acc = tl.where(l_i[:, None] > 0, acc, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    if RANGED:
        n_b = tl.num_programs(2)
        n_hk = tl.num_programs(1) // group
        desc_k = row_tiles(K, n_b, Lk, n_hk, skb, sks, skh, HEAD_DIM, BLOCK_N, D_PAD)
        desc_v = row_tiles(V, n_b, Lk, n_hk, svb, svs, svh, HEAD_DIM, BLOCK_N, D_PAD)
        b32 = tl.program_id(2)
        r_base = b * Lq
        row_lo = tl.load(KLo + r_base + offs_m, mask=mask_m, other=0)
        row_hi = tl.load(KHi + r_base + offs_m, mask=mask_m, other=0)
        start, full_lo, full_hi, stop = ranged_tiles(row_lo, row_hi, mask_m, BLOCK_N)
        # masked key blocks before and after the unmasked run [full_lo, full_hi)
        m_i, l_i, acc = _fwd_inner(m_i, l_i, acc, q, desc_k, desc_v, b32, hk,  #
                                   start, full_lo, offs_m, offs_n, Lk, shift, qk_scale,  #
                                   PREC, BLOCK_N, D_PAD, MASK=True, CAUSAL=CAUSAL,  #
                                   row_lo=row_lo, row_hi=row_hi)
        m_i, l_i, acc = _fwd_inner(m_i, l_i, acc, q, desc_k, desc_v, b32, hk,  #
                                   full_lo, full_hi, offs_m, offs_n, Lk, shift, qk_scale,  #
                                   PREC, BLOCK_N, D_PAD, MASK=False, CAUSAL=CAUSAL,  #
                                   row_lo=row_lo, row_hi=row_hi)
        m_i, l_i, acc = _fwd_inner(m_i, l_i, acc, q, desc_k, desc_v, b32, hk,  #
                                   full_hi, stop, offs_m, offs_n, Lk, shift, qk_scale,  #
                                   PREC, BLOCK_N, D_PAD, MASK=True, CAUSAL=CAUSAL,  #
                                   row_lo=row_lo, row_hi=row_hi)
    else:
        full_hi, hi = key_block_bounds(m0, Lq, Lk, shift, BLOCK_M, BLOCK_N, CAUSAL=CAUSAL)

        n_b = tl.num_programs(2)
        n_hk = tl.num_programs(1) // group
        desc_k = row_tiles(K, n_b, Lk, n_hk, skb, sks, skh, HEAD_DIM, BLOCK_N, D_PAD)
        desc_v = row_tiles(V, n_b, Lk, n_hk, svb, svs, svh, HEAD_DIM, BLOCK_N, D_PAD)
        b32 = tl.program_id(2)
        # key blocks [0, full_hi) see every key; [full_hi, hi) straddle the diagonal or the sequence end
        m_i, l_i, acc = _fwd_inner(m_i, l_i, acc, q, desc_k, desc_v, b32, hk,  #
                                   0, full_hi, offs_m, offs_n, Lk, shift, qk_scale,  #
                                   PREC, BLOCK_N, D_PAD, MASK=False, CAUSAL=CAUSAL)
        m_i, l_i, acc = _fwd_inner(m_i, l_i, acc, q, desc_k, desc_v, b32, hk,  #
                                   full_hi, hi, offs_m, offs_n, Lk, shift, qk_scale,  #
                                   PREC, BLOCK_N, D_PAD, MASK=True, CAUSAL=CAUSAL)

    seen = l_i != 0.0  # a row that saw no key: 0; a NaN row stays NaN (out and lse)
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d)
    tl.store(lse_ptrs, lse, mask=mask_m)
