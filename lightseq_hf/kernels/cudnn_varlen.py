"""The ``"cudnn_varlen"`` backend: cuDNN's fused attention over packed documents, through torch's own ops.

Each planned call feeds ``torch.ops.aten._cudnn_attention_forward`` / ``_cudnn_attention_backward`` (with
``cum_seq_q`` / ``cum_seq_k``) independent document blocks (:class:`DocBlocks`, as ``flash_varlen``): rows
``(total, heads, dim)``, GQA native (key/value heads never expanded). The forward returns out and lse and
merges into the running out/lse; the backward takes the rows' *global* out and lse, so the gradients of
all calls add up to the full gradient.

What the op does is probed once per device (:func:`op_traits`), and every layout (one task's blocks) is
planned once from that (:func:`plan_calls`), never per call:

- causal alignment: torch 2.11's op aligns the causal diagonal top-left in every sequence. A causal block
  with keys before its first query row (a row range that starts inside a document) needs the bottom-right
  rule, so its layout runs as two calls: the square causal parts, and the full key prefixes of the blocks
  that have one; their results merge by lse, their gradients add. Square layouts run in one call.
- graph reuse: an op that builds its cuDNN graph on every call (torch 2.11: tens of ms of host time a
  call) runs each planned call as a CUDA graph, captured once and replayed; its inputs and outputs are
  static buffers shared by all layouts of one shape class (device, dtype, heads, kv heads, head dim).
- lse layout: read off the probe's output (``(total, heads, 1)`` or ``(heads, total)``).

The op takes bf16/fp16 CUDA tensors with head dims that are multiples of 8 up to 128 (cuDNN has no packed
backward plan for 256); windows and other head dims are for other backends. Callers build the blocks.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import check_qkv, merge_into
from .flash_varlen import DocBlocks, Rows, _acc, _check_blocks, _flat_rows, _gather, _RowMap, whole_rows

_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
#: host time of one repeated small call above which the op is taken to rebuild its graph every call
REBUILD_MS = 2.0
#: captured calls kept per shape class (least recently used dropped first)
MAX_GRAPHS = 64


def head_dim_ok(head_dim: int | None) -> bool:
    """Whether the cuDNN varlen op has forward and backward plans for ``head_dim``."""
    return head_dim is not None and head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def check_cudnn_inputs(q: torch.Tensor) -> None:
    """Raise ValueError naming the fix when the cuDNN varlen op cannot take ``q``'s kind of tensor."""
    if q.device.type != "cuda":
        raise ValueError(f"backend 'cudnn_varlen' runs torch's cuDNN attention op and needs CUDA tensors; "
                         f"got {q.device}. Use backend='reference' or 'auto' on the CPU.")
    if q.dtype not in _DTYPES:
        raise ValueError(f"backend 'cudnn_varlen' takes float16 or bfloat16, not {q.dtype}; cast the inputs "
                         "or use backend='triton' or 'reference'.")
    if not head_dim_ok(q.shape[-1]):
        raise ValueError(f"backend 'cudnn_varlen' takes head dims that are multiples of 8 up to "
                         f"{MAX_HEAD_DIM}; got {q.shape[-1]}. Use backend='triton', 'flash_varlen' or "
                         "'reference'.")


# --- the ops (tests replace these two with a CPU emulation) -------------------------------------------

def op_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(out, lse, philox_seed, philox_offset)`` of the varlen op: ``q`` ``(total_q, heads, dim)``,
    ``k``/``v`` ``(total_k, kv_heads, dim)``, int32 cumulative lengths; lse in the op's layout."""
    check_cudnn_inputs(q)
    res = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale
    )
    return res[0], res[1], res[6], res[7]


def op_backward(dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(dq, dk, dv)`` of the varlen op (input dtype); ``lse`` in the layout the forward returns,
    ``seed``/``offset`` the placeholders a forward without dropout returned."""
    check_cudnn_inputs(q)
    res = torch.ops.aten._cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal, scale=scale
    )
    return res[0], res[1], res[2]


def capture(fn: Callable[[], None], device: torch.device, pool) -> Callable[[], None]:
    """Record ``fn``'s device work as a CUDA graph (on a side stream, in ``pool``); return its replay,
    which runs on the current stream (tests replace this with an emulation)."""
    graph = torch.cuda.CUDAGraph()
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="relaxed")
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    return graph.replay


_side_streams: dict[str, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if str(device) not in _side_streams:
        _side_streams[str(device)] = torch.cuda.Stream(device)
    return _side_streams[str(device)]


def graph_pool(device: torch.device):
    """A CUDA graph memory pool for ``device`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return torch.cuda.graph_pool_handle()


# --- what the op does, probed once per device ----------------------------------------------------------

@dataclass(frozen=True)
class LseLayout:
    """How the op lays out the lse of ``total`` query rows and ``heads`` heads."""

    ndim: int  # 2, or 3 with a trailing 1
    head_major: bool  # logical (heads, total) rather than (total, heads)
    token_outer: bool  # in memory, the heads of one row are adjacent

    def rows(self, lse: torch.Tensor) -> torch.Tensor:
        """A ``(heads, total)`` view of an lse in this layout."""
        x = lse.squeeze(-1) if self.ndim == 3 else lse
        return x if self.head_major else x.t()

    def view(self, flat: torch.Tensor, total: int, heads: int) -> torch.Tensor:
        """The first ``total * heads`` elements of ``flat`` as an lse in this layout."""
        mem = flat[: total * heads]
        mem = mem.view(total, heads) if self.token_outer else mem.view(heads, total)
        logical = mem if self.token_outer != self.head_major else mem.t()
        return logical.unsqueeze(-1) if self.ndim == 3 else logical


@dataclass(frozen=True, eq=False)
class OpTraits:
    """The op on one device: its lse layout, causal alignment, host cost of a repeated call, whether a call
    can be captured in a CUDA graph, and the dropout placeholders its backward takes."""

    lse: LseLayout
    bottom_right: bool
    call_ms: float
    capturable: bool
    seed: torch.Tensor | None
    offset: torch.Tensor | None

    @property
    def rebuilds_graph(self) -> bool:
        return self.call_ms > REBUILD_MS


_traits: dict[str, OpTraits] = {}


def op_traits(device: torch.device) -> OpTraits:
    """The op's traits on ``device`` (probed on first use; raises what the op raises when it cannot run)."""
    key = str(device)
    if key not in _traits:
        _traits[key] = _probe(device)
    return _traits[key]


_usable: dict[str, bool] = {}


def usable(device: torch.device) -> bool:
    """True when the cuDNN varlen op runs correctly on ``device`` (a CUDA GPU; probed once)."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _usable:
        try:
            op_traits(device)
            _usable[key] = True
        except (RuntimeError, NotImplementedError, AttributeError, ValueError, AssertionError):
            _usable[key] = False
    return _usable[key]


def _reference(q, k, v, cu_q, cu_k, scale, bottom_right):
    """float64 ``(out (total, H, D), lse (H, total))`` of causal blocks, for the probe."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        kk = k[c:d].double().repeat_interleave(group, 1)
        vv = v[c:d].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * scale
        i = torch.arange(b - a, device=q.device)[:, None]
        j = torch.arange(d - c, device=q.device)[None, :]
        s = s.masked_fill(j > i + ((d - c) - (b - a) if bottom_right else 0), -math.inf)
        lse[:, a:b] = torch.logsumexp(s, -1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    return out, lse


def host_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Host milliseconds of one call of ``fn`` after the device is idle (tests replace this)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe(device: torch.device) -> OpTraits:
    """Run the op on small causal blocks (GQA, a block with more keys than queries) and read off its lse
    layout, causal alignment and per-call host cost; check it against float64; try capturing it."""
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens, heads, kv_heads, dim = (2, 3), (5, 3), 2, 1, 64
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), kv_heads, dim, generator=g).to(device, torch.bfloat16) for _ in "kv")
    cq, ck = [0, 2, 5], [0, 5, 8]
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in (cq, ck))
    args = (cu_q, cu_k, max(q_lens), max(k_lens), True, 0.125)
    out, lse, seed, offset = op_forward(q, k, v, *args)
    total = q.shape[0]
    dims = tuple(lse.shape)
    if dims[:2] not in ((total, heads), (heads, total)) or (lse.dim() == 3 and dims[2] != 1):
        raise RuntimeError(f"cuDNN varlen lse has shape {dims}; expected (total, heads[, 1]) or "
                           "(heads, total).")
    head_major = dims[0] == heads
    t_dim, h_dim = (1, 0) if head_major else (0, 1)
    layout = LseLayout(lse.dim(), head_major, lse.stride(t_dim) > lse.stride(h_dim))
    got_lse = layout.rows(lse).double()
    for bottom_right in (True, False):
        ref_out, ref_lse = _reference(q, k, v, cq, ck, 0.125, bottom_right)
        out_ok = (out.double() - ref_out).norm() <= 2e-2 * ref_out.norm()
        if out_ok and (got_lse - ref_lse).abs().max() < 2e-2:
            break
    else:
        raise RuntimeError("cuDNN varlen op matches neither causal alignment on the probe blocks.")
    times = [host_ms(lambda: op_forward(q, k, v, *args), device) for _ in range(3)]
    traits = OpTraits(layout, bottom_right, min(times), False, seed, offset)
    if traits.rebuilds_graph:
        capturable = _captures(q, k, v, out, args)
        traits = OpTraits(layout, bottom_right, min(times), capturable, seed, offset)
    return traits


def _captures(q, k, v, out, args) -> bool:
    """Whether a captured forward call replays to the eager result."""
    static = [x.clone() for x in (q, k, v)]
    dst = torch.full_like(out, math.nan)  # poisoned: a replay that writes nothing fails the check

    def call():
        dst.copy_(op_forward(*static, *args)[0])

    try:
        capture(call, q.device, graph_pool(q.device))()
        _sync(q.device)
    except RuntimeError:
        return False
    return bool((dst.float() - out.float()).abs().max() <= 1e-2 * out.float().abs().max())


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

    def __init__(self, traits: OpTraits) -> None:
        self.traits = traits

    def forward(self, part: DocBlocks, q, k, v, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (total_q, heads, dim), lse rows (heads, total_q))`` of the part's rows."""
        qg, kg, vg = _gather(q, part.q_rows), _gather(k, part.k_rows), _gather(v, part.k_rows)
        o, lse, _, _ = op_forward(qg, kg, vg, *_op_args(part), scale)
        return o, self.traits.lse.rows(lse)

    def backward(self, part: DocBlocks, dout, q, k, v, out, rows_lse, scale):
        """``(dq, dk, dv)`` rows of the part, given its rows' global out and ``(heads, total_q)`` lse."""
        qg, kg, vg = _gather(q, part.q_rows), _gather(k, part.k_rows), _gather(v, part.k_rows)
        dog, og = _gather(dout.to(q.dtype), part.q_rows), _gather(out.to(q.dtype), part.q_rows)
        heads, tr = q.shape[2], self.traits
        op_lse = tr.lse.view(torch.empty(part.total_q * heads, dtype=rows_lse.dtype, device=q.device),
                             part.total_q, heads)
        tr.lse.rows(op_lse).copy_(rows_lse)
        return op_backward(dog, qg, kg, vg, og, op_lse, tr.seed, tr.offset, *_op_args(part), scale)


class _Statics:
    """Static buffers and captured calls of one shape class; growing the buffers drops the calls."""

    NAMES_Q = ("q", "o", "do", "dq")
    NAMES_K = ("k", "v", "dk", "dv")

    def __init__(self, device, dtype, heads, kv_heads, dim) -> None:
        self.device, self.dtype, self.heads, self.kv_heads, self.dim = device, dtype, heads, kv_heads, dim
        self.cap_q = self.cap_k = 0
        self.bufs: dict[str, torch.Tensor] = {}
        self.calls: OrderedDict = OrderedDict()
        self.pool = graph_pool(device)

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
            run = capture(fn, self.device, self.pool)
        self.calls[key] = run
        if len(self.calls) > MAX_GRAPHS:
            self.calls.popitem(last=False)
        run()


class _GraphCalls:
    """Each planned call runs as a CUDA graph captured once per (part, kind, scale) and replayed."""

    def __init__(self, traits: OpTraits) -> None:
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
            o, lse, _, _ = op_forward(qs, ks, vs, *_op_args(part), scale)
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
            res = op_backward(dos, qs, ks, vs, os_, op_lse, tr.seed, tr.offset, *_op_args(part), scale)
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
