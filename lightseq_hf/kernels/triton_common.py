"""Helpers shared by the Triton attention kernels: config lists and key-range arithmetic."""

from __future__ import annotations

import os

import triton
import triton.language as tl
import triton.testing

__all__ = ["LN2", "LOG2E", "RCP_LN2", "bucket", "configs", "in_range", "interpreting", "key_block_bounds",
           "ranged_tiles", "row_tiles", "tune_bench", "visible"]

# The kernels run the softmax in base 2 (exp2, log2): the host passes ``scale * LOG2E``, the kernels turn a
# natural-log lse into base 2 with RCP_LN2 (= LOG2E) and back with LN2.
LOG2E = 1.4426950408889634
RCP_LN2 = tl.constexpr(LOG2E)
LN2 = tl.constexpr(0.6931471805599453)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def bucket(n: int) -> int:
    """Autotune bucket of a length: the next power of two (at least 16).

    Passed as an autotune key so that a long run with varying lengths tunes once
    per bucket instead of at every new length.
    """
    return max(16, triton.next_power_of_2(max(int(n), 1)))


def configs(gpu: list[tuple[int, int, int, int]], interp: tuple[int, int]) -> list[triton.Config]:
    """Autotune configs ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``.

    One small config in the interpreter; the GPU configs in order, the first being the default
    (``lightseq_hf._testing.kernel_knobs.single_triton_config`` keeps only that one, for fast tests).
    """
    if interpreting():
        return [triton.Config({"BLOCK_M": interp[0], "BLOCK_N": interp[1]}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in gpu]


@triton.jit
def key_block_bounds(m0, Lq, Lk, shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key block bounds of query rows ``[m0, m0 + BLOCK_M)``.

    Returns ``(full_hi, hi)``: key blocks starting in ``[0, full_hi)`` need no mask
    (every key is valid and visible to every row of the block), blocks in
    ``[full_hi, hi)`` need the causal / sequence-end mask. Bottom-right causal:
    row ``i`` sees key ``j`` when ``j <= i + shift`` with ``shift = Lk - Lq``.
    """
    if CAUSAL:
        end_full = tl.minimum(m0 + shift + 1, Lk)
        hi = tl.minimum(m0 + BLOCK_M + shift, Lk)
    else:
        end_full = Lk
        hi = Lk
    end_full = tl.maximum(end_full, 0)
    hi = tl.maximum(hi, 0)
    full_hi = (end_full // BLOCK_N) * BLOCK_N
    return full_hi, hi


@triton.jit
def visible(offs_m, offs_n, start_n, Lk, shift, CAUSAL: tl.constexpr):
    """Mask of the keys ``start_n + offs_n`` that query rows ``offs_m`` see: inside the sequence
    and, when causal, at most ``row + shift`` (bottom-right alignment, as in :func:`key_block_bounds`)."""
    cols = (start_n + offs_n)[None, :]
    keep = cols < Lk
    if CAUSAL:
        keep = keep & (cols <= offs_m[:, None] + shift)
    return keep


@triton.jit
def ranged_tiles(lo, hi, valid, BLOCK: tl.constexpr):
    """Tile bounds over the other axis for a block of monotone ranges ``[lo, hi)`` (one per row of the
    block; ``valid`` marks real rows). The rows see ``[lo[0], hi[-1])`` in all and every row sees
    ``[lo[-1], hi[0])``. Returns ``(start, full_lo, full_hi, stop)``: tiles in ``[full_lo, full_hi)``
    need no mask, tiles in ``[start, full_lo)`` and ``[full_hi, stop)`` do; the others hold no visible
    pair and are skipped (all of them when every row's range is empty, e.g. padding)."""
    big = 2147483647
    lo_first = tl.min(tl.where(valid, lo, big))
    lo_last = tl.max(tl.where(valid, lo, 0))
    hi_first = tl.min(tl.where(valid, hi, big))
    hi_last = tl.max(tl.where(valid, hi, 0))
    nonempty = tl.max(tl.where(valid, hi - lo, 0)) > 0
    start = (lo_first // BLOCK) * BLOCK
    stop = tl.where(nonempty, tl.maximum(hi_last, start), start)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(lo_last, BLOCK) * BLOCK, start), stop)
    full_hi = tl.minimum(tl.maximum((hi_first // BLOCK) * BLOCK, full_lo), stop)
    return start, full_lo, full_hi, stop


@triton.jit
def in_range(rows_lo, rows_hi, cols):
    """Mask ``[rows, cols]``: ``rows_lo <= col < rows_hi`` (per-row key ranges)."""
    return (cols[None, :] >= rows_lo[:, None]) & (cols[None, :] < rows_hi[:, None])


@triton.jit
def row_tiles(X, n_b, length, n_heads, s_b, s_s, s_h, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
              D_PAD: tl.constexpr):
    """TMA descriptor of ``(BLOCK, D_PAD)`` row tiles of one head of a ``(batch, seq, heads, dim)``
    tensor with unit stride along dim; loads past the sequence end or the head dim read zeros."""
    return tl.make_tensor_descriptor(
        X, shape=[n_b, length, n_heads, HEAD_DIM], strides=[s_b, s_s, s_h, 1],
        block_shape=[1, BLOCK, 1, D_PAD],
    )


def tune_bench(fn, quantiles=None):
    """Short timing for the autotuner (its default spends ~125 ms per config)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)
