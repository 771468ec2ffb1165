"""The ``"flash_varlen"`` backend: torch's FlashAttention-2 variable-length kernels behind the contract.

Each call feeds ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` a list of
independent *document blocks* (:class:`DocBlocks`): block ``i`` is query rows ``cu_q[i]:cu_q[i+1]`` of the
gathered (flattened ``batch * q_len``) query rows against key rows ``cu_k[i]:cu_k[i+1]`` of the gathered
keys, with one causal flag for all blocks (FlashAttention aligns the causal mask bottom-right, the
contract's rule). Rows fed to no block keep their running ``(out, lse)`` (non-accumulating calls give them
out 0 and lse ``-inf``) and get no gradient. Without ``doc_blocks`` every batch row is one block (plain
causal or full attention). GQA is native: key/value heads are never expanded.

The ops take bfloat16/float16 CUDA tensors with head dims up to 256 (multiples of 8). Their backward
recomputes ``delta`` from ``out``, so this backend needs the output in backward (no gradient through the
returned lse), like the SDPA ones.

This module knows nothing of documents, segments or schedules: callers build the blocks.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .base import Capabilities, DocBlocks, KernelBase, Rows, make_doc_blocks, merge_into

__all__ = ["DocBlocks", "FlashVarlenKernel", "make_doc_blocks", "usable", "whole_rows"]

_DTYPES = (torch.float16, torch.bfloat16)


def whole_rows(batch: int, q_len: int, kv_len: int, causal: bool, device: torch.device | str) -> DocBlocks:
    """Every batch row as one block (plain attention; causal aligned bottom-right); cached."""
    return _whole_rows(batch, q_len, kv_len, causal, str(device))


@lru_cache(maxsize=64)
def _whole_rows(batch: int, q_len: int, kv_len: int, causal: bool, device: str) -> DocBlocks:
    if batch == 0 or q_len == 0 or kv_len == 0:
        return make_doc_blocks((), (), [], [], causal, device)
    return make_doc_blocks((q_len,) * batch, (kv_len,) * batch, slice(0, batch * q_len),
                           slice(0, batch * kv_len), causal, device)


# --- the ops (tests replace these two with a CPU emulation) -------------------------------------------

def check_flash_inputs(q: torch.Tensor) -> None:
    """Raise ValueError naming the fix when the flash varlen ops cannot take ``q``'s kind of tensor."""
    if q.device.type != "cuda":
        raise ValueError(
            f"backend 'flash_varlen' runs torch's FlashAttention kernels and needs CUDA tensors; got "
            f"{q.device}. "
            "Use backend='reference' or 'auto' on the CPU."
        )
    if q.dtype not in _DTYPES:
        raise ValueError(
            f"backend 'flash_varlen' takes float16 or bfloat16, not {q.dtype}; cast the inputs or use "
            "backend='triton' or 'reference'."
        )
    d = q.shape[-1]
    if d % 8 or d > 256:
        raise ValueError(
            f"backend 'flash_varlen' takes head dims that are multiples of 8 up to 256; got {d}. "
            "Use backend='triton' or 'reference'."
        )


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(out, lse, rng_state, unused)`` of the varlen op: ``q`` ``(total_q, heads, dim)``, ``k``/``v``
    ``(total_k, kv_heads, dim)``.

    The lse is ``(heads, total_q)`` (torch builds with FlashAttention >= 2.5's unpadded lse, which the
    lead's torch 2.11 is expected to be) or ``(blocks, heads, max_q)`` (older builds); callers detect which
    by its number of dimensions.
    """
    check_flash_inputs(q)
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return res[0], res[1], res[2], res[3]


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, rng, unused):
    """``(dq, dk, dv)`` of the varlen op (in the input dtype); ``lse`` in the layout the forward returns;
    ``rng``/``unused``: the placeholders a forward without dropout returned (never read without dropout;
    passing the forward's own keeps their dtype and device what this torch build expects)."""
    check_flash_inputs(q)
    res = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
    )
    return res[0], res[1], res[2]


#: per device: (lse in the padded layout?, the forward's rng_state and unused placeholders), probed once
_probed: dict[str, tuple[bool, torch.Tensor | None, torch.Tensor | None]] = {}


def _probe(device: torch.device) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
    key = str(device)
    if key not in _probed:
        x = torch.zeros(4, 1, 8, dtype=torch.float16, device=device)
        cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
        _, lse, rng, unused = varlen_forward(x, x, x, cu, cu, 3, 3, True, 1.0)
        _probed[key] = (lse.dim() == 3, rng, unused)
    return _probed[key]


def lse_is_padded(device: torch.device) -> bool:
    """Whether the varlen ops on ``device`` use the ``(blocks, heads, max_q)`` lse layout (probed once)."""
    return _probe(device)[0]


_usable: dict[str, bool] = {}


def usable(device: torch.device) -> bool:
    """True when the flash varlen op runs on ``device`` (a CUDA GPU whose torch build has it; probed once)."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _usable:
        try:
            lse_is_padded(device)
            _usable[key] = True
        except (RuntimeError, NotImplementedError, AttributeError):
            _usable[key] = False
    return _usable[key]


# --- row plumbing --------------------------------------------------------------------------------------

class _RowMap:
    """Fed rows of ``(batch, length, ...)`` tensors (flat row ``r`` is ``[r // length, r % length]``):
    views when the rows are a run inside one batch row, else advanced indices."""

    def __init__(self, rows: Rows, batch: int, length: int, device: torch.device) -> None:
        self.view: tuple[int, slice] | None = None
        if isinstance(rows, slice):
            b0 = rows.start // length if length else 0
            if rows.stop - rows.start == 0 or (rows.stop - 1) // length == b0:
                self.view = (b0, slice(rows.start - b0 * length, rows.stop - b0 * length))
                return
            rows = torch.arange(rows.start, rows.stop, device=device)
        self.batch_idx = torch.div(rows, length, rounding_mode="floor")
        self.pos_idx = rows - self.batch_idx * length

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, length, H, D)`` -> ``(total, H, D)`` (a view when possible)."""
        if self.view is not None:
            return x[self.view[0], self.view[1]]
        return x[self.batch_idx, self.pos_idx]

    def take_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """``(batch, H, length)`` -> ``(H, total)`` (a view when possible)."""
        if self.view is not None:
            return lse[self.view[0], :, self.view[1]]
        return lse[self.batch_idx, :, self.pos_idx].t()

    def put(self, x: torch.Tensor, values: torch.Tensor, *, accumulate: bool = False) -> None:
        """Write (or add) ``(total, H, D)`` values into the rows of ``(batch, length, H, D)`` ``x``."""
        if self.view is not None:
            dst = x[self.view[0], self.view[1]]
            if accumulate:
                dst.add_(values)
            else:
                dst.copy_(values)
        else:
            x.index_put_((self.batch_idx, self.pos_idx), values.to(x.dtype), accumulate=accumulate)

    def put_lse(self, lse: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``(H, total)`` values into the rows of ``(batch, H, length)`` ``lse``."""
        if self.view is not None:
            lse[self.view[0], :, self.view[1]] = values
        else:
            lse[self.batch_idx, :, self.pos_idx] = values.t().to(lse.dtype)


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _gather(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Rows of ``x`` ``(batch, length, H, D)`` flattened, contiguous ``(total, H, D)``."""
    flat = _flat_rows(x)
    return (flat[rows] if isinstance(rows, slice) else flat.index_select(0, rows)).contiguous()


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


def _lse_rows(lse: torch.Tensor, blocks: DocBlocks) -> torch.Tensor:
    """The op's lse as ``(heads, total_q)`` float32, from either layout; rows that see no key get
    ``-inf`` (FlashAttention writes ``+inf`` there; only causal blocks with more queries than keys
    have such rows)."""
    if lse.dim() == 2:
        rows = _acc(lse)
    else:
        block, pos = blocks.padded_lse_index
        rows = _acc(lse[block, :, pos].t())
    if blocks.causal and any(m > n for m, n in zip(blocks.q_lens, blocks.k_lens)):
        rows = torch.where(rows == math.inf, -math.inf, rows)
    return rows


def _lse_for_op(rows_lse: torch.Tensor, blocks: DocBlocks, padded: bool) -> torch.Tensor:
    """``(heads, total_q)`` float32 lse in the layout the op takes; a row that saw no key (``-inf``) goes
    in as ``+inf`` (what the forward gives such rows), so its probabilities are 0, not NaN."""
    rows_lse = torch.where(torch.isneginf(rows_lse), math.inf, rows_lse)
    if not padded:
        return rows_lse.contiguous()
    block, pos = blocks.padded_lse_index
    out = rows_lse.new_zeros((blocks.num_blocks, rows_lse.shape[0], blocks.max_q))
    out[block, :, pos] = rows_lse.t()
    return out


def _check_blocks(blocks: DocBlocks, q: torch.Tensor, k: torch.Tensor) -> None:
    rows_q, rows_k = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
    for name, rows, total, limit in (("q_rows", blocks.q_rows, blocks.total_q, rows_q),
                                     ("k_rows", blocks.k_rows, blocks.total_k, rows_k)):
        if isinstance(rows, slice) and not (0 <= rows.start <= rows.stop <= limit
                                            and rows.stop - rows.start == total):
            raise ValueError(f"doc_blocks {name} {rows} does not fit {total} fed rows of {limit}.")
        if isinstance(rows, torch.Tensor) and (rows.numel() != total or rows.device != q.device):
            raise ValueError(f"doc_blocks {name} has {rows.numel()} indices on {rows.device}; the blocks "
                             f"feed {total} rows on {q.device}.")
    if blocks.cu_q.device != q.device:
        raise ValueError(f"doc_blocks live on {blocks.cu_q.device}; the tensors on {q.device}.")


class FlashVarlenKernel(KernelBase):
    """Local attention through torch's FlashAttention-2 varlen ops, one call per task for all its blocks."""

    name = "flash_varlen"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset(_DTYPES),
        head_dim_multiple=8,
        max_head_dim=256,
        supports_doc_blocks=True,
        needs_out_in_backward=True,
    )

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        if usable(device):
            return None
        return ("runs torch's FlashAttention-2 varlen kernels and needs a CUDA GPU whose torch build has "
                f"them (torch.ops.aten._flash_attention_forward); tensors are on {device}")

    def _blocks(self, q, k, mask) -> DocBlocks:
        if mask.doc_blocks is None:
            return whole_rows(q.shape[0], q.shape[1], k.shape[1], mask.causal, q.device)
        _check_blocks(mask.doc_blocks, q, k)
        return mask.doc_blocks

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        """``(out, lse)`` of ``q`` against ``k``/``v`` over the blocks; with ``out``/``lse`` given, merges
        the fed rows into them (other rows untouched)."""
        blocks = self._blocks(q, k, mask)
        b, lq, h, d = q.shape
        accum = out is not None or lse is not None
        if accum and (out is None or lse is None):
            raise ValueError("accumulate mode needs both the running out and lse; pass both or neither.")
        if not accum:
            out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            lse = torch.full((b, h, lq), -math.inf, dtype=lse_dtype, device=q.device)
        if blocks.num_blocks == 0:
            return out, lse
        qg, kg, vg = _gather(q, blocks.q_rows), _gather(k, blocks.k_rows), _gather(v, blocks.k_rows)
        o, op_lse, _, _ = varlen_forward(qg, kg, vg, blocks.cu_q, blocks.cu_k, blocks.max_q, blocks.max_k,
                                   blocks.causal, scale)
        rows_lse = _lse_rows(op_lse, blocks)
        rows = _RowMap(blocks.q_rows, b, lq, q.device)
        if not accum:
            rows.put(out, o)
            rows.put_lse(lse, rows_lse.to(lse.dtype))
            return out, lse
        # views of the running buffers are merged in place; gathered rows are merged, then written back
        run_out, run_lse = rows.take(out).unsqueeze(0), rows.take_lse(lse).unsqueeze(0)
        merge_into(run_out, run_lse, o.unsqueeze(0), rows_lse.unsqueeze(0))
        if rows.view is None:
            rows.put(out, run_out[0])
            rows.put_lse(lse, run_lse[0])
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        """float32 ``(dq, dk, dv)`` of this call (added into ``dq``/``dk``/``dv`` when given). ``out`` and
        ``lse`` are the query rows' global results; ``delta`` is not taken (the op recomputes it)."""
        if out is None:
            raise ValueError(
                "backend 'flash_varlen' needs the attention output in backward (not only delta)."
            )
        if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"dout and out must have q's shape {tuple(q.shape)}; got {tuple(dout.shape)}, "
                             f"{tuple(out.shape)}.")
        blocks = self._blocks(q, k, mask)
        b, lq, h, d = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        grads = []
        for given, like in ((dq, q), (dk, k), (dv, v)):
            grads.append(torch.zeros(like.shape, dtype=acc, device=q.device) if given is None else given)
        if blocks.num_blocks == 0:
            return tuple(grads)
        qg, kg, vg = _gather(q, blocks.q_rows), _gather(k, blocks.k_rows), _gather(v, blocks.k_rows)
        dog, og = _gather(dout.to(q.dtype), blocks.q_rows), _gather(out.to(q.dtype), blocks.q_rows)
        rows = _RowMap(blocks.q_rows, b, lq, q.device)
        rows_lse = _acc(rows.take_lse(lse))
        padded, rng, unused = _probe(q.device)
        op_lse = _lse_for_op(rows_lse, blocks, padded)
        gq, gk, gv = varlen_backward(dog, qg, kg, vg, og, op_lse, blocks.cu_q, blocks.cu_k, blocks.max_q,
                                     blocks.max_k, blocks.causal, scale, rng, unused)
        rows.put(grads[0], gq, accumulate=True)  # put adds the op's bf16 into float32 in one pass
        key_rows = _RowMap(blocks.k_rows, k.shape[0], k.shape[1], q.device)
        key_rows.put(grads[1], gk, accumulate=True)
        key_rows.put(grads[2], gv, accumulate=True)
        return tuple(grads)
