"""The attention implementation ``"lightseq_dist"`` registered in Transformers' ``AttentionInterface``.

It receives the projected, rotated q/k/v of this rank's slice and runs
:func:`lightseq_hf.dist_flash_attn` over the sequence-parallel group, per layer:

* the layer's kind (``config.layer_types``): full causal; sliding-window (the ``sliding_window`` the
  model passes, else ``config.sliding_window``); chunked (Llama 4: each document cut into chunks of
  ``config.attention_chunk_size`` tokens, as further documents);
* attention sinks (gpt-oss ``s_aux``): a learned per-head logit in the softmax denominator, applied
  after the merge from the log-sum-exp: ``out * sigmoid(lse - sink)`` (gradients reach the sink
  and, through the lse, q and k);
* logit soft-capping (``softcap``) where the distributed attention takes it;
* q/k and v of different head dims (MLA): the narrower side is zero-padded (zeros change no score and
  no output column) and the output cut back to the value dim;
* the scaling the model passes (``attention_multiplier``, ``query_pre_attn_scalar``...).

Any other argument that could change the result is refused by name.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel.api import dist_flash_attn
from ..parallel.segments import Segments

__all__ = ["ACTIVE_MODEL", "SequenceParallelContext", "chunked_documents", "lightseq_attention"]

#: keyword arguments models pass that do not change the attention of one forward without a cache
_IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "output_router_logits", "output_attentions",
                            "output_hidden_states", "cache_position", "layer_idx", "num_items_in_batch"})
#: the model type of the sequence-parallel forward in progress (attention without the context is a bug)
ACTIVE_MODEL = contextvars.ContextVar("lightseq_active_model", default=None)


@dataclass(frozen=True)
class SequenceParallelContext:
    """Passed to the attention function as the ``lightseq_sp`` keyword argument."""

    group: dist.ProcessGroup | None
    backend: str
    seq_len: int
    segments: Segments | None = None  # documents of the full (padded) rows; None: one per row
    layer_kinds: tuple[str, ...] = ()
    chunked_segments: Segments | None = None  # documents cut at the attention chunks (chunked layers)
    model_type: str = ""


def chunked_documents(segments: Segments | None, batch: int, seq: int, padded_len: int,
                      chunk: int) -> Segments:
    """The documents of the rows cut into attention chunks of ``chunk`` tokens, counted from each
    document's first token (a packed document is chunked as if it were alone; a left-padded row from its
    first real token, as Transformers' chunked mask does)."""
    docs = segments.docs if segments is not None else tuple(((0, seq),) for _ in range(batch))
    rows = tuple(tuple((a, min(a + chunk, stop)) for start, stop in row for a in range(start, stop, chunk))
                 for row in docs)
    return Segments(padded_len, rows)


def lightseq_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention interface: q/k/v ``(batch, heads, seq, dim)`` -> out ``(batch, seq, heads, v dim)``.

    Inside the patched forward (``lightseq_sp`` given) it is the distributed attention over the
    sequence-parallel group; elsewhere it is SDPA (eager for sinks and soft-capping).
    """
    context = kwargs.pop("lightseq_sp", None)
    if context is None:
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by lightseq_hf's distributed "
                         f"attention; set {_dropout_fix(module, dropout)}.")
    if attention_mask is not None:  # Transformers builds no mask for this implementation: the model made it
        raise ValueError(f"{context.model_type}: {type(module).__name__} passes an attention mask of its "
                         "own (a dynamic or learned mask), which lightseq_hf's distributed attention does "
                         "not apply.")
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{context.model_type}: {type(module).__name__} asked for bidirectional attention; "
                         "lightseq_hf's sequence parallelism serves causal decoders only.")
    sinks, softcap = kwargs.pop("s_aux", None), kwargs.pop("softcap", None)
    segments, window = _layer_mask(module, context, kwargs.pop("sliding_window", None))
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None)
    if unknown:
        raise ValueError(f"{context.model_type}: {type(module).__name__} passes {', '.join(unknown)} to its "
                         "attention, which lightseq_hf's distributed attention does not implement.")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # float32 RoPE promotes q and k; v keeps the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    v_dim, dim = value.shape[-1], max(query.shape[-1], value.shape[-1])
    q, k, v = (F.pad(t, (0, dim - t.shape[-1])).transpose(1, 2) for t in (query, key, value))
    extra = {"softcap": softcap} if softcap else {}
    out = dist_flash_attn(q, k, v, causal=True, softmax_scale=scale, group=context.group,
                          backend=context.backend, check_shapes=False, segments=segments, window=window,
                          return_lse=sinks is not None, **extra)
    if sinks is not None:  # softmax over [scores, sink]: the attention's share of the denominator
        out, lse = out
        share = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))  # (batch, heads, seq)
        out = out * share.transpose(1, 2).unsqueeze(-1).to(out.dtype)
    return out[..., :v_dim], None


def _layer_mask(module: torch.nn.Module, context: SequenceParallelContext,
                window: int | None) -> tuple[Segments | None, int | None]:
    """(segments, window) of this attention module's layer."""
    layer = getattr(module, "layer_idx", None)
    kind = context.layer_kinds[layer] if layer is not None and layer < len(context.layer_kinds) else None
    if kind == "chunked_attention":
        return context.chunked_segments, window
    if kind == "sliding_attention" and window is None:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
        if window is None:
            raise ValueError(f"{context.model_type}: layer {layer} is a sliding-window layer but neither its "
                             "attention nor config.sliding_window gives the window.")
    if kind == "full_attention" and window is not None and window < context.seq_len:
        raise ValueError(f"{context.model_type}: layer {layer} is a full-attention layer "
                         f"(config.layer_types) but its attention passes sliding_window={window}.")
    if window is not None and window >= context.seq_len:
        window = None  # no token is further back than the window
    return context.segments, window


def _dropout_fix(module: torch.nn.Module, rate: float) -> str:
    """How to turn off the attention dropout ``module`` applies: on the built model (a layer reads its rate
    from the config once, when it is built), or when loading it."""
    attr = next((name for name, value in vars(module).items() if isinstance(value, float) and value == rate),
                None) or next((f"{name}.p" for name, child in module.named_children()
                               if isinstance(child, torch.nn.Dropout) and child.p == rate), None)
    config = getattr(module, "config", None)
    key = next((k for k in ("attention_dropout", "attn_pdrop") if getattr(config, k, None) == rate),
               "attention_dropout")
    loaded = (f"it to 0 in the model (for m in model.modules(): if isinstance(m, {type(module).__name__}): "
              f"m.{attr} = 0.0), or " if attr else "")
    return (f"{loaded}load the model with from_pretrained(..., {key}=0.0) (config.{key} = 0.0 before it "
            "is built)")


def _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    active = ACTIVE_MODEL.get()
    if active is not None:
        raise ValueError(f"{active}: the decoder layers do not pass their keyword arguments down to the "
                         "attention (the sequence-parallel context is lost); this model is not supported.")
    if attention_mask is None and query.shape[2] not in (1, key.shape[2]):
        raise ValueError(
            "a model patched by lightseq_hf was called with a KV cache outside its causal LM forward; call "
            "the *ForCausalLM model (or lightseq_hf.unpatch() first)."
        )
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            params = inspect.signature(eager).parameters
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         **{k: v for k, v in kwargs.items() if k in params or "kwargs" in params})
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)
