"""The ``"cudnn_fe"`` backend: cuDNN's own variable-length attention, through the torch ops of the optional
``nvidia-cudnn-frontend`` package (``pip install 'lightseq_hf[cudnn]'``), behind the kernel contract.

Each call feeds ``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd`` the task's document blocks (:class:`DocBlocks`,
as ``flash_varlen``) as packed ``(tokens, heads, dim)`` rows with their own ``cu_seqlens_q`` and
``cu_seqlens_kv`` (rows of one shard against the keys of another), GQA native (key/value heads never
expanded). The forward returns out and the lse (``(tokens, heads, 1)`` float32, natural log), merged into
the running out/lse; the backward takes the rows' *global* out and lse (the lse padded to
``(sequences, heads, max_seqlen)``, the layout the op's packed backward reads), so the gradients of all
calls add up to the full gradient. Without ``doc_blocks`` every batch row is one block.

A call that is one op call over every row (a whole packed row on one rank) reads the caller's tensors and
returns the op's own output and gradients: no gather, merge or float32 copy. Otherwise the op reads views
wherever the rows are one run, and gradients not added into given buffers come back in the input dtype.

What the op is asked for is planned once per layout, with the cuts of :mod:`.rows`:

- Rows that see no key are not fed (:func:`~.rows.fed_blocks`), so the op never computes a row without a key.
- Causal blocks go to the op square (:func:`~.rows.aligned_calls`): its backward with ``causal_bottom_right``
  runs 1.7x slower than with its default top-left alignment (cuDNN 9.19 on an H100, 64K tokens in 9
  documents: 46.6 against 27.3 ms forward+backward; the forward is the same), and the two agree on square
  blocks.
- cuDNN before 9.26 can return NaN in dQ on Hopper when a sequence's key length is 64 mod 128 and a row's
  lse is below -88.7. Where that can happen (:func:`key_length_hazard`, every GPU to be safe), the backward
  takes such a block without its first key (:func:`~.rows.backward_plan`) and the pairs of its rows with that
  key are computed here (:func:`_key_pairs_backward`) from the rows' global lse, so the two add up to the
  block's gradients exactly, in one op call of the same shape as the forward's.
- Graph shapes (:class:`GraphShapes`): the op builds one cuDNN graph per (documents, longest sequences,
  and in backward the rows of its query-side and key-side tensors rounded to 64, ...) and keeps 128 of them;
  a build takes 0.1 s. A changing packed stream would build on every step, so each call asks for a bucketed
  shape (documents and longest sequence rounded up to a power of two, the documents padded with empty ones)
  or reuses a larger shape already built when that wastes little (:func:`graph_stats` counts them). The
  backward's tensors need no copy to get there (:func:`backward_tokens`): where the storage of the tensor
  holding a side's rows continues for the bucket's rows from the first fed one, the op reads a view of them
  (it reads no row past the last sequence); where every row of a tensor is fed and its count is a run's
  local length, a view of the tensor; only other runs are copied into a bucket-sized buffer (a ring task's
  keys that end its chunk, rows received from another rank).

cuDNN 9.22-9.26, whose packed backward can return all-zero gradients, is refused
(:data:`ZERO_GRADIENT_VERSIONS`). bf16/fp16 CUDA tensors, head dims that are multiples of 8 up to 128; no
sliding window (the contract carries windows as key ranges; use ``triton``), no soft-cap. The package is
imported on first use only.
"""

from __future__ import annotations

import importlib
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base import Capabilities, DocBlocks, KernelBase, Rows
from ..working_memory import BackwardMemory, Workspace
from .rows import (
    KeyPairs,
    RowMap,
    accumulate_dtype,
    aligned_calls,
    backward_plan,
    check_backward_rows,
    check_blocks,
    fed_blocks,
    gather_rows,
    gradient_buffers,
    in_accumulate_dtype,
    merge_rows,
    needs_bottom_right,
    running_buffers,
    storage_rows,
    whole,
    whole_rows,
)

__all__ = ["CudnnFeKernel", "GraphShape", "GraphShapes", "OpSet", "ZERO_GRADIENT_VERSIONS", "backward_tokens",
           "bucket", "graph_stats", "key_length_hazard", "load_ops", "ops", "unavailable_reason"]

#: cuDNN versions ``[first, after)`` whose packed (ragged) backward with head-major statistics can return
#: all-zero gradients: refused
ZERO_GRADIENT_VERSIONS = (92200, 92700)
#: cuDNN versions (``major * 10000 + minor * 100 + patch``) whose backward can return NaN dQ for key lengths
#: 64 mod 128 (fixed in 9.26)
_NAN_DQ_FIXED = 92600
_PACKAGE = "nvidia-cudnn-frontend"


@dataclass(frozen=True)
class OpSet:
    """The package's two ops, its graph cache (read by :func:`graph_stats`) and the cuDNN it loaded."""

    forward: Callable
    backward: Callable
    graphs: dict
    cudnn_version: int


def load_ops() -> OpSet:
    """Import the package's torch op module (which registers ``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd``).
    Tests replace this function with a CPU emulation."""
    import cudnn

    module = importlib.import_module("cudnn.sdpa.fwd.torch_op")
    return OpSet(torch.ops.cudnn.sdpa_fwd, torch.ops.cudnn.sdpa_bwd, module._graph_cache,
                 int(cudnn.backend_version()))


_loaded: dict[str, OpSet | str] = {}


def _version_text(version: int, patch: bool = True) -> str:
    text = f"{version // 10000}.{version // 100 % 100}"
    return f"{text}.{version % 100}" if patch else text


def unavailable_reason() -> str | None:
    """Why the op cannot serve here (a phrase completing "backend 'cudnn_fe' ..."), or None; loads the
    package once."""
    if "ops" not in _loaded:
        try:
            _loaded["ops"] = load_ops()
        except ImportError as err:
            if (err.name or "").split(".")[0] == "cudnn":
                _loaded["ops"] = (f"needs the {_PACKAGE} package (pip install 'lightseq_hf[cudnn]'), which "
                                  "is not installed")
            else:
                _loaded["ops"] = f"could not import the {_PACKAGE} package ({err})"
        except Exception as err:  # noqa: BLE001 - a package that cannot load is a refusal, said in one line
            _loaded["ops"] = (f"could not load the {_PACKAGE} package ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})")
    found = _loaded["ops"]
    if isinstance(found, str):
        return found
    first, after = ZERO_GRADIENT_VERSIONS
    if first <= found.cudnn_version < after:
        bad = f"{_version_text(first, False)} to {_version_text(after - 100, False)}"
        return (f"runs on cuDNN {_version_text(found.cudnn_version)}, whose packed backward can return "
                f"all-zero gradients (cuDNN {bad}); use another cuDNN")
    return None


def ops() -> OpSet:
    """The loaded ops; ValueError naming the problem when they cannot serve."""
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"backend 'cudnn_fe' {reason}; use backend='triton' or 'auto'.")
    return _loaded["ops"]  # type: ignore[return-value]


def key_length_hazard(cudnn_version: int) -> bool:
    """Whether backward calls must avoid key lengths that are 64 mod 128 on this cuDNN."""
    return cudnn_version < _NAN_DQ_FIXED


def graph_stats() -> dict[str, int]:
    """``graphs``: cuDNN graphs the op holds now (every build adds one; it keeps 128); ``shapes``: graph
    shapes this process has asked for and remembers."""
    found = _loaded.get("ops")
    return {"graphs": len(found.graphs) if isinstance(found, OpSet) else 0, "shapes": len(_shapes)}


# --- graph shapes ---------------------------------------------------------------------------------------

#: smallest bucketed longest-sequence and token total (the op's tiles are 128 rows)
_MIN_LENGTH = 128
#: a built shape serves a smaller call when its grid (documents x longest sequence) is at most this many
#: times the call's own bucketed grid, and (a copied side) its rows at most this many times the bucket
_REUSE_GRID = 4
_REUSE_TOKENS = 2
#: shapes remembered per static key (the op caches 128 graphs in all)
_REMEMBERED = 24


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two that is at least ``n`` and ``floor``."""
    n = max(n, floor, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class GraphShape:
    """The shape of one op graph: ``docs`` sequences (``cu_seqlens`` of ``docs + 1`` entries), ``max_len``
    the longest query and key sequence it declares, ``q_tokens`` / ``k_tokens`` the rows of the
    backward's query-side and key-side tensors (0 in forward, whose graph does not depend on them)."""

    docs: int
    max_len: int
    q_tokens: int = 0
    k_tokens: int = 0

    @property
    def grid(self) -> int:
        return self.docs * self.max_len

    @classmethod
    def bucketed(cls, blocks: DocBlocks, tokens: tuple[int, int] = (0, 0)) -> GraphShape:
        """The bucketed shape of a call over ``blocks`` with backward tensors of ``tokens`` rows."""
        return cls(bucket(blocks.num_blocks), bucket(max(blocks.max_q, blocks.max_k), _MIN_LENGTH), *tokens)


_Span = tuple[int, int]  # the token counts [lo, hi] a side's tensor may have
#: a tensor whose rows all go to the op keeps its own row count as the graph's when that count is a multiple
#: of this (a run's local length: one graph for every call); other counts are rounded up to a bucket
_WHOLE_UNIT = 1024


def backward_tokens(rows: Rows, total: int, tensor_rows: int, storage_rows: int) -> tuple[int, _Span]:
    """The rows of one side's backward tensor for ``total`` fed ``rows`` of a tensor of ``tensor_rows`` rows
    followed in its storage by ``storage_rows - tensor_rows`` more, and the span of counts an already built
    graph may have for that side (see the module docstring): the bucket where the storage reaches it from
    the first fed row (a view; any count up to what it reaches), the tensor's own rows where they are all
    fed and their count is a multiple of :data:`_WHOLE_UNIT` (a view), else the bucket (copied; up to
    :data:`_REUSE_TOKENS` times it)."""
    need = bucket(total, _MIN_LENGTH)
    if isinstance(rows, slice):
        if rows.start + need <= storage_rows:
            return need, (total, storage_rows - rows.start)
        if rows.start == 0 and rows.stop == tensor_rows and tensor_rows % _WHOLE_UNIT == 0:
            return tensor_rows, (tensor_rows, tensor_rows)
    return need, (need, _REUSE_TOKENS * need)


class GraphShapes:
    """The graph shapes this process has asked the op for, per static key (device, dtype, heads, head dims,
    scale, mask flags, forward or backward); :meth:`choose` picks the shape of a call."""

    def __init__(self) -> None:
        self._shapes: dict[tuple, OrderedDict[GraphShape, None]] = {}

    def choose(self, static: tuple, need: GraphShape, spans: tuple[_Span, _Span] | None = None) -> GraphShape:
        """The smallest remembered shape covering ``need`` within the reuse bounds (its token counts inside
        ``spans``; None: equal to ``need``'s), else ``need`` itself (then remembered; the least recently
        chosen shape of the key is forgotten past :data:`_REMEMBERED`)."""
        shapes = self._shapes.setdefault(static, OrderedDict())
        spans = spans or ((need.q_tokens, need.q_tokens), (need.k_tokens, need.k_tokens))
        (q_lo, q_hi), (k_lo, k_hi) = spans
        fits = [s for s in shapes if s.docs >= need.docs and s.max_len >= need.max_len
                and s.grid <= _REUSE_GRID * need.grid and q_lo <= s.q_tokens <= q_hi
                and k_lo <= s.k_tokens <= k_hi]
        chosen = min(fits, key=lambda s: (s.grid, s.q_tokens + s.k_tokens)) if fits else need
        shapes[chosen] = None
        shapes.move_to_end(chosen, last=False)
        while len(shapes) > _REMEMBERED:
            shapes.popitem()
        return chosen

    def __len__(self) -> int:
        return sum(len(s) for s in self._shapes.values())

    def clear(self) -> None:
        self._shapes.clear()


#: the graph shapes this process has asked the op for
_shapes = GraphShapes()
#: per blocks object: its cumulative lengths padded to a graph's sequences
_cu: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _padded_cu_seqlens(blocks: DocBlocks, docs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks``' cumulative query and key lengths padded to ``docs`` sequences with empty ones (the last
    total repeated), int32 on the blocks' device; cached."""
    per_blocks = _cu.setdefault(blocks, {})
    if docs not in per_blocks:
        extra = docs - blocks.num_blocks
        if extra < 0:
            raise ValueError(f"a graph of {docs} sequences cannot take {blocks.num_blocks} blocks.")
        per_blocks[docs] = tuple(torch.cat([cu, cu[-1:].expand(extra)]) for cu in (blocks.cu_q, blocks.cu_k))
    return per_blocks[docs]


# --- one op call ---------------------------------------------------------------------------------------

def _static(kind: str, call: DocBlocks, q, k, v, scale: float, deterministic: bool = False) -> tuple:
    """What, besides the :class:`GraphShape`, keys the op's graph of a call."""
    return (kind, str(q.device), q.dtype, q.shape[2], k.shape[2], q.shape[3], v.shape[3], scale, call.causal,
            deterministic)


def _op_forward(call: DocBlocks, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (total_q, heads, dim), lse (heads, total_q))`` of the call's fed rows (views of what the op
    returned)."""
    shape = _shapes.choose(_static("forward", call, q, k, v, scale), GraphShape.bucketed(call))
    cu_q, cu_k = _padded_cu_seqlens(call, shape.docs)
    qg, kg, vg = gather_rows(q, call.q_rows), gather_rows(k, call.k_rows), gather_rows(v, call.k_rows)
    o, stats = ops().forward(qg, kg, vg, scale, is_causal=call.causal,
                             causal_bottom_right=needs_bottom_right(call), cu_seqlens_q=cu_q,
                             cu_seqlens_kv=cu_k, max_seqlen_q=shape.max_len, max_seqlen_kv=shape.max_len,
                             return_lse=True)
    return o[:call.total_q], in_accumulate_dtype(stats[:call.total_q, :, 0]).t()


def _padded_lse(rows_lse: torch.Tensor, call: DocBlocks, shape: GraphShape) -> torch.Tensor:
    """``(heads, total_q)`` global lse -> the op's ``(docs, heads, max_len)``; a row that saw no key
    (``-inf``) goes in as ``+inf``, so its probabilities are 0, not NaN."""
    rows_lse = in_accumulate_dtype(rows_lse)
    rows_lse = torch.where(torch.isneginf(rows_lse), math.inf, rows_lse)
    block, pos = call.padded_lse_index
    padded = rows_lse.new_zeros((shape.docs, rows_lse.shape[0], shape.max_len))
    padded[block, :, pos] = rows_lse.t()
    return padded


def _op_backward(call: DocBlocks, dout, q, k, v, out, lse, scale: float) -> tuple[torch.Tensor, ...]:
    """``(dq (total_q, heads, dim), dk, dv (total_k, kv_heads, dim))`` of the call's fed rows and keys, in
    the input dtype (views of what the op returned). The op reads views of ``q``/``out``/``dout`` and
    ``k``/``v`` where their rows allow (:func:`backward_tokens`)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    q_room = min(storage_rows(x) for x in (q, out, dout))
    q_tokens, q_span = backward_tokens(call.q_rows, call.total_q, q.shape[0] * q.shape[1], q_room)
    k_room = min(storage_rows(k), storage_rows(v))
    k_tokens, k_span = backward_tokens(call.k_rows, call.total_k, k.shape[0] * k.shape[1], k_room)
    shape = _shapes.choose(_static("backward", call, q, k, v, scale, deterministic),
                           GraphShape.bucketed(call, (q_tokens, k_tokens)), (q_span, k_span))
    cu_q, cu_k = _padded_cu_seqlens(call, shape.docs)
    qg, og, dog = (gather_rows(x.to(q.dtype), call.q_rows, shape.q_tokens) for x in (q, out, dout))
    kg, vg = (gather_rows(x, call.k_rows, shape.k_tokens) for x in (k, v))
    op_lse = _padded_lse(RowMap(call.q_rows, q.shape[0], q.shape[1], q.device).take_lse(lse), call, shape)
    gq, gk, gv = ops().backward(dog, qg, kg, vg, og, op_lse, scale, is_causal=call.causal,
                                causal_bottom_right=needs_bottom_right(call), cu_seqlens_q=cu_q,
                                cu_seqlens_kv=cu_k, max_seqlen_q=shape.max_len, max_seqlen_kv=shape.max_len,
                                is_deterministic=deterministic)
    return gq[:call.total_q], gk[:call.total_k], gv[:call.total_k]


def _add_rows(call: DocBlocks, q, k, grads, parts) -> None:
    """Add one call's ``(dq, dk, dv)`` rows (:func:`_op_backward`) into the local call's ``grads`` (a
    float32 target takes the op's bf16 in one pass)."""
    rows = RowMap(call.q_rows, q.shape[0], q.shape[1], q.device)
    rows.put(grads[0], parts[0], accumulate=True)
    key_rows = RowMap(call.k_rows, k.shape[0], k.shape[1], q.device)
    key_rows.put(grads[1], parts[1], accumulate=True)
    key_rows.put(grads[2], parts[2], accumulate=True)


def _key_pairs_backward(pairs: KeyPairs, dout, q, k, v, out, lse, scale: float, grads) -> None:
    """Add the gradients of single (row, key) pairs into ``grads``, computed from the rows' global lse and
    out (float32; ``delta`` from the output in the input dtype, as the op computes it)."""
    b, lq, h, d = q.shape
    hk, group = k.shape[2], h // k.shape[2]
    rows = RowMap(pairs.q_rows, b, lq, q.device)
    keys = RowMap(pairs.k_rows, k.shape[0], k.shape[1], q.device)
    acc = accumulate_dtype(q.dtype)
    qr, dr, outr = (rows.take(x).to(q.dtype).to(acc) for x in (q, dout, out))  # (pairs, heads, dim)
    kr, vr = (keys.take(x).to(acc).repeat_interleave(group, 1) for x in (k, v))
    row_lse = in_accumulate_dtype(rows.take_lse(lse)).t()
    p = torch.exp((qr * kr).sum(-1) * scale - torch.where(torch.isneginf(row_lse), math.inf, row_lse))
    ds = p * ((dr * vr).sum(-1) - (dr * outr).sum(-1))  # (pairs, heads)
    rows.put(grads[0], ds[..., None] * kr * scale, accumulate=True)
    keys.put(grads[1], (ds[..., None] * qr * scale).view(-1, hk, group, d).sum(2), accumulate=True)
    keys.put(grads[2], (p[..., None] * dr).view(-1, hk, group, dr.shape[-1]).sum(2), accumulate=True)


# --- the kernel ----------------------------------------------------------------------------------------

class CudnnFeKernel(KernelBase):
    """Local attention through cuDNN's variable-length op (``nvidia-cudnn-frontend``), one forward and one
    backward call per task for all its documents."""

    name = "cudnn_fe"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dim_multiple=8,
        max_head_dim=128,
        supports_doc_blocks=True,
        needs_out_in_backward=True,
        # the op's dq/dk/dv, returned in the input dtype (float32 sums where a call takes several op calls:
        # rows starting inside their documents, the key-length parts); under GQA the workspace of cuDNN's
        # backward as measured through torch's cuDNN attention (the SDPA kernel's; not measured through
        # this op); in a ring task, keys and values copied into the op's bucketed graph shape (up to twice
        # their rows) where their tensor's storage has no room past them
        backward_memory=BackwardMemory("cudnn_fe kernel", partials="input", workspace=(
            Workspace("dq/dk/dv from the op (compute dtype)", "qkv"),
            Workspace("float32 sums of a call taken in parts", "qkv", "float32"),
            Workspace("GQA backward workspace (float32)", "q", "float32", 2, "gqa"),
            Workspace("keys and values padded to a graph shape", "kv", "input", 4, "ring"))),
    )

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        return unavailable_reason()

    def _fed(self, q, k, mask) -> DocBlocks:
        if mask.doc_blocks is None:
            return fed_blocks(whole_rows(q.shape[0], q.shape[1], k.shape[1], mask.causal, q.device))
        check_blocks(mask.doc_blocks, q, k)
        return fed_blocks(mask.doc_blocks)

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        """``(out, lse)`` of ``q`` against ``k``/``v`` over the blocks; with ``out``/``lse`` given, merges
        the fed rows into them (other rows untouched). One op call over every row of ``q`` returns the op's
        own output (no copy, no merge)."""
        blocks = self._fed(q, k, mask)
        calls = aligned_calls(blocks) if blocks.num_blocks else ()
        if out is None and lse is None and len(calls) == 1 and whole(calls[0].q_rows, q):
            o, rows_lse = _op_forward(calls[0], q, k, v, scale)
            b, lq, h = q.shape[:3]
            return o.view(b, lq, h, v.shape[-1]), rows_lse.reshape(h, b, lq).transpose(0, 1).contiguous()
        out, lse, accumulate = running_buffers(q, v, out, lse)
        for i, call in enumerate(calls):
            o, rows_lse = _op_forward(call, q, k, v, scale)
            merge_rows(RowMap(call.q_rows, q.shape[0], q.shape[1], q.device), out, lse, o, rows_lse,
                       accumulate or i > 0)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        """``(dq, dk, dv)`` of this call, added into ``dq``/``dk``/``dv`` when given; the others are returned
        in the input dtype (summed in float32 when the call takes several op calls). ``out`` and ``lse`` are
        the query rows' global results; ``delta`` is not taken (the op recomputes it). One op call over
        every row and key returns the op's own gradients."""
        check_backward_rows(self.name, dout, q, out)
        blocks = self._fed(q, k, mask)
        hazard = key_length_hazard(ops().cudnn_version)
        plans = [backward_plan(c, hazard) for c in aligned_calls(blocks)] if blocks.num_blocks else []
        one_call = len(plans) == 1 and plans[0][1] is None
        given = dq is not None or dk is not None or dv is not None
        if one_call and not given and whole(plans[0][0].q_rows, q) and whole(plans[0][0].k_rows, k):
            gq, gk, gv = _op_backward(plans[0][0], dout, q, k, v, out, lse, scale)
            return gq.view(q.shape), gk.view(k.shape), gv.view(v.shape)
        grads = gradient_buffers(q, k, v, dq, dk, dv, q.dtype if one_call else None)
        for call, pairs in plans:
            _add_rows(call, q, k, grads, _op_backward(call, dout, q, k, v, out, lse, scale))
            if pairs is not None:
                _key_pairs_backward(pairs, dout, q, k, v, out, lse, scale, grads)
        return tuple(g if given is not None else g.to(x.dtype)
                     for g, given, x in zip(grads, (dq, dk, dv), (q, k, v)))
