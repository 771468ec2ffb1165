"""The parity check's reference: the batch prefix it checks, and the model run as Transformers' own.

The reference shares no code with the sequence-parallel path: :func:`unpatched_model` runs the patched
model's original forwards, whole rows on this rank, with the attention implementation the model had
before the patch (``"sdpa"``, ``"eager"``, a flash-attention one, or a function the user registered in
Transformers' ``AttentionInterface``), Transformers' own checkpoint function and untiled MLPs. So
soft-capping, sinks, chunked layers, the model's own position ids and masks, and a user's attention
function are what the model itself computes, and a bug in the patch is seen as a difference.
:func:`attention_upcast` gives the same attention with less rounding (the yardstick of the check's
tolerance). The documents of each row are read again from the inputs (:func:`document_ids`) for
the report and to give the model each packed document alone (:func:`unpacked_documents`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..checkpoint import as_hf, hf_checkpoint_parts
from ..patches.state import ATTN_IMPLEMENTATION, as_unpatched
from ..patches.tiled_mlp import TiledForward

__all__ = ["CU_KEYS", "SEQUENCE_KEYS", "attention_upcast", "batch_shape", "document_ids",
           "reference_attention", "take_prefix", "unpacked_documents", "unpatched_model"]

_IGNORE_INDEX = -100  # the label Transformers' losses skip
#: batch entries laid out as (batch, length, ...): cut to the prefix with the rows
SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels",
                 "token_type_ids")
CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


@dataclass(frozen=True)
class _Prefix:
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


def take_prefix(batch: dict[str, Any], max_tokens: int, min_length: int) -> _Prefix:
    """The batch itself if it holds at most ``max_tokens`` tokens, else rows of ``keep`` tokens each: every
    row at ``max_tokens // rows`` tokens when that is at least ``min_length``, else fewer rows, those with
    real tokens first. A row's kept tokens start at its first real token (a left-padded row's first
    tokens are padding), at most ``keep`` before its end; rows packed with ``cu_seq_lens_q/k`` keep their
    first tokens."""
    rows, length = batch_shape(batch)
    if rows * length <= max_tokens:
        return _Prefix(dict(batch), rows, length, rows, length)
    keep = min(length, max(max_tokens // rows, min_length))
    keep_rows = max(1, min(rows, max_tokens // keep))
    packed = any(batch.get(k) is not None for k in CU_KEYS)
    if rows > 1 and packed:
        raise ValueError(
            f"the parity check cannot cut a batch of {rows} rows packed with cu_seq_lens_q/k to {max_tokens} "
            "tokens; raise max_tokens to the batch's size or pass one packed row.")
    order, starts = _kept_rows(None if packed else batch.get("attention_mask"), rows, length, keep)
    cut = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS and torch.is_tensor(value):
            if value.dim() >= 1 and value.shape[-1 if value.dim() == 1 else 1] == length:
                value = _cut_rows(value, rows, order[:keep_rows], keep, starts)
        elif key in CU_KEYS and value is not None:
            value = _clip_cumulative(value, keep)
        elif key in ("max_length_q", "max_length_k") and batch.get("cu_seq_lens_q") is not None:
            value = int(_clip_cumulative(batch["cu_seq_lens_q"], keep).diff().max())
        cut[key] = value
    return _Prefix(cut, keep_rows, keep, rows, length)


def _kept_rows(mask: Any, rows: int, length: int, keep: int) -> tuple[list[int], list[int]]:
    """The rows in the order the prefix takes them (those with a real token first) and, per row, where its
    ``keep`` checked tokens start: its first unmasked token, at most ``length - keep``."""
    if not torch.is_tensor(mask) or mask.dim() != 2 or tuple(mask.shape) != (rows, length):
        return list(range(rows)), [0] * rows
    real = mask.detach().cpu() != 0
    some = real.any(-1).tolist()
    order = [r for r in range(rows) if some[r]] + [r for r in range(rows) if not some[r]]
    starts = torch.where(real.any(-1), real.int().argmax(-1), 0).clamp(max=length - keep)
    return order, starts.tolist()


def _cut_rows(value: torch.Tensor, rows: int, kept: list[int], keep: int, starts: list[int]) -> torch.Tensor:
    """``value`` ((length,) or (rows or 1, length, ...)) cut to the ``kept`` rows, each from its start."""
    if value.dim() == 1:
        value = value[None]
    if value.shape[0] != rows:  # one row for all (position ids)
        value = value.expand(rows, *value.shape[1:])
    return torch.stack([value[r, starts[r]:starts[r] + keep] for r in kept])


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


def reference_attention(target: torch.nn.Module) -> str:
    """The attention implementation ``target`` (a patched model) had before the patch (its config's, when
    the patch has not run a forward of it yet); Transformers' default (``"sdpa"`` where the model supports
    it, else ``"eager"``) for a model built with ours."""
    name = target.__dict__.get("_lightseq_fallback_attn") or target.config._attn_implementation
    if name is None or name == ATTN_IMPLEMENTATION:
        name = "sdpa" if getattr(target, "_supports_sdpa", False) else "eager"
    return name


def unpacked_documents(batch: dict[str, Any], docs: torch.Tensor) -> dict[str, Any] | None:
    """The batch with every document of its packed rows (restarting ``position_ids``, ``cu_seq_lens_q/k``)
    as a row of its own, or None when no row holds more than one document. Models differ in whether
    their own masks separate packed documents (most read restarting ``position_ids``; gpt-oss, AFMoE and
    OPT do not; none but flash attention reads ``cu_seq_lens``), so the reference gives the unpatched
    model each document alone: its tokens, position ids, and the labels the packed row gives them (next
    tokens across a document's end included), right-padded with one more padding column (the last
    token's label) and an attention mask. ``docs``: :func:`document_ids` of the batch."""
    docs = docs.detach().cpu()
    rows, length = docs.shape
    pieces = [(r, (docs[r] == d).nonzero().flatten()) for r in range(rows)
              for d in docs[r][docs[r] >= 0].unique()]
    if len(pieces) <= sum(bool((row >= 0).any()) for row in docs):
        return None
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    full = ids if ids is not None else embeds
    positions = batch.get("position_ids")
    positions = (torch.arange(length, device=full.device).expand(rows, length) if positions is None
                 else positions.reshape(-1, length).expand(rows, length))
    shifted = batch.get("shift_labels")
    if shifted is None:
        shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=_IGNORE_INDEX)
    width = max(len(index) for _, index in pieces) + 1
    out = {"attention_mask": torch.zeros(len(pieces), width, dtype=torch.long, device=full.device),
           "position_ids": torch.zeros(len(pieces), width, dtype=positions.dtype, device=full.device),
           "labels": torch.full((len(pieces), width), _IGNORE_INDEX, dtype=shifted.dtype, device=full.device)}
    rows_of = torch.zeros(len(pieces), width, *full.shape[2:], dtype=full.dtype, device=full.device)
    for i, (r, index) in enumerate(pieces):
        n, where = len(index), index.to(full.device)
        rows_of[i, :n] = full[r, where]
        out["attention_mask"][i, :n] = 1
        out["position_ids"][i, :n] = positions[r, where]
        out["labels"][i, 1:n + 1] = shifted[r, where]
    out["input_ids" if ids is not None else "inputs_embeds"] = rows_of
    dropped = (*SEQUENCE_KEYS, *CU_KEYS, "max_length_q", "max_length_k")
    kept = {k: v for k, v in batch.items() if k not in dropped}
    return {**kept, **out}


def _transformers_checkpoint(func):
    """The checkpoint function Transformers built under ours (lightseq_hf's remat or offload), without
    reentrance (the recompute then needs no input that requires grad); a user's own unchanged."""
    base = as_hf(func)
    parts = hf_checkpoint_parts(base)
    return base if parts is None else functools.partial(checkpoint, **{**parts[0], "use_reentrant": False})


@contextlib.contextmanager
def unpatched_model(target: torch.nn.Module, attention: str) -> Iterator[None]:
    """While open, ``target`` (a patched causal LM or decoder stack) runs as Transformers' own model,
    whole rows on this rank: its original forwards, the attention implementation ``attention``,
    Transformers' checkpoint function and untiled MLPs. Forward and backward must both run inside (a
    checkpointed layer's recompute reads the attention implementation from the config)."""
    config = target.config
    previous = config._attn_implementation
    tiled = [(m, m.__dict__.pop("forward")) for m in target.modules()
             if isinstance(m.__dict__.get("forward"), TiledForward)]
    checkpoints = [(m, m._gradient_checkpointing_func) for m in target.modules()
                   if getattr(m, "_gradient_checkpointing_func", None) is not None]
    try:
        for module, func in checkpoints:
            module._gradient_checkpointing_func = _transformers_checkpoint(func)
        config._attn_implementation = attention
        with as_unpatched():
            yield
    finally:
        config._attn_implementation = previous
        for module, func in checkpoints:
            module._gradient_checkpointing_func = func
        for module, forward in tiled:
            module.forward = forward


def _eager_of(module: torch.nn.Module):
    """The eager attention function of ``module``'s modeling file."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward beside it, so the parity "
                           "check cannot run its eager attention at a higher precision; load the model with "
                           "attn_implementation='sdpa'.")
    return found


@contextlib.contextmanager
def attention_upcast(name: str, dtype: torch.dtype) -> Iterator[None]:
    """While open, the attention implementation ``name`` (registered in Transformers' ``AttentionInterface``,
    or ``"eager"``: each model's own eager function) runs on ``dtype`` copies of its floating operands with
    autocast off, its output cast to the dtype it would have had: the same attention with less rounding."""
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    had, original = name in mapping, mapping.get(name)

    def upcast(module, query, key, value, attention_mask=None, *args, **kwargs):
        function = original or _eager_of(module)
        device = query.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        if torch.is_tensor(attention_mask) and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(dtype)
        with torch.autocast(device, enabled=False):
            out, weights = function(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask,
                                    *args, **kwargs)
        return out.to(out_dtype), weights

    mapping[name] = upcast
    try:
        yield
    finally:
        if had:
            mapping[name] = original
        else:
            del mapping[name]
