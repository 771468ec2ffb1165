"""The parity check's reference: a batch prefix, its documents, and dense masked attention.

Written apart from the distributed path on purpose (no Segments, no kernels): the documents of each
row are read again from the Hugging Face inputs (2-D padding masks, restarting ``position_ids``,
flash-attn ``cu_seq_lens_q``), and attention is one dense softmax over the whole rows with the
causal, document and sliding-window masks, so an error in either is seen as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: batch entries laid out as (batch, length, ...): cut to the prefix with the rows
SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels",
                 "token_type_ids")
CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


@dataclass(frozen=True)
class Prefix:
    """What the check runs on: the first ``rows`` rows, ``length`` tokens each, of a (rows x full) batch."""

    batch: dict[str, Any]
    rows: int
    length: int
    full_rows: int
    full_length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.length


def batch_shape(batch: dict[str, Any]) -> tuple[int, int]:
    """(rows, length) of a batch of full rows."""
    full = batch.get("input_ids")
    if full is None:
        full = batch.get("inputs_embeds")
    if not torch.is_tensor(full) or full.dim() < 2:
        raise ValueError("the parity check needs a batch with input_ids (rows, length) or inputs_embeds "
                         "(rows, length, hidden); got keys " + ", ".join(sorted(batch)) + ".")
    return int(full.shape[0]), int(full.shape[1])


def take_prefix(batch: dict[str, Any], max_tokens: int, min_length: int) -> Prefix:
    """The batch itself if it holds at most ``max_tokens`` tokens, else its first rows and tokens:
    every row at ``max_tokens // rows`` tokens when that is at least ``min_length``, else fewer rows."""
    rows, length = batch_shape(batch)
    if rows * length <= max_tokens:
        return Prefix(dict(batch), rows, length, rows, length)
    keep = min(length, max(max_tokens // rows, min_length))
    keep_rows = max(1, min(rows, max_tokens // keep))
    if rows > 1 and any(batch.get(k) is not None for k in CU_KEYS):
        raise ValueError(
            f"the parity check cannot cut a batch of {rows} rows packed with cu_seq_lens_q/k to {max_tokens} "
            "tokens; raise max_tokens to the batch's size or pass one packed row.")
    cut = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS and torch.is_tensor(value):
            if value.dim() == 1 and value.shape[0] == length:
                value = value[:keep]
            elif value.dim() >= 2 and value.shape[1] == length:
                value = value[:keep_rows, :keep] if value.shape[0] == rows else value[:, :keep]
        elif key in CU_KEYS and value is not None:
            value = _clip_cumulative(value, keep)
        elif key in ("max_length_q", "max_length_k") and batch.get("cu_seq_lens_q") is not None:
            value = int(_clip_cumulative(batch["cu_seq_lens_q"], keep).diff().max())
        cut[key] = value
    return Prefix(cut, keep_rows, keep, rows, length)


def _clip_cumulative(cu: torch.Tensor, length: int) -> torch.Tensor:
    kept = cu[cu < length]
    return torch.cat([kept, kept.new_tensor([length])])


def document_ids(batch: dict[str, Any], rows: int, length: int, device: torch.device) -> torch.Tensor:
    """(rows, length) int64: each token's document number in its row, -1 for padding.

    Documents: a 2-D ``attention_mask``'s zeros are padding; a new document starts where
    ``position_ids`` do not continue by +1 between two real tokens and at each ``cu_seq_lens_q``
    boundary (flattened over the rows; tokens past the last boundary are padding).
    """
    valid = torch.ones(rows, length, dtype=torch.bool)
    starts = torch.zeros(rows, length, dtype=torch.long)
    mask = batch.get("attention_mask")
    if mask is not None:
        valid = mask.detach().cpu().reshape(rows, length) != 0
    pos = batch.get("position_ids")
    if pos is not None:
        pos = pos.detach().cpu().long().reshape(-1, length).expand(rows, length)
        starts[:, 1:] = ((pos[:, 1:] - pos[:, :-1] != 1) & valid[:, 1:] & valid[:, :-1]).long()
    ids = starts.cumsum(-1)
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        flat = torch.arange(rows * length)
        bounds = cu.detach().cpu().long()
        doc = torch.bucketize(flat, bounds[1:], right=True)  # index of the cu interval holding each token
        valid &= (flat < bounds[-1]).reshape(rows, length)
        ids = ids + doc.reshape(rows, length) * (length + 1)
    return torch.where(valid, ids, torch.full_like(ids, -1)).to(device)


def dense_masked_attention(doc_ids: torch.Tensor, operand_dtype: torch.dtype | None = None):
    """An attention function (Transformers' interface, ``(module, q, k, v, scaling, **kwargs)`` with q/k/v
    ``(batch, heads, seq, dim)``, returning ``(batch, seq, heads, dim)``) over whole rows whose
    documents are ``doc_ids`` (:func:`document_ids`): softmax in float32 over the keys ``j <= i`` of the
    query's document and, with ``sliding_window=w``, ``i - w < j``; a query with no such key gets 0.
    ``operand_dtype``: round q, k, v and the probabilities to it, as a flash attention kernel of that dtype
    does (scores and sums stay float32); else everything in float32."""

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.float() if operand_dtype is None else x.to(operand_dtype).float()

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float | None = None, **kwargs: Any) -> torch.Tensor:
        out_dtype = query.dtype
        if torch.is_autocast_enabled(query.device.type):
            out_dtype = torch.get_autocast_dtype(query.device.type)
        seq, dim = query.shape[2], query.shape[3]
        groups = query.shape[1] // key.shape[1]
        q = rounded(query)
        k = rounded(key).repeat_interleave(groups, dim=1)
        v = rounded(value).repeat_interleave(groups, dim=1)
        scale = dim ** -0.5 if scaling is None else scaling
        i = torch.arange(seq, device=q.device)
        allowed = i[None, :] <= i[:, None]
        window = kwargs.get("sliding_window")
        if window is not None:
            allowed &= i[None, :] > i[:, None] - window
        docs = doc_ids[:, :seq]
        allowed = allowed & (docs[:, :, None] == docs[:, None, :]) & (docs[:, :, None] >= 0)
        has_key = allowed.any(-1, keepdim=True)[:, None]  # padding queries see no key: output 0
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed[:, None], float("-inf")).masked_fill(~has_key, 0.0)
        probs = rounded(torch.softmax(scores, dim=-1) * has_key)
        return torch.matmul(probs, v).transpose(1, 2).to(out_dtype)

    return attention
