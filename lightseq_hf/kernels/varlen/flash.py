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

This module knows nothing of documents, segments or schedules: callers build the blocks, and :mod:`.rows`
gathers their rows and writes them back.
"""

from __future__ import annotations

import math

import torch

from ..base import Capabilities, DocBlocks, KernelBase
from ..working_memory import BackwardMemory, Workspace
from .rows import (
    RowMap,
    check_backward_rows,
    check_blocks,
    gather_rows,
    gradient_buffers,
    in_accumulate_dtype,
    merge_rows,
    running_buffers,
    whole_rows,
)

__all__ = ["FlashVarlenKernel", "check_flash_inputs", "lse_is_padded", "usable", "varlen_backward",
           "varlen_forward"]

_DTYPES = (torch.float16, torch.bfloat16)


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
        except (RuntimeError, NotImplementedError, AttributeError, AssertionError):  # CPU-only torch: asserts
            _usable[key] = False
    return _usable[key]


def _lse_rows(lse: torch.Tensor, blocks: DocBlocks) -> torch.Tensor:
    """The op's lse as ``(heads, total_q)`` float32, from either layout; rows that see no key get
    ``-inf`` (FlashAttention writes ``+inf`` there; only causal blocks with more queries than keys
    have such rows)."""
    if lse.dim() == 2:
        rows = in_accumulate_dtype(lse)
    else:
        block, pos = blocks.padded_lse_index
        rows = in_accumulate_dtype(lse[block, :, pos].t())
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
        # the op's dq/dk/dv in the input dtype, added into float32 ones; inside the op, FlashAttention-2's
        # varlen backward keeps a float32 dq accumulator and, under GQA, dk/dv per query head
        backward_memory=BackwardMemory("flash_varlen kernel", workspace=(
            Workspace("dq/dk/dv from the op (compute dtype)", "qkv"),
            Workspace("the op's float32 dq accumulator", "q", "float32"),
            Workspace("the op's dk/dv per query head under GQA (compute dtype)", "q", "input", 2, "gqa"))),
    )

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        if usable(device):
            return None
        return ("runs torch's FlashAttention-2 varlen kernels and needs a CUDA GPU whose torch build has "
                f"them (torch.ops.aten._flash_attention_forward); tensors are on {device}")

    def _blocks(self, q, k, mask) -> DocBlocks:
        if mask.doc_blocks is None:
            return whole_rows(q.shape[0], q.shape[1], k.shape[1], mask.causal, q.device)
        check_blocks(mask.doc_blocks, q, k)
        return mask.doc_blocks

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        """``(out, lse)`` of ``q`` against ``k``/``v`` over the blocks; with ``out``/``lse`` given, merges
        the fed rows into them (other rows untouched)."""
        blocks = self._blocks(q, k, mask)
        out, lse, accumulate = running_buffers(q, v, out, lse)
        if blocks.num_blocks == 0:
            return out, lse
        qg = gather_rows(q, blocks.q_rows)
        kg, vg = gather_rows(k, blocks.k_rows), gather_rows(v, blocks.k_rows)
        o, op_lse, _, _ = varlen_forward(qg, kg, vg, blocks.cu_q, blocks.cu_k, blocks.max_q, blocks.max_k,
                                         blocks.causal, scale)
        rows = RowMap(blocks.q_rows, q.shape[0], q.shape[1], q.device)
        merge_rows(rows, out, lse, o, _lse_rows(op_lse, blocks), accumulate)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        """float32 ``(dq, dk, dv)`` of this call (added into ``dq``/``dk``/``dv`` when given). ``out`` and
        ``lse`` are the query rows' global results; ``delta`` is not taken (the op recomputes it)."""
        check_backward_rows(self.name, dout, q, out)
        blocks = self._blocks(q, k, mask)
        b, lq = q.shape[:2]
        grads = gradient_buffers(q, k, v, dq, dk, dv)
        if blocks.num_blocks == 0:
            return grads
        qg = gather_rows(q, blocks.q_rows)
        kg, vg = gather_rows(k, blocks.k_rows), gather_rows(v, blocks.k_rows)
        dog, og = gather_rows(dout.to(q.dtype), blocks.q_rows), gather_rows(out.to(q.dtype), blocks.q_rows)
        rows = RowMap(blocks.q_rows, b, lq, q.device)
        rows_lse = in_accumulate_dtype(rows.take_lse(lse))
        padded, rng, unused = _probe(q.device)
        op_lse = _lse_for_op(rows_lse, blocks, padded)
        gq, gk, gv = varlen_backward(dog, qg, kg, vg, og, op_lse, blocks.cu_q, blocks.cu_k, blocks.max_q,
                                     blocks.max_k, blocks.causal, scale, rng, unused)
        rows.put(grads[0], gq, accumulate=True)  # put adds the op's bf16 into float32 in one pass
        key_rows = RowMap(blocks.k_rows, k.shape[0], k.shape[1], q.device)
        key_rows.put(grads[1], gk, accumulate=True)
        key_rows.put(grads[2], gv, accumulate=True)
        return grads
