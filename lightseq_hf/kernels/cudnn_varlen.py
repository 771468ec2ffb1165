"""The ``"cudnn_varlen"`` backend: cuDNN's fused attention over packed documents, through torch's own ops.

Each planned call feeds ``torch.ops.aten._cudnn_attention_forward`` / ``_cudnn_attention_backward`` (with
``cum_seq_q`` / ``cum_seq_k``; :mod:`.cudnn_ops`) independent document blocks (:class:`DocBlocks`, as
``flash_varlen``): rows ``(total, heads, dim)``, GQA native (key/value heads never expanded). The forward
returns out and lse and merges into the running out/lse; the backward takes the rows' *global* out and
lse, so the gradients of all calls add up to the full gradient.

What the op does is probed once per device (:func:`.cudnn_ops.op_traits`), and every layout (one task's
blocks) is planned once from that (:func:`plan_calls`), never per call:

- causal alignment: torch 2.11's op aligns the causal diagonal top-left in every sequence. A causal block
  with keys before its first query row (a row range that starts inside a document) needs the bottom-right
  rule, so its layout runs as two calls: the square causal parts, and the full key prefixes of the blocks
  that have one; their results merge by lse, their gradients add. Square layouts run in one call.
- graph reuse: an op that builds its cuDNN graph on every call (torch 2.11: tens of ms of host time a
  call) runs each planned call as a CUDA graph, captured once and replayed; its inputs and outputs are
  static buffers shared by all layouts of one shape class (device, dtype, heads, kv heads, head dim).

The op takes bf16/fp16 CUDA tensors with head dims that are multiples of 8 up to 128 (cuDNN has no packed
backward plan for 256); windows and other head dims are for other backends. Callers build the blocks.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

from . import cudnn_ops as ops
from .base import check_qkv, merge_into
from .cudnn_ops import head_dim_ok, op_traits, usable
from .flash_varlen import DocBlocks, Rows, _acc, _check_blocks, _flat_rows, _gather, _RowMap, whole_rows

__all__ = ["CudnnVarlenKernel", "head_dim_ok", "op_traits", "plan_calls", "usable"]

#: captured calls kept per shape class (least recently used dropped first)
MAX_GRAPHS = 64


# --- planning a layout's calls (once per layout) -----------------------------------------------------

_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_calls(blocks: DocBlocks, bottom_right: bool) -> tuple[DocBlocks, ...]:
    """The op calls of one layout (cached per blocks object): the blocks themselves when the op's causal
    rule fits them, else the square causal parts of the causal blocks and the full key prefixes of those
    that have keys before their first query row (the bottom-right rule: row ``i`` of an ``m x n`` block
    sees keys ``j <= i + n - m``)."""
    plans = _plans.setdefault(blocks, {})
    if bottom_right not in plans:
        squares = all(m == n for m, n in zip(blocks.q_lens, blocks.k_lens))
        plans[bottom_right] = (blocks,) if bottom_right or not blocks.causal or squares else _split(blocks)
    return plans[bottom_right]


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


# --- running a planned call: eagerly, or as a replayed CUDA graph --------------------------------------

def _op_args(part: DocBlocks) -> tuple:
    return part.cu_q, part.cu_k, part.max_q, part.max_k, part.causal


class _EagerCalls:
    """Each call runs the op directly."""

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


class _Statics:
    """Static buffers and captured calls of one shape class; growing the buffers drops the calls."""

    NAMES_Q = ("q", "o", "do", "dq")
    NAMES_K = ("k", "v", "dk", "dv")

    def __init__(self, device, dtype, heads, kv_heads, dim) -> None:
        self.device, self.dtype, self.heads, self.kv_heads, self.dim = device, dtype, heads, kv_heads, dim
        self.cap_q = self.cap_k = 0
        self.bufs: dict[str, torch.Tensor] = {}
        self.calls: OrderedDict = OrderedDict()
        self.pool = ops.graph_pool(device)

    def fit(self, total_q: int, total_k: int) -> None:
        if total_q <= self.cap_q and total_k <= self.cap_k:
            return
        self.calls.clear()
        self.bufs.clear()
        self.cap_q, self.cap_k = max(total_q, self.cap_q), max(total_k, self.cap_k)
        shapes = ((self.NAMES_Q, self.cap_q, self.heads), (self.NAMES_K, self.cap_k, self.kv_heads))
        for names, rows, h in shapes:
            for name in names:
                self.bufs[name] = torch.empty(rows, h, self.dim, dtype=self.dtype, device=self.device)
        lse_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        for name in ("lse_out", "lse_in"):
            self.bufs[name] = torch.empty(self.cap_q * self.heads, dtype=lse_dtype, device=self.device)

    def take(self, name: str, x: torch.Tensor, rows: Rows, total: int) -> torch.Tensor:
        """Gather ``rows`` of ``(batch, length, H, D)`` ``x`` into the static buffer ``name``."""
        dst = self.bufs[name][:total]
        flat = _flat_rows(x)
        if isinstance(rows, slice):
            dst.copy_(flat[rows])
        elif flat.dtype == dst.dtype:
            torch.index_select(flat, 0, rows, out=dst)
        else:
            dst.copy_(flat.index_select(0, rows))
        return dst

    def take_qkv(self, q, k, v, part: DocBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.take("q", q, part.q_rows, part.total_q), self.take("k", k, part.k_rows, part.total_k),
                self.take("v", v, part.k_rows, part.total_k))

    def replay(self, key: tuple, fn: Callable[[], None]) -> None:
        """Replay the call captured for ``key`` (capturing ``fn`` the first time)."""
        run = self.calls.pop(key, None)
        if run is None:
            run = ops.capture(fn, self.device, self.pool)
        self.calls[key] = run
        if len(self.calls) > MAX_GRAPHS:
            self.calls.popitem(last=False)
        run()


class _GraphCalls:
    """Each planned call runs as a CUDA graph captured once per (part, kind, scale) and replayed."""

    def __init__(self, traits: ops.OpTraits) -> None:
        self.traits = traits
        self.classes: dict[tuple, _Statics] = {}

    def _statics(self, q, k, part) -> _Statics:
        key = (str(q.device), q.dtype, q.shape[2], k.shape[2], q.shape[3])
        if key not in self.classes:
            self.classes[key] = _Statics(q.device, q.dtype, q.shape[2], k.shape[2], q.shape[3])
        st = self.classes[key]
        st.fit(part.total_q, part.total_k)
        return st

    def forward(self, part: DocBlocks, q, k, v, scale):
        st, tq = self._statics(q, k, part), part.total_q
        qs, ks, vs = st.take_qkv(q, k, v, part)
        o_s, lse_s = st.bufs["o"][:tq], st.bufs["lse_out"][: q.shape[2] * tq].view(q.shape[2], tq)
        layout = self.traits.lse

        def call():
            o, lse, _, _ = ops.op_forward(qs, ks, vs, *_op_args(part), scale)
            o_s.copy_(o)
            lse_s.copy_(layout.rows(lse))

        st.replay((part, "forward", scale), call)
        return o_s, lse_s

    def backward(self, part: DocBlocks, dout, q, k, v, out, rows_lse, scale):
        st, tq, tk, tr = self._statics(q, k, part), part.total_q, part.total_k, self.traits
        qs, ks, vs = st.take_qkv(q, k, v, part)
        dos, os_ = st.take("do", dout, part.q_rows, tq), st.take("o", out, part.q_rows, tq)
        op_lse = tr.lse.view(st.bufs["lse_in"], tq, q.shape[2])
        tr.lse.rows(op_lse).copy_(rows_lse)
        grads = st.bufs["dq"][:tq], st.bufs["dk"][:tk], st.bufs["dv"][:tk]

        def call():
            res = ops.op_backward(dos, qs, ks, vs, os_, op_lse, tr.seed, tr.offset, *_op_args(part), scale)
            for dst, src in zip(grads, res):
                dst.copy_(src)

        st.replay((part, "backward", scale), call)
        return grads


# --- the kernel --------------------------------------------------------------------------------------

class CudnnVarlenKernel:
    """Local attention through torch's cuDNN varlen ops: each task's documents in one planned set of calls
    (one call, or two for causal blocks the op's top-left rule cannot express)."""

    name = "cudnn_varlen"
    supports_doc_blocks = True
    needs_out_in_backward = True
    supports_delta = False

    def __init__(self, graphs: bool | None = None) -> None:
        """``graphs``: run planned calls as replayed CUDA graphs (None: when the op rebuilds its cuDNN graph
        on every call and a call can be captured, probed once per device)."""
        self.graphs = graphs
        self._runners: dict[str, _EagerCalls | _GraphCalls] = {}

    def runner(self, device: torch.device) -> _EagerCalls | _GraphCalls:
        key = str(device)
        if key not in self._runners:
            tr = op_traits(device)
            use = (tr.rebuilds_graph and tr.capturable) if self.graphs is None else self.graphs
            self._runners[key] = _GraphCalls(tr) if use else _EagerCalls(tr)
        return self._runners[key]

    def _calls(self, q, k, causal, doc_blocks) -> tuple[DocBlocks, ...]:
        if doc_blocks is None:
            blocks = whole_rows(q.shape[0], q.shape[1], k.shape[1], causal, q.device)
        else:
            _check_blocks(doc_blocks, q, k, causal)
            blocks = doc_blocks
        if blocks.num_blocks == 0:
            return ()
        return plan_calls(blocks, op_traits(q.device).bottom_right)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        doc_blocks: DocBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of ``q`` against ``k``/``v`` over the blocks; with ``out``/``lse`` given, merges
        the fed rows into them (other rows untouched)."""
        check_qkv(q, k, v)
        b, lq, h, _ = q.shape
        accum = out is not None or lse is not None
        if accum and (out is None or lse is None):
            raise ValueError("accumulate mode needs both the running out and lse; pass both or neither.")
        calls = self._calls(q, k, causal, doc_blocks)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if not accum:
            lse = torch.full((b, h, lq), -math.inf, dtype=acc, device=q.device)
            out = torch.zeros(q.shape, dtype=q.dtype if len(calls) < 2 else acc, device=q.device)
        runner = self.runner(q.device) if calls else None
        for i, part in enumerate(calls):
            o, rows_lse = runner.forward(part, q, k, v, scale)
            rows = _RowMap(part.q_rows, b, lq, q.device)
            if i == 0 and not accum:
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

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        delta: torch.Tensor | None = None,
        dq: torch.Tensor | None = None,
        dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
        doc_blocks: DocBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``(dq, dk, dv)`` of this call (added into ``dq``/``dk``/``dv`` when given). ``out`` and
        ``lse`` are the query rows' global results; ``delta`` is not taken (the op recomputes it)."""
        check_qkv(q, k, v)
        if out is None:
            raise ValueError("backend 'cudnn_varlen' needs the attention output in backward (not only "
                             "delta).")
        if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"dout and out must have q's shape {tuple(q.shape)}; got {tuple(dout.shape)}, "
                             f"{tuple(out.shape)}.")
        calls = self._calls(q, k, causal, doc_blocks)
        b, lq = q.shape[:2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        grads = [torch.zeros(like.shape, dtype=acc, device=q.device) if given is None else given
                 for given, like in ((dq, q), (dk, k), (dv, v))]
        runner = self.runner(q.device) if calls else None
        for part in calls:
            rows = _RowMap(part.q_rows, b, lq, q.device)
            gq, gk, gv = runner.backward(part, dout, q, k, v, out, _acc(rows.take_lse(lse)), scale)
            rows.put(grads[0], gq, accumulate=True)
            key_rows = _RowMap(part.k_rows, k.shape[0], k.shape[1], q.device)
            key_rows.put(grads[1], gk, accumulate=True)
            key_rows.put(grads[2], gv, accumulate=True)
        return tuple(grads)
