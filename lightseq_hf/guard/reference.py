"""The parity check's reference: the batch prefix it checks, and the model run as Transformers' own.

The reference shares no code with the sequence-parallel path: :func:`unpatched_model` runs the patched
model's original forwards, whole rows on this rank, with the attention implementation the model had
before the patch (``"sdpa"``, ``"eager"``, a flash-attention one, or a function the user registered in
Transformers' ``AttentionInterface``), Transformers' own checkpoint function and untiled MLPs. So
soft-capping, sinks, chunked layers, the model's own position ids and masks, and a user's attention
function are what the model itself computes, and a bug in the patch is seen as a difference.
:func:`attention_upcast` gives the same attention with less rounding (the yardstick of the check's
tolerance). The documents of each row are read again from the inputs (:func:`document_ids`) for
the report and to refuse documents the model's own attention cannot see.
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
    """The batch itself if it holds at most ``max_tokens`` tokens, else its first rows, ``keep`` tokens
    each: every row at ``max_tokens // rows`` tokens when that is at least ``min_length``, else fewer rows.
    A row's kept tokens start at its first real token (a left-padded row's first tokens are padding), at
    most ``keep`` before its end; rows packed with ``cu_seq_lens_q/k`` keep their first tokens."""
    rows, length = batch_shape(batch)
    if rows * length <= max_tokens:
        return Prefix(dict(batch), rows, length, rows, length)
    keep = min(length, max(max_tokens // rows, min_length))
    keep_rows = max(1, min(rows, max_tokens // keep))
    packed = any(batch.get(k) is not None for k in CU_KEYS)
    if rows > 1 and packed:
        raise ValueError(
            f"the parity check cannot cut a batch of {rows} rows packed with cu_seq_lens_q/k to {max_tokens} "
            "tokens; raise max_tokens to the batch's size or pass one packed row.")
    starts = None if packed else _first_real_tokens(batch.get("attention_mask"), rows, length, keep)
    cut = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS and torch.is_tensor(value):
            if value.dim() >= 1 and value.shape[-1 if value.dim() == 1 else 1] == length:
                value = _cut_rows(value, rows, length, keep_rows, keep, starts)
        elif key in CU_KEYS and value is not None:
            value = _clip_cumulative(value, keep)
        elif key in ("max_length_q", "max_length_k") and batch.get("cu_seq_lens_q") is not None:
            value = int(_clip_cumulative(batch["cu_seq_lens_q"], keep).diff().max())
        cut[key] = value
    return Prefix(cut, keep_rows, keep, rows, length)


def _first_real_tokens(mask: Any, rows: int, length: int, keep: int) -> torch.Tensor | None:
    """Per row, where its ``keep`` checked tokens start: its first unmasked token, at most ``length -
    keep``; None when every row starts at 0."""
    if not torch.is_tensor(mask) or mask.dim() != 2 or tuple(mask.shape) != (rows, length):
        return None
    real = mask.detach().cpu() != 0
    starts = torch.where(real.any(-1), real.int().argmax(-1), 0).clamp(max=length - keep)
    return starts if bool(starts.any()) else None


def _cut_rows(value: torch.Tensor, rows: int, length: int, keep_rows: int, keep: int,
              starts: torch.Tensor | None) -> torch.Tensor:
    """``value`` ((length,), (rows or 1, length, ...)) cut to the kept rows and each row's window."""
    if starts is None:
        if value.dim() == 1:
            return value[:keep]
        return value[:keep_rows, :keep] if value.shape[0] == rows else value[:, :keep]
    full = value.expand(rows, length) if value.dim() == 1 else value.expand(rows, *value.shape[1:])
    return torch.stack([full[r, int(starts[r]):int(starts[r]) + keep] for r in range(keep_rows)])


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
    """The attention implementation ``target`` (a patched model) had before the patch; Transformers'
    default (``"sdpa"`` where the model supports it, else ``"eager"``) for a model built with ours."""
    name = target.__dict__.get("_lightseq_fallback_attn")
    if name is None or name == ATTN_IMPLEMENTATION:
        name = "sdpa" if getattr(target, "_supports_sdpa", False) else "eager"
    return name


def check_documents_visible(batch: dict[str, Any], attention: str, rows: int, length: int) -> None:
    """ValueError when documents are marked by ``cu_seq_lens_q/k`` alone and ``attention`` (not a
    flash-attention implementation) does not read them: the unpatched model would attend across them."""
    cu = batch.get("cu_seq_lens_q")
    if cu is None or "flash" in attention:
        return
    cpu = torch.device("cpu")
    with_cu = document_ids(batch, rows, length, cpu)
    without = document_ids({k: v for k, v in batch.items() if k not in CU_KEYS}, rows, length, cpu)
    inside = (torch.arange(rows * length) < int(cu[-1])).reshape(rows, length)
    pairs = inside[:, 1:] & inside[:, :-1]
    if bool(((with_cu[:, 1:] == with_cu[:, :-1]) != (without[:, 1:] == without[:, :-1]))[pairs].any()):
        raise ValueError(
            f"the parity check's reference is the unpatched model, and its attention implementation "
            f"{attention!r} does not read cu_seq_lens_q/k, which alone separate this batch's documents; pass "
            "position_ids that restart at each document with them (DataCollatorWithFlattening and TRL's "
            "padding_free do), or load the model with a flash-attention implementation.")


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
        raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward beside it; the parity check"
                           " cannot run its attention at a higher precision. Pass rtol to check_parity.")
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
