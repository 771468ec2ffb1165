"""The ``"triton"`` backend: Triton FlashAttention kernels behind the contract of ``base``.

Inputs stay in the contract's ``(batch, seq, heads, head_dim)`` layout: the kernels
take strides, so nothing is transposed or copied. GQA/MQA map query head ``h`` to
key/value head ``h // (heads // kv_heads)`` inside the kernels. Head dims 64, 80, 96
and 128 are padded to a power of two inside the kernels with masks.
"""

from __future__ import annotations

import functools

import torch
import triton

from . import nonfinite
from .base import Capabilities, KernelBase, check_key_range
from .triton_bwd import _attn_bwd_dkdv, _attn_bwd_dq, _delta_kernel
from .triton_common import LOG2E, bucket, interpreting
from .triton_fwd import _attn_fwd
from .working_memory import BackwardMemory

__all__ = ["TritonKernel", "dkdv_split", "query_ranges"]

_SUPPORTED_HEAD_DIMS = (64, 80, 96, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_buffer(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype != torch.float32 or tuple(t.shape) != shape or t.device != device:
        raise ValueError(
            f"{name} must be a float32 tensor of shape {shape} on {device}; got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}. Allocate it with torch.zeros(..., dtype=torch.float32)."
        )


def _prec(dtype: torch.dtype) -> str:
    # float32 inputs (tests, CPU interpreter) get exact float32 products, not tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it (unit last stride, 16-byte aligned base and strides), else a copy.

    Standard (batch, seq, heads, head_dim) tensors and views into packed qkv qualify: no copy.
    """
    es = t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s in t.stride()[:-1])
    return t if ok else t.contiguous()


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator(device: torch.device) -> None:
    """In-kernel tensor descriptors need a scratch allocator on CUDA.

    Triton keeps the allocator in a context variable, so it is per thread: set it at every
    call (cheap), since autograd runs backward in its own thread.
    """
    if device.type == "cuda":
        triton.set_allocator(_scratch)


def query_ranges(k_lo: torch.Tensor, k_hi: torch.Tensor, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows ``[q_lo[j], q_hi[j])`` that see key ``j``, from monotone per-row key ranges
    (int32 ``(batch, lk)``): the first row whose ``hi`` exceeds ``j`` and the first whose ``lo`` does."""
    keys = torch.arange(lk, dtype=torch.int32, device=k_lo.device).expand(k_lo.shape[0], lk).contiguous()
    q_lo = torch.searchsorted(k_hi, keys, right=True).to(torch.int32)
    q_hi = torch.searchsorted(k_lo, keys, right=True).to(torch.int32)
    return q_lo, torch.maximum(q_lo, q_hi)


def _s(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def dkdv_split(lq: int, lk: int, kv_programs: int, multiprocessors: int) -> int:
    """Into how many parts the dk/dv kernel splits each key block's query rows on a GPU of
    ``multiprocessors`` streaming multiprocessors.

    Its programs own a key block of one key/value head (``kv_programs`` = heads x batch per key block) and
    loop over every query row that sees it: a task with few keys and many query rows (a long document's
    keys in a neighbour's chunk, seen by all its rows here) would run a handful of long programs on an
    otherwise idle GPU. Split the rows until there are about two programs per multiprocessor, keeping at
    least 16 query blocks of 32 rows per part. Used for key-range (document) calls only: plain causal
    calls keep the one-part kernel (``TritonKernel(dkdv_split=n)`` forces a count).
    """
    programs = triton.cdiv(lk, 128) * kv_programs
    target = 2 * multiprocessors
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), lq // (32 * 16)))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonKernel(KernelBase):
    """Triton FlashAttention-2 style kernels with running-statistics accumulation.

    ``dkdv_split``: a fixed number of parts for the dk/dv kernel of key-range calls (None: chosen per call
    by :func:`dkdv_split`).
    """

    name = "triton"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),  # cpu: in Triton's interpreter (TRITON_INTERPRET=1)
        dtypes=frozenset(_DTYPES),
        head_dims=_SUPPORTED_HEAD_DIMS,
        supports_key_range=True,
        supports_window=True,
        merges_in_kernel=True,  # accumulate mode updates a float32 running (out, lse) inside the kernel
        # writes float32 dq/dk/dv into the loop's accumulators (its own, returned, in a ring helper's task)
        backward_memory=BackwardMemory("Triton kernel"),
    )

    def __init__(self, dkdv_split: int | None = None) -> None:
        if dkdv_split is not None and dkdv_split < 1:
            raise ValueError(f"dkdv_split must be a positive part count (or None); got {dkdv_split}.")
        self.dkdv_split = dkdv_split

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        if device.type == "cuda":
            return None
        if not interpreting():
            return ("needs a CUDA GPU with triton installed (or TRITON_INTERPRET=1 to run the kernels in "
                    f"Triton's CPU interpreter); tensors are on {device}")
        if dtype == torch.bfloat16:
            return ("in Triton's CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 wrongly (an upstream "
                    "interpreter limitation); use float16 or float32 there, or a CUDA GPU")
        return None

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        """``(out, lse)`` of ``q`` against ``k``/``v``; with ``out``/``lse`` given, merges into them.
        ``key_range``: per-row key ranges (document / window masks; tiles no row sees are skipped)."""
        check_key_range(mask.key_range, q)
        key_range, causal = mask.key_range, mask.causal
        k_lo, k_hi = (None, None) if key_range is None else (r.contiguous() for r in key_range)
        b, lq, h, d = q.shape
        lk, hk = k.shape[1], k.shape[2]
        bad_keys = None
        if key_range is not None:  # documents and windows: keep a NaN in the rows that see it
            k, v, bad_keys = nonfinite.forward_inputs(k, v)
        k, v = _tma_ready(k), _tma_ready(v)
        _ensure_allocator(q.device)
        accum = out is not None or lse is not None
        if accum:
            if out is None or lse is None:
                raise ValueError("accumulate mode needs both the running out and lse; pass both or neither.")
            _check_buffer("running out", out, (b, lq, h, d), q.device)
            _check_buffer("running lse", lse, (b, h, lq), q.device)
        else:
            out = torch.empty((b, lq, h, d), dtype=q.dtype, device=q.device)
            lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
        if lq == 0 or b == 0 or h == 0:
            return out, lse
        if lk == 0:
            if not accum:
                out.zero_()
                lse.fill_(float("-inf"))
            return out, lse

        def grid(meta):
            return (triton.cdiv(lq, meta["BLOCK_M"]), h, b)

        _attn_fwd[grid](
            q,
            k,
            v,
            out,
            lse,
            k_lo,
            k_hi,
            *_s(q),
            *_s(k),
            *_s(v),
            *_s(out),
            *_s(lse),
            lq,
            lk,
            lk - lq,
            h // hk,
            float(scale) * LOG2E,
            bucket(lq),
            bucket(lk),
            HEAD_DIM=d,
            D_PAD=triton.next_power_of_2(d),
            CAUSAL=bool(causal),
            ACCUM=accum,
            PREC=_prec(q.dtype),
            RANGED=key_range is not None,
        )
        if bad_keys is not None:
            nonfinite.poison_forward(out, bad_keys, (k_lo, k_hi))
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        """float32 ``(dq, dk, dv)`` of this chunk (added into ``dq``/``dk``/``dv`` when given)."""
        check_key_range(mask.key_range, q)
        key_range, causal = mask.key_range, mask.causal
        b, lq, h, d = q.shape
        lk, hk = k.shape[1], k.shape[2]
        dev = q.device
        dq_t, dk_t, dv_t = _backward_buffers(dout, q, k, out, lse, delta, dq, dk, dv)
        if lq == 0 or lk == 0 or b == 0 or h == 0:
            for given, t in ((dq, dq_t), (dk, dk_t), (dv, dv_t)):
                if given is None:
                    t.zero_()
            return dq_t, dk_t, dv_t
        if lse.dtype != torch.float32:
            lse = lse.float()
        q, dout = _tma_ready(q), _tma_ready(dout)
        _ensure_allocator(dev)
        d_pad = triton.next_power_of_2(d)
        if delta is None:
            delta = _delta(out, dout, d_pad)
        found = None
        if key_range is not None:  # documents and windows: keep a NaN in the rows and keys that see it
            # (zeroed copies, when any, are new contiguous tensors: ready for the kernels' descriptors)
            q, k, v, dout, lse, delta, found = nonfinite.backward_inputs(q, k, v, dout, lse, delta)
        common = {"HEAD_DIM": d, "D_PAD": d_pad, "CAUSAL": bool(causal), "PREC": _prec(q.dtype),
                  "RANGED": key_range is not None}
        k_lo = k_hi = q_lo = q_hi = None
        if key_range is not None:
            k_lo, k_hi = key_range[0].contiguous(), key_range[1].contiguous()
            q_lo, q_hi = query_ranges(k_lo, k_hi, lk)
        lens = (lq, lk, lk - lq, h // hk, float(scale) * LOG2E, float(scale), bucket(lq), bucket(lk))
        split = 1
        if key_range is not None:
            split = self.dkdv_split or (dkdv_split(lq, lk, hk * b, _multiprocessors(dev))
                                        if dev.type == "cuda" else 1)  # the interpreter: one part
        _dkdv(q, k, v, dout, lse, delta, (dk_t, dk is not None), (dv_t, dv is not None),
              (k_lo, k_hi, q_lo, q_hi), lens, split, common)
        _dq(q, k, v, dout, lse, delta, dq_t, dq is not None, (k_lo, k_hi), lens, common)
        if found is not None:
            nonfinite.poison_backward(found, (k_lo, k_hi), (q_lo, q_hi), dq_t, dk_t, dv_t)
        return dq_t, dk_t, dv_t


def _backward_buffers(dout, q, k, out, lse, delta, dq, dk, dv) -> tuple[torch.Tensor, ...]:
    """Check the backward's inputs and buffers; the float32 ``(dq, dk, dv)`` to write (given or new)."""
    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    dev = q.device
    if tuple(dout.shape) != tuple(q.shape) or dout.device != dev:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)} on {dev}; got {tuple(dout.shape)}.")
    if dout.dtype != q.dtype:
        raise ValueError(f"dout dtype {dout.dtype} differs from q's {q.dtype}; cast dout to q's dtype.")
    if tuple(lse.shape) != (b, h, lq) or lse.device != dev:
        raise ValueError(f"lse must have shape {(b, h, lq)} on {dev}; got {tuple(lse.shape)}.")
    if delta is None:
        if tuple(out.shape) != tuple(q.shape) or out.device != dev:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}; got {tuple(out.shape)}.")
    else:
        _check_buffer("delta", delta, (b, h, lq), dev)
    if (dk is None) != (dv is None):
        raise ValueError("pass dk and dv together (both or neither): they share one kernel.")
    grads = []
    shapes = (("dq", dq, (b, lq, h, d)), ("dk", dk, (b, lk, hk, d)), ("dv", dv, (b, lk, hk, d)))
    for name, given, shape in shapes:
        if given is None:
            grads.append(torch.empty(shape, dtype=torch.float32, device=dev))
        else:
            _check_buffer(name, given, shape, dev)
            grads.append(given)
    return tuple(grads)


def _delta(out: torch.Tensor, dout: torch.Tensor, d_pad: int) -> torch.Tensor:
    """``rowsum(dout * out)`` as float32 ``(batch, heads, q_len)``, by the Triton delta kernel."""
    b, lq, h, d = dout.shape
    delta = torch.empty((b, h, lq), dtype=torch.float32, device=dout.device)
    block = 16 if interpreting() else 64
    _delta_kernel[(triton.cdiv(lq, block), h, b)](
        out,
        dout,
        delta,
        *_s(out),
        *_s(dout),
        *_s(delta),
        lq,
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_M=block,
        num_warps=4,
    )
    return delta


def _dkdv(q, k, v, dout, lse, delta, dk, dv, ranges, lens, split, common) -> None:
    """The dk/dv kernel into ``dk = (buffer, accumulate)`` / ``dv``; with ``split`` parts, each part writes
    its own partial dk/dv, summed after. ``ranges``: ``(k_lo, k_hi, q_lo, q_hi)`` (Nones without ranges)."""
    (dk_t, add_dk), (dv_t, add_dv) = dk, dv
    k_lo, k_hi, q_lo, q_hi = ranges
    b, lk, hk, d = k.shape
    dev = q.device

    def grid_kv(meta):
        return (triton.cdiv(lk, meta["BLOCK_N"]), hk, b * split)

    if split > 1:  # each part writes its own dk/dv, summed below
        dk_out = torch.empty((b * split, lk, hk, d), dtype=torch.float32, device=dev)
        dv_out = torch.empty_like(dk_out)
    else:
        dk_out, dv_out = dk_t, dv_t
    _attn_bwd_dkdv[grid_kv](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk_out,
        dv_out,
        k_lo,
        k_hi,
        q_lo,
        q_hi,
        *_s(q),
        *_s(k),
        *_s(v),
        *_s(dout),
        *_s(lse),
        *_s(delta),
        *_s(dk_out),
        *_s(dv_out),
        *lens,
        split,
        ACCUM=add_dk and split == 1,
        **common,
    )
    if split > 1:
        for add, out_t, parts in ((add_dk, dk_t, dk_out), (add_dv, dv_t, dv_out)):
            total = parts.view(b, split, lk, hk, d).sum(1)
            out_t.add_(total) if add else out_t.copy_(total)


def _dq(q, k, v, dout, lse, delta, dq_t, add, ranges, lens, common) -> None:
    """The dq kernel into ``dq_t`` (added to it when ``add``); ``ranges``: ``(k_lo, k_hi)`` or Nones."""
    b, lq, h, _ = q.shape
    k_lo, k_hi = ranges

    def grid_q(meta):
        return (triton.cdiv(lq, meta["BLOCK_M"]), h, b)

    _attn_bwd_dq[grid_q](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq_t,
        k_lo,
        k_hi,
        *_s(q),
        *_s(k),
        *_s(v),
        *_s(dout),
        *_s(lse),
        *_s(delta),
        *_s(dq_t),
        *lens,
        ACCUM=add,
        **common,
    )
