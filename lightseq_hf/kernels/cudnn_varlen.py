"""The ``"cudnn_varlen"`` backend: cuDNN's fused attention over packed documents, through torch's own ops.

Each planned call feeds ``torch.ops.aten._cudnn_attention_forward`` / ``_cudnn_attention_backward`` (with
``cum_seq_q`` / ``cum_seq_k``; :mod:`.cudnn_ops`) independent document blocks (:class:`DocBlocks`, as
``flash_varlen``): rows ``(total, heads, dim)``, GQA native (key/value heads never expanded). The forward
returns out and lse and merges into the running out/lse; the backward takes the rows' *global* out and
lse, so the gradients of all calls add up to the full gradient.

What the op does is probed once per device (:func:`.cudnn_ops.op_traits`), and every layout (one task's
blocks) is planned once from that (:func:`plan_layout`), never per call:

- causal alignment: torch 2.11's op aligns the causal diagonal top-left in every sequence. A causal block
  with keys before its first query row (a row range that starts inside a document) needs the bottom-right
  rule, so its layout runs as two calls: the square causal parts, and the full key prefixes of the blocks
  that have one; their results merge by lse, their gradients add. Square layouts run in one call.
- calls the op does not take (sequences all one token long: :func:`.cudnn_ops.takes`) go to the fallback
  kernel (Triton on a GPU) with the call's blocks as key ranges, merged like the op's results.

torch 2.11's op rebuilds its cuDNN graph on every call (about 80 ms of host time on an H100, see
:mod:`.cudnn_ops`), so there this backend is correct but slow; it pays off with a torch whose op caches
its graphs.

The op takes bf16/fp16 CUDA tensors with head dims that are multiples of 8 up to 128 (cuDNN has no packed
backward plan for 256); windows and other head dims are for other backends. Callers build the blocks.
"""

from __future__ import annotations

import math
import weakref

import torch

from . import cudnn_ops as ops
from .base import AttentionMask, Capabilities, KernelBase, merge_into
from .cudnn_ops import head_dim_ok, op_traits, usable
from .flash_varlen import DocBlocks, Rows, _acc, _check_blocks, _gather, _RowMap, whole_rows
from .reference import ReferenceKernel

__all__ = ["CudnnVarlenKernel", "head_dim_ok", "op_traits", "plan_calls", "plan_layout", "usable"]


# --- planning a layout's calls (once per layout) -----------------------------------------------------

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

KeyRange = tuple[torch.Tensor, torch.Tensor]


def plan_calls(blocks: DocBlocks, bottom_right: bool) -> tuple[DocBlocks, ...]:
    """The calls of one layout (cached per blocks object): the blocks themselves when the op's causal rule
    fits them, else the square causal parts of the causal blocks and the full key prefixes of those that
    have keys before their first query row (the bottom-right rule: row ``i`` of an ``m x n`` block sees
    keys ``j <= i + n - m``)."""
    plans = _plans.setdefault(blocks, {})
    if bottom_right not in plans:
        squares = all(m == n for m, n in zip(blocks.q_lens, blocks.k_lens))
        plans[bottom_right] = (blocks,) if bottom_right or not blocks.causal or squares else _split(blocks)
    return plans[bottom_right]


def plan_layout(blocks: DocBlocks, bottom_right: bool, batch: int, q_len: int,
                kv_len: int) -> tuple[tuple[DocBlocks, KeyRange | None], ...]:
    """Each call of :func:`plan_calls` with, for a call the op does not take (:func:`.cudnn_ops.takes`), the
    per-row key ranges of its blocks for the fallback kernel (None: the op runs it); cached per layout."""
    plans = _plans.setdefault(blocks, {})
    key = (bottom_right, batch, q_len, kv_len)
    if key not in plans:
        plans[key] = tuple((part, None if ops.takes(part.max_q, part.max_k) else
                            block_key_ranges(part, batch, q_len, kv_len))
                           for part in plan_calls(blocks, bottom_right))
    return plans[key]


def block_key_ranges(blocks: DocBlocks, batch: int, q_len: int, kv_len: int) -> KeyRange:
    """The blocks' mask as key ranges ``(lo, hi)``, int32 ``(batch, q_len)`` on the blocks' device (rows fed
    to no block see nothing; both stay non-decreasing along a row). One host read of the row indices."""
    def host(rows: Rows) -> torch.Tensor:
        return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows.cpu()

    q_idx, k_idx = host(blocks.q_rows), host(blocks.k_rows)
    lo = torch.full((batch * q_len,), -1, dtype=torch.int64)
    hi = lo.clone()
    qa = ka = 0
    for m, n in zip(blocks.q_lens, blocks.k_lens):
        rows, k0 = q_idx[qa:qa + m], int(k_idx[ka]) % kv_len  # a block's keys are one run of one row
        lo[rows] = k0
        seen = (torch.arange(m) + (n - m + 1)).clamp(0, n) if blocks.causal else torch.full((m,), n)
        hi[rows] = k0 + seen
        qa, ka = qa + m, ka + n
    lo, hi = lo.view(batch, q_len), hi.view(batch, q_len)
    fed = hi >= 0
    reached = torch.where(fed, hi, 0).cummax(dim=1).values
    dev = blocks.cu_q.device
    return (torch.where(fed, lo, reached).to(torch.int32).to(dev),
            torch.where(fed, hi, reached).to(torch.int32).to(dev))


def _split(blocks: DocBlocks) -> tuple[DocBlocks, ...]:
    dev = blocks.cu_q.device
    sq_q, sq_k, sq_lens, pre_q, pre_k, pre_q_lens, pre_k_lens = [], [], [], [], [], [], []
    qa = ka = 0
    for m, n in zip(blocks.q_lens, blocks.k_lens):
        side = min(m, n)  # the last `side` rows against the last `side` keys: a square causal block
        sq_q.extend(range(qa + m - side, qa + m))
        sq_k.extend(range(ka + n - side, ka + n))
        sq_lens.append(side)
        if n > m:  # every row also sees the keys before its block's diagonal
            pre_q.extend(range(qa, qa + m))
            pre_k.extend(range(ka, ka + n - m))
            pre_q_lens.append(m)
            pre_k_lens.append(n - m)
        qa, ka = qa + m, ka + n
    parts = [_sub_blocks(blocks, sq_q, sq_k, tuple(sq_lens), tuple(sq_lens), True, dev)]
    if pre_q:
        parts.append(_sub_blocks(blocks, pre_q, pre_k, tuple(pre_q_lens), tuple(pre_k_lens), False, dev))
    return tuple(parts)


def _pick(rows: Rows, pos: list[int], device: torch.device) -> Rows:
    """The fed rows at positions ``pos`` of ``rows`` (a slice or a view when they are one run)."""
    if pos == list(range(pos[0], pos[0] + len(pos))):
        if isinstance(rows, slice):
            return slice(rows.start + pos[0], rows.start + pos[0] + len(pos))
        return rows[pos[0]: pos[0] + len(pos)]
    idx = torch.tensor(pos, dtype=torch.int64)
    if isinstance(rows, slice):
        return (idx + rows.start).to(device)
    return rows[idx.to(device)]


def _sub_blocks(blocks: DocBlocks, q_pos, k_pos, q_lens, k_lens, causal, device) -> DocBlocks:
    def cumulative(lens):
        return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)

    return DocBlocks(q_lens, k_lens, _pick(blocks.q_rows, q_pos, device), _pick(blocks.k_rows, k_pos, device),
                     cumulative(q_lens), cumulative(k_lens), causal)


# --- running a planned call ----------------------------------------------------------------------------

def _op_args(part: DocBlocks) -> tuple:
    return part.cu_q, part.cu_k, part.max_q, part.max_k, part.causal


class _OpCalls:
    """Planned calls run through the op."""

    def __init__(self, traits: ops.OpTraits) -> None:
        self.traits = traits

    def forward(self, part: DocBlocks, q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (total_q, heads, dim), lse rows (heads, total_q))`` of the part's rows."""
        qg, kg, vg = _gather(q, part.q_rows), _gather(k, part.k_rows), _gather(v, part.k_rows)
        o, lse, _, _ = ops.op_forward(qg, kg, vg, *_op_args(part), scale)
        return o, self.traits.lse.rows(lse)

    def backward(self, part: DocBlocks, dout, q, k, v, out, rows_lse, scale):
        """``(dq, dk, dv)`` rows of the part, given its rows' global out and ``(heads, total_q)`` lse."""
        qg, kg, vg = _gather(q, part.q_rows), _gather(k, part.k_rows), _gather(v, part.k_rows)
        dog, og = _gather(dout.to(q.dtype), part.q_rows), _gather(out.to(q.dtype), part.q_rows)
        heads, tr = q.shape[2], self.traits
        op_lse = tr.lse.view(torch.empty(part.total_q * heads, dtype=rows_lse.dtype, device=q.device),
                             part.total_q, heads)
        tr.lse.rows(op_lse).copy_(rows_lse)
        return ops.op_backward(dog, qg, kg, vg, og, op_lse, tr.seed, tr.offset, *_op_args(part), scale)


_fallbacks: dict[tuple[str, int], object] = {}


def fallback_kernel(device: torch.device, head_dim: int):
    """The kernel taking the calls the op does not: Triton with key ranges on a GPU where it compiles this
    head dim, else the reference kernel."""
    key = (device.type, head_dim)
    if key not in _fallbacks:
        kernel = None
        if device.type == "cuda":
            try:
                from .triton_attn import SUPPORTED_HEAD_DIMS, TritonKernel

                kernel = TritonKernel() if head_dim in SUPPORTED_HEAD_DIMS else None
            except ImportError:
                kernel = None
        _fallbacks[key] = kernel or ReferenceKernel()
    return _fallbacks[key]


# --- the kernel --------------------------------------------------------------------------------------

class CudnnVarlenKernel(KernelBase):
    """Local attention through torch's cuDNN varlen ops: each task's documents in one planned set of calls
    (one call, or two for causal blocks the op's top-left rule cannot express; a call the op does not take
    goes to :func:`fallback_kernel`). Not in the selection table: on torch 2.11 the op's backward is wrong
    (:func:`~lightseq_hf.kernels.cudnn_ops.unusable_reason`), so ``auto`` never picks it there."""

    name = "cudnn_varlen"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dim_multiple=8,
        max_head_dim=256,
        supports_doc_blocks=True,
        needs_out_in_backward=True,
    )

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        reason = ops.unusable_reason(device)
        return None if reason is None else reason.removeprefix("backend 'cudnn_varlen' ")

    def __init__(self) -> None:
        self._runners: dict[str, _OpCalls] = {}

    def runner(self, device: torch.device) -> _OpCalls:
        key = str(device)
        if key not in self._runners:
            self._runners[key] = _OpCalls(op_traits(device))
        return self._runners[key]

    def _plan(self, q, k, causal, doc_blocks) -> tuple[tuple[DocBlocks, KeyRange | None], ...]:
        if doc_blocks is None:
            blocks = whole_rows(q.shape[0], q.shape[1], k.shape[1], causal, q.device)
        else:
            _check_blocks(doc_blocks, q, k)
            blocks = doc_blocks
        if blocks.num_blocks == 0:
            return ()
        return plan_layout(blocks, op_traits(q.device).bottom_right, q.shape[0], q.shape[1], k.shape[1])

    def _forward(self, q, k, v, mask: AttentionMask, *, scale, out, lse):
        """``(out, lse)`` of ``q`` against ``k``/``v`` over the blocks; with ``out``/``lse`` given, merges
        the fed rows into them (other rows untouched)."""
        causal, doc_blocks = mask.causal, mask.doc_blocks
        b, lq, h, _ = q.shape
        accum = out is not None or lse is not None
        if accum and (out is None or lse is None):
            raise ValueError("accumulate mode needs both the running out and lse; pass both or neither.")
        plan = self._plan(q, k, causal, doc_blocks)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        direct = len(plan) == 1 and plan[0][1] is None  # one op call writes the result
        if not accum:
            lse = torch.full((b, h, lq), -math.inf, dtype=acc, device=q.device)
            out = torch.zeros(q.shape, dtype=q.dtype if direct else acc, device=q.device)
        for part, key_range in plan:
            if key_range is not None:
                fallback_kernel(q.device, q.shape[-1]).forward(q, k, v, causal=False, scale=scale, out=out,
                                                               lse=lse, key_range=key_range)
                continue
            o, rows_lse = self.runner(q.device).forward(part, q, k, v, scale)
            rows = _RowMap(part.q_rows, b, lq, q.device)
            if direct and not accum:
                rows.put(out, o)
                rows.put_lse(lse, rows_lse.to(lse.dtype))
                continue
            # views of the running buffers are merged in place; gathered rows are merged, then written back
            run_out, run_lse = rows.take(out).unsqueeze(0), rows.take_lse(lse).unsqueeze(0)
            merge_into(run_out, run_lse, o.unsqueeze(0), rows_lse.unsqueeze(0))
            if rows.view is None:
                rows.put(out, run_out[0])
                rows.put_lse(lse, run_lse[0])
        if not accum and out.dtype != q.dtype:
            out = out.to(q.dtype)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask: AttentionMask, *, scale, delta, dq, dk, dv):
        """float32 ``(dq, dk, dv)`` of this call (added into ``dq``/``dk``/``dv`` when given). ``out`` and
        ``lse`` are the query rows' global results; ``delta`` is not taken (the op recomputes it)."""
        causal, doc_blocks = mask.causal, mask.doc_blocks
        if out is None:
            raise ValueError("backend 'cudnn_varlen' needs the attention output in backward (not only "
                             "delta).")
        if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"dout and out must have q's shape {tuple(q.shape)}; got {tuple(dout.shape)}, "
                             f"{tuple(out.shape)}.")
        plan = self._plan(q, k, causal, doc_blocks)
        b, lq = q.shape[:2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        grads = [torch.zeros(like.shape, dtype=acc, device=q.device) if given is None else given
                 for given, like in ((dq, q), (dk, k), (dv, v))]
        for part, key_range in plan:
            if key_range is not None:
                fallback_kernel(q.device, q.shape[-1]).backward(
                    dout, q, k, v, out, lse, causal=False, scale=scale, dq=grads[0], dk=grads[1], dv=grads[2],
                    key_range=key_range)
                continue
            rows = _RowMap(part.q_rows, b, lq, q.device)
            rows_lse = _acc(rows.take_lse(lse))
            gq, gk, gv = self.runner(q.device).backward(part, dout, q, k, v, out, rows_lse, scale)
            rows.put(grads[0], gq, accumulate=True)
            key_rows = _RowMap(part.k_rows, k.shape[0], k.shape[1], q.device)
            key_rows.put(grads[1], gk, accumulate=True)
            key_rows.put(grads[2], gv, accumulate=True)
        return tuple(grads)
