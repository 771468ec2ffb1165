"""Triton FlashAttention backward: delta preprocess, dk/dv and dq kernels.

The kernels consume the *global* ``out``/``lse`` of the query rows, so the gradients
of each key chunk add up to the full gradient. GQA: a dk/dv program owns one key/value
head and loops over the query heads of its group; nothing is expanded.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    RCP_LN2,
    configs,
    in_range,
    key_block_bounds,
    ranged_tiles,
    row_tiles,
    tune_bench,
    visible,
)

__all__ = ["DKDV_CONFIGS", "DQ_CONFIGS"]

DKDV_CONFIGS = configs(
    [(32, 128, 8, 3), (32, 64, 8, 3), (64, 128, 8, 3), (32, 128, 8, 2)],
    interp=(16, 32),
)
DQ_CONFIGS = configs(
    [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2)],
    interp=(32, 16),
)


@triton.jit
def _delta_kernel(Out, DOut, Delta,  #
                  sob, sos, soh, sod,  #
                  sdb, sds, sdh, sdd,  #
                  seb, seh, ses,  #
                  Lq,  #
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """``delta = rowsum(dout * out)`` in float32, (batch, heads, q_len)."""
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = Out + b * sob + h * soh + offs_m[:, None].to(tl.int64) * sos + offs_d[None, :] * sod
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do_ptrs = DOut + b * sdb + h * sdh + offs_m[:, None].to(tl.int64) * sds + offs_d[None, :] * sdd
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + b * seb + h * seh + offs_m * ses, tl.sum(o * do, 1), mask=offs_m < Lq)


@triton.jit
def _dkdv_inner(dk, dv, k, v,  #
                desc_q, desc_do, b, h,  #
                lse_ptrs, delta_ptrs, sls, ses,  #
                start, stop, offs_m, offs_n,  #
                Lq, shift, qk_scale,  #
                PREC: tl.constexpr, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr,  #
                MASK: tl.constexpr, FROM_ROW0: tl.constexpr,  #
                KLo=None, KHi=None, r_base=0):
    """Add the query blocks ``[start, stop)`` to a key block's dk/dv (transposed: keys are rows).

    ``lse_ptrs``/``delta_ptrs`` address the rows of block ``start`` and advance a block per step (returned
    advanced); with ``FROM_ROW0`` they address row 0 and each block offsets them by its first row instead.
    ``MASK``: the blocks hold hidden pairs: keys outside ``[KLo[r_base + i], KHi[r_base + i])`` for query
    row ``i`` when the ranges are given (``r_base``: this batch's first row), else keys after the diagonal."""
    for start_m in range(start, stop, BLOCK_M):
        if FROM_ROW0:
            lse_blk, delta_blk = lse_ptrs + start_m * sls, delta_ptrs + start_m * ses
        else:
            lse_blk, delta_blk = lse_ptrs, delta_ptrs
        m_ok = (start_m + offs_m) < Lq
        q = desc_q.load([b, start_m, h, 0]).reshape([BLOCK_M, D_PAD])
        do = desc_do.load([b, start_m, h, 0]).reshape([BLOCK_M, D_PAD])
        lse = tl.load(lse_blk, mask=m_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * RCP_LN2
        delta = tl.load(delta_blk, mask=m_ok, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC)
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if MASK:
            if KLo is not None:
                rows = start_m + offs_m
                row_lo = tl.load(KLo + r_base + rows, mask=m_ok, other=0)
                row_hi = tl.load(KHi + r_base + rows, mask=m_ok, other=0)
                pT = tl.where(tl.trans(in_range(row_lo, row_hi, offs_n)), pT, 0.0)
            else:
                pT = tl.where((start_m + offs_m)[None, :] + shift >= offs_n[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
        if not FROM_ROW0:
            lse_ptrs += BLOCK_M * sls
            delta_ptrs += BLOCK_M * ses
    return dk, dv, lse_ptrs, delta_ptrs


@triton.jit
def _split_rows(start, stop, part, SPLIT, BLOCK_M: tl.constexpr):
    """Rows ``[first, last)`` of the query blocks ``[start, stop)`` (``start`` block-aligned) that part
    ``part`` of ``SPLIT`` handles: contiguous runs of whole blocks."""
    per = tl.cdiv(tl.cdiv(tl.maximum(stop - start, 0), BLOCK_M), SPLIT) * BLOCK_M
    first = tl.minimum(start + part * per, stop)
    last = tl.minimum(first + per, stop)
    return first, last


@triton.autotune(
    configs=DKDV_CONFIGS,
    key=["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "CAUSAL", "ACCUM", "RANGED"],
    restore_value=["DK", "DV"],
    do_bench=tune_bench,
)
@triton.jit(do_not_specialize=["Lq", "Lk", "shift"])
def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV,  #
                   KLo, KHi, QLo, QHi,  #
                   sqb, sqs, sqh, sqd,  #
                   skb, sks, skh, skd,  #
                   svb, svs, svh, svd,  #
                   sdob, sdos, sdoh, sdod,  #
                   slb, slh, sls,  #
                   seb, seh, ses,  #
                   sdkb, sdks, sdkh, sdkd,  #
                   sdvb, sdvs, sdvh, sdvd,  #
                   Lq, Lk, shift, group, qk_scale, scale,  #
                   LQ_BUCKET, LK_BUCKET, SPLIT,  #
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,  #
                   CAUSAL: tl.constexpr, ACCUM: tl.constexpr, PREC: tl.constexpr,  #
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
                   RANGED: tl.constexpr = False):
    """``RANGED``: ``KLo``/``KHi`` ``(batch, Lq)`` give each query row its keys ``[lo, hi)``, ``QLo``/``QHi``
    ``(batch, Lk)`` each key its query rows (int32, contiguous, non-decreasing); else all ``None``.

    ``SPLIT`` (``RANGED`` only; else 1) programs share a key block, each over a contiguous part of its query
    blocks (grid axis 2 is ``batch * SPLIT``), and write their partial dk/dv at batch index
    ``batch * SPLIT + part`` of ``DK``/``DV`` (the caller sums the parts); with 1 that is the batch."""
    pid_n = tl.program_id(0)  # causal: the first key blocks see the most rows, and start first
    hk = tl.program_id(1)
    pid_b = tl.program_id(2)
    part = pid_b % SPLIT
    b32 = pid_b // SPLIT
    b = b32.to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d[None, :] < HEAD_DIM
    kv_mask = (offs_n[:, None] < Lk) & mask_d

    k_ptrs = K + b * skb + hk.to(tl.int64) * skh + offs_n[:, None].to(tl.int64) * sks + offs_d[None, :] * skd
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v_ptrs = V + b * svb + hk.to(tl.int64) * svh + offs_n[:, None].to(tl.int64) * svs + offs_d[None, :] * svd
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)

    if RANGED:
        n_b = tl.num_programs(2) // SPLIT
        n_h = tl.num_programs(1) * group
        desc_q = row_tiles(Q, n_b, Lq, n_h, sqb, sqs, sqh, HEAD_DIM, BLOCK_M, D_PAD)
        desc_do = row_tiles(DO, n_b, Lq, n_h, sdob, sdos, sdoh, HEAD_DIM, BLOCK_M, D_PAD)
        n_ok = offs_n < Lk
        col_lo = tl.load(QLo + b * Lk + offs_n, mask=n_ok, other=0)
        col_hi = tl.load(QHi + b * Lk + offs_n, mask=n_ok, other=0)
        start, full_lo, full_hi, stop = ranged_tiles(col_lo, col_hi, n_ok, BLOCK_M)
        first, last = _split_rows(start, stop, part, SPLIT, BLOCK_M)
        r_base = b * Lq
        # this part's query blocks: masked ones before and after the unmasked run [full_lo, full_hi)
        a0, a1 = tl.maximum(start, first), tl.minimum(full_lo, last)
        b0, b1 = tl.maximum(full_lo, first), tl.minimum(full_hi, last)
        c0, c1 = tl.maximum(full_hi, first), tl.minimum(stop, last)
        for g in range(group):
            h32 = hk * group + g
            h = h32.to(tl.int64)
            lse_base = Lse + b * slb + h * slh + offs_m.to(tl.int64) * sls
            delta_base = Delta + b * seb + h * seh + offs_m.to(tl.int64) * ses
            dk, dv, _, _ = _dkdv_inner(dk, dv, k, v, desc_q, desc_do, b32, h32,  #
                                       lse_base, delta_base, sls, ses,  #
                                       a0, a1, offs_m, offs_n, Lq, shift, qk_scale,  #
                                       PREC, BLOCK_M, D_PAD, MASK=True, FROM_ROW0=True,  #
                                       KLo=KLo, KHi=KHi, r_base=r_base)
            dk, dv, _, _ = _dkdv_inner(dk, dv, k, v, desc_q, desc_do, b32, h32,  #
                                       lse_base, delta_base, sls, ses,  #
                                       b0, b1, offs_m, offs_n, Lq, shift, qk_scale,  #
                                       PREC, BLOCK_M, D_PAD, MASK=False, FROM_ROW0=True,  #
                                       KLo=KLo, KHi=KHi, r_base=r_base)
            dk, dv, _, _ = _dkdv_inner(dk, dv, k, v, desc_q, desc_do, b32, h32,  #
                                       lse_base, delta_base, sls, ses,  #
                                       c0, c1, offs_m, offs_n, Lq, shift, qk_scale,  #
                                       PREC, BLOCK_M, D_PAD, MASK=True, FROM_ROW0=True,  #
                                       KLo=KLo, KHi=KHi, r_base=r_base)
    else:
        # Query blocks [lo, mid) straddle the causal diagonal; [mid, end) see every key of the block.
        end = tl.cdiv(Lq, BLOCK_M) * BLOCK_M
        if CAUSAL:
            lo = (tl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
            mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
            lo = tl.minimum(lo, end)
            mid = tl.minimum(tl.maximum(mid, lo), end)
        else:  # no query block straddles a diagonal
            lo = 0
            mid = 0

        n_b = tl.num_programs(2)
        n_h = tl.num_programs(1) * group
        desc_q = row_tiles(Q, n_b, Lq, n_h, sqb, sqs, sqh, HEAD_DIM, BLOCK_M, D_PAD)
        desc_do = row_tiles(DO, n_b, Lq, n_h, sdob, sdos, sdoh, HEAD_DIM, BLOCK_M, D_PAD)
        b32 = tl.program_id(2)
        for g in range(group):
            h32 = hk * group + g
            h = h32.to(tl.int64)
            lse_ptrs = Lse + b * slb + h * slh + (lo + offs_m).to(tl.int64) * sls
            delta_ptrs = Delta + b * seb + h * seh + (lo + offs_m).to(tl.int64) * ses
            dk, dv, lse_ptrs, delta_ptrs = _dkdv_inner(dk, dv, k, v, desc_q, desc_do, b32, h32,  #
                                                       lse_ptrs, delta_ptrs, sls, ses,  #
                                                       lo, mid, offs_m, offs_n, Lq, shift, qk_scale,  #
                                                       PREC, BLOCK_M, D_PAD, MASK=True, FROM_ROW0=False)
            dk, dv, _, _ = _dkdv_inner(dk, dv, k, v, desc_q, desc_do, b32, h32,  #
                                       lse_ptrs, delta_ptrs, sls, ses,  #
                                       mid, end, offs_m, offs_n, Lq, shift, qk_scale,  #
                                       PREC, BLOCK_M, D_PAD, MASK=False, FROM_ROW0=False)

    dk = dk * scale
    b_out = pid_b.to(tl.int64)  # the batch, or (split) the part's slot
    rows_n = offs_n[:, None].to(tl.int64)
    dk_ptrs = DK + b_out * sdkb + hk.to(tl.int64) * sdkh + rows_n * sdks + offs_d[None, :] * sdkd
    dv_ptrs = DV + b_out * sdvb + hk.to(tl.int64) * sdvh + rows_n * sdvs + offs_d[None, :] * sdvd
    if ACCUM:
        dk += tl.load(dk_ptrs, mask=kv_mask, other=0.0)
        dv += tl.load(dv_ptrs, mask=kv_mask, other=0.0)
    tl.store(dk_ptrs, dk, mask=kv_mask)
    tl.store(dv_ptrs, dv, mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta,  #
              desc_k, desc_v, b, hk,  #
              start, stop, offs_m, offs_n,  #
              Lk, shift, qk_scale,  #
              PREC: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,  #
              MASK: tl.constexpr, CAUSAL: tl.constexpr,  #
              row_lo=None, row_hi=None):
    """Add the key blocks ``[start, stop)`` to a query block's dq; ``MASK`` as in ``_fwd_inner``: per-row key
    ranges ``[row_lo[i], row_hi[i])`` when given, else the sequence end and (``CAUSAL``) the diagonal."""
    for start_n in range(start, stop, BLOCK_N):
        k = desc_k.load([b, start_n, hk, 0]).reshape([BLOCK_N, D_PAD])
        v = desc_v.load([b, start_n, hk, 0]).reshape([BLOCK_N, D_PAD])
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASK:
            if row_lo is not None:
                keep = in_range(row_lo, row_hi, start_n + offs_n)
            else:
                keep = visible(offs_m, offs_n, start_n, Lk, shift, CAUSAL=CAUSAL)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.autotune(
    configs=DQ_CONFIGS,
    key=["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "CAUSAL", "ACCUM", "RANGED"],
    restore_value=["DQ"],
    do_bench=tune_bench,
)
@triton.jit(do_not_specialize=["Lq", "Lk", "shift"])
def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ,  #
                 KLo, KHi,  #
                 sqb, sqs, sqh, sqd,  #
                 skb, sks, skh, skd,  #
                 svb, svs, svh, svd,  #
                 sdob, sdos, sdoh, sdod,  #
                 slb, slh, sls,  #
                 seb, seh, ses,  #
                 sdqb, sdqs, sdqh, sdqd,  #
                 Lq, Lk, shift, group, qk_scale, scale,  #
                 LQ_BUCKET, LK_BUCKET,  #
                 HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,  #
                 CAUSAL: tl.constexpr, ACCUM: tl.constexpr, PREC: tl.constexpr,  #
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  #
                 RANGED: tl.constexpr = False):
    """``RANGED``: ``KLo``/``KHi`` (int32 ``(batch, Lq)``) give each query row its keys; else ``None``."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = h // group
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d[None, :] < HEAD_DIM
    mask_m = offs_m < Lq
    qmask = mask_m[:, None] & mask_d

    row = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + b * sqb + h * sqh + row * sqs + offs_d[None, :] * sqd, mask=qmask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + row * sdos + offs_d[None, :] * sdod, mask=qmask, other=0.0)
    lse = tl.load(Lse + b * slb + h * slh + offs_m.to(tl.int64) * sls, mask=mask_m, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * RCP_LN2
    delta = tl.load(Delta + b * seb + h * seh + offs_m.to(tl.int64) * ses, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)

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
        dq = _dq_inner(dq, q, do, lse, delta, desc_k, desc_v, b32, hk,  #
                       start, full_lo, offs_m, offs_n, Lk, shift, qk_scale,  #
                       PREC, BLOCK_N, D_PAD, MASK=True, CAUSAL=CAUSAL, row_lo=row_lo, row_hi=row_hi)
        dq = _dq_inner(dq, q, do, lse, delta, desc_k, desc_v, b32, hk,  #
                       full_lo, full_hi, offs_m, offs_n, Lk, shift, qk_scale,  #
                       PREC, BLOCK_N, D_PAD, MASK=False, CAUSAL=CAUSAL, row_lo=row_lo, row_hi=row_hi)
        dq = _dq_inner(dq, q, do, lse, delta, desc_k, desc_v, b32, hk,  #
                       full_hi, stop, offs_m, offs_n, Lk, shift, qk_scale,  #
                       PREC, BLOCK_N, D_PAD, MASK=True, CAUSAL=CAUSAL, row_lo=row_lo, row_hi=row_hi)
    else:
        full_hi, hi = key_block_bounds(m0, Lq, Lk, shift, BLOCK_M, BLOCK_N, CAUSAL=CAUSAL)
        n_b = tl.num_programs(2)
        n_hk = tl.num_programs(1) // group
        desc_k = row_tiles(K, n_b, Lk, n_hk, skb, sks, skh, HEAD_DIM, BLOCK_N, D_PAD)
        desc_v = row_tiles(V, n_b, Lk, n_hk, svb, svs, svh, HEAD_DIM, BLOCK_N, D_PAD)
        b32 = tl.program_id(2)
        # key blocks [0, full_hi) see every key; [full_hi, hi) straddle the diagonal or the sequence end
        dq = _dq_inner(dq, q, do, lse, delta, desc_k, desc_v, b32, hk,  #
                       0, full_hi, offs_m, offs_n, Lk, shift, qk_scale,  #
                       PREC, BLOCK_N, D_PAD, MASK=False, CAUSAL=CAUSAL)
        dq = _dq_inner(dq, q, do, lse, delta, desc_k, desc_v, b32, hk,  #
                       full_hi, hi, offs_m, offs_n, Lk, shift, qk_scale,  #
                       PREC, BLOCK_N, D_PAD, MASK=True, CAUSAL=CAUSAL)

    dq = dq * scale
    dq_ptrs = DQ + b * sdqb + h * sdqh + row * sdqs + offs_d[None, :] * sdqd
    if ACCUM:
        dq += tl.load(dq_ptrs, mask=qmask, other=0.0)
    tl.store(dq_ptrs, dq, mask=qmask)
