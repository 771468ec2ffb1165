"""Sequence-parallel Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3) in Transformers 5.x.

The patch is thin and has two parts:

* an attention implementation ``"lightseq_dist"`` registered in Transformers' ``AttentionInterface``
  (the model's ``config._attn_implementation`` points at it): it turns the projected, rotated
  q/k/v of this rank's slice into :func:`lightseq_hf.dist_flash_attn`. Without the sequence-parallel
  context below it falls back to SDPA, so direct calls of the base model keep working;
* the ``*ForCausalLM.forward`` of each architecture, replaced by one that takes the full batch
  every rank of the group received, keeps this rank's contiguous slice (global label shift,
  right-padding to a multiple of the group size, global position ids), runs the base model on it
  with the context passed as a keyword argument (it survives the recompute of checkpointed layers),
  and computes the group's loss in chunks. Calls with a KV cache (generation) run the original
  forward with the original attention.

Gradient checkpointing goes through the model's own ``gradient_checkpointing_enable()`` /
``activation_checkpointing_enable()``: their common ``_set_gradient_checkpointing`` is wrapped to
use :mod:`lightseq_hf.checkpoint`'s rematerialization-aware policy (``checkpointing="remat"``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import CHECKPOINTING_MODES, restore_checkpointing, route_checkpointing
from ..kernels import BACKENDS
from ..parallel.api import dist_flash_attn
from ..parallel.groups import current_groups
from ..parallel.ops import group_rank_and_size
from ..parallel.segments import Segments, segments_from_hf
from ..parallel.sharding import (
    IGNORE_INDEX,
    chunked_loss_sum,
    global_position_ids,
    num_loss_tokens,
    sequence_parallel_loss,
    shard_for,
    shift_labels,
    take_shard,
)
from .tiled_mlp import apply_tiled_mlp, check_tiled_mlp, remove_tiled_mlp

ATTN_IMPLEMENTATION = "lightseq_dist"
SUPPORTED_TRANSFORMERS = "5.x (tested with 5.17 and 5.23)"
#: model_type -> (module, causal LM class, pre-trained base class)
ARCHITECTURES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaForCausalLM", "LlamaPreTrainedModel"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM",
                "MistralPreTrainedModel"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM", "Qwen2PreTrainedModel"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM", "Qwen3PreTrainedModel"),
}
_FORWARD_PARAMS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds",
                   "labels", "use_cache", "logits_to_keep")
#: tokens per chunk of the chunked loss (full-vocabulary float32 logits of one chunk at a time)
LOSS_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class PatchSettings:
    """What :func:`patch_llama` was asked for."""

    sp_group: dist.ProcessGroup | None
    checkpointing: str
    backend: str
    # memory options (issue 14): checkpoint offload to host memory; MLP tokens per tile (None: untiled)
    offload_checkpoints: bool = False
    tiled_mlp: int | None = None


@dataclass(frozen=True)
class SequenceParallelContext:
    """Passed to the attention function as the ``lightseq_sp`` keyword argument."""

    group: dist.ProcessGroup | None
    backend: str
    seq_len: int
    segments: Segments | None = None  # documents of the full (padded) rows; None: one per row


_settings: PatchSettings | None = None
_saved: dict[tuple[type, str], Any] = {}
_adopted: weakref.WeakSet = weakref.WeakSet()
_MISSING = object()


# ----------------------------------------------------------------------------- public API


def patch_llama(
    model: torch.nn.Module | None = None,
    *,
    sp_group: dist.ProcessGroup | None = None,
    checkpointing: str = "remat",
    backend: str = "auto",
    offload_checkpoints: bool = False,
    tiled_mlp: int | None = None,
) -> torch.nn.Module | None:
    """Make Llama, Mistral, Qwen2 and Qwen3 causal LMs sequence-parallel; return ``model``.

    Called before the model exists it patches the classes (every instance, and Hugging Face's
    ``Trainer`` data loading); given a model (PEFT- or DDP-wrapped too) it also patches that
    instance, with these settings. Idempotent. ``sp_group`` defaults, at each forward, to the
    group of :func:`lightseq_hf.parallel.init_sequence_parallel` if it was called, else the
    world, else no parallelism. ``checkpointing``: ``"remat"`` (rematerialization-aware) or
    ``"hf"`` (Hugging Face's layer checkpointing); either only applies once gradient
    checkpointing is enabled. ``backend``: the local attention backend of ``dist_flash_attn``.
    ``offload_checkpoints``: keep what checkpointed layers save in pinned host memory (also turned on
    by Transformers' ``activation_checkpointing_enable(offload=True)``). ``tiled_mlp``: run the MLPs
    this many tokens at a time (:mod:`lightseq_hf.patches.tiled_mlp`; None: untiled).
    """
    global _settings
    _check_transformers()
    if checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(
            f"checkpointing={checkpointing!r} is not supported; choose 'remat' (rematerialization-aware, "
            "the default) or 'hf' (Hugging Face's layer checkpointing, for comparison)."
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if sp_group is not None and not isinstance(sp_group, dist.ProcessGroup):
        raise ValueError(
            f"sp_group must be a torch.distributed.ProcessGroup or None, got {type(sp_group).__name__}."
        )
    settings = PatchSettings(sp_group, checkpointing, backend, bool(offload_checkpoints),
                             check_tiled_mlp(tiled_mlp))
    target = _unwrap(model) if model is not None else None  # raises on unsupported architectures
    if model is None or _settings is None:
        _settings = settings
    _patch_classes()
    from .trainer import patch_trainer

    patch_trainer()
    if target is not None:
        target._lightseq_settings = settings
        _adopt(target, settings)
    return model


def patch_model(
    model: torch.nn.Module,
    *,
    sp_group: dist.ProcessGroup | None = None,
    checkpointing: str = "remat",
    backend: str = "auto",
    offload_checkpoints: bool = False,
    tiled_mlp: int | None = None,
) -> torch.nn.Module:
    """:func:`patch_llama` for an existing model (required here); returns it."""
    if model is None:
        raise ValueError("patch_model needs a model; call patch_llama() to patch the classes instead.")
    return patch_llama(model, sp_group=sp_group, checkpointing=checkpointing, backend=backend,
                       offload_checkpoints=offload_checkpoints, tiled_mlp=tiled_mlp)


def unpatch_llama() -> None:
    """Undo :func:`patch_llama`: classes, the Trainer, and every model it adopted."""
    global _settings
    for model in list(_adopted):
        model.config._attn_implementation = getattr(model, "_lightseq_fallback_attn", None)
        restore_checkpointing(model)
        remove_tiled_mlp(model)
        for name in ("_lightseq_settings", "_lightseq_fallback_attn"):
            model.__dict__.pop(name, None)
    _adopted.clear()
    for (cls, name), value in _saved.items():
        if value is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, value)
    _saved.clear()
    from .trainer import unpatch_trainer

    unpatch_trainer()
    _settings = None


def resolve_sp_group(settings: PatchSettings | None = None) -> dist.ProcessGroup | None:
    """The sequence-parallel group a patched forward uses now (``None``: no parallelism)."""
    settings = settings or _settings
    if settings is not None and settings.sp_group is not None:
        return settings.sp_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    groups = current_groups()
    if groups is not None and groups.sp_group is not None:
        return groups.sp_group
    return dist.group.WORLD


# ----------------------------------------------------------------------------- patching


def _check_transformers() -> None:
    import transformers

    version = transformers.__version__
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = -1
    from transformers import modeling_utils

    if major != 5 or not hasattr(modeling_utils, "AttentionInterface"):
        raise RuntimeError(
            f"lightseq_hf.patch_llama supports transformers {SUPPORTED_TRANSFORMERS}; found {version}. "
            "Install a supported version: pip install 'transformers>=5,<6'."
        )


def _architectures() -> dict[str, tuple[type, type]]:
    found = {}
    for model_type, (module_name, lm_name, base_name) in ARCHITECTURES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found[model_type] = (getattr(module, lm_name), getattr(module, base_name))
    return found


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The supported causal LM inside ``model`` (PEFT, DDP/FSDP ``.module`` wrappers); else ValueError."""
    current = model
    for _ in range(8):
        model_type = getattr(getattr(current, "config", None), "model_type", None)
        archs = _architectures()
        if model_type in archs and isinstance(current, archs[model_type][0]):
            return current
        if hasattr(current, "get_base_model") and current.get_base_model() is not current:
            current = current.get_base_model()
        elif isinstance(getattr(current, "module", None), torch.nn.Module):
            current = current.module
        else:
            break
    model_type = getattr(getattr(current, "config", None), "model_type", None)
    supported = ", ".join(f"{t} ({ARCHITECTURES[t][1]})" for t in ARCHITECTURES)
    raise ValueError(
        f"lightseq_hf cannot patch {type(current).__name__} (model_type {model_type!r}): supported are the "
        f"causal LMs {supported}. Load the model with AutoModelForCausalLM, or use "
        "lightseq_hf.dist_flash_attn in your own attention for other architectures."
    )


def _save_and_set(cls: type, name: str, value: Any) -> None:
    if (cls, name) not in _saved:
        _saved[(cls, name)] = cls.__dict__.get(name, _MISSING)
    setattr(cls, name, value)


def _patch_classes() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, lightseq_attention)
    for lm_cls, base_cls in _architectures().values():
        if getattr(lm_cls.forward, "_lightseq_patched", False):
            continue
        params = inspect.signature(lm_cls.forward).parameters
        if any(p not in params for p in _FORWARD_PARAMS):
            raise RuntimeError(
                f"{lm_cls.__name__}.forward has an unexpected signature ({', '.join(params)}); "
                f"lightseq_hf.patch_llama supports transformers {SUPPORTED_TRANSFORMERS}."
            )
        _save_and_set(lm_cls, "forward", _make_forward(lm_cls.forward))
        _save_and_set(base_cls, "_set_gradient_checkpointing",
                      _make_set_gradient_checkpointing(base_cls._set_gradient_checkpointing))


def _settings_of(model: torch.nn.Module) -> PatchSettings:
    settings = model.__dict__.get("_lightseq_settings") or _settings
    if settings is None:  # a forward kept from before unpatch_llama(); cannot happen through the API
        raise RuntimeError("lightseq_hf is not patched; call lightseq_hf.patch_llama() first.")
    return settings


def _adopt(model: torch.nn.Module, settings: PatchSettings) -> None:
    """Point the model's attention at ``lightseq_dist`` and its checkpointing at ``settings``."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model._lightseq_fallback_attn = model.config._attn_implementation
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    route_checkpointing(model, settings.checkpointing, settings.offload_checkpoints)
    apply_tiled_mlp(model, settings.tiled_mlp)
    _adopted.add(model)


def _make_set_gradient_checkpointing(original):
    @functools.wraps(original)
    def _set_gradient_checkpointing(self, *args, **kwargs):
        original(self, *args, **kwargs)
        settings = _settings_of(self)
        route_checkpointing(self, settings.checkpointing, settings.offload_checkpoints)

    return _set_gradient_checkpointing


def _make_forward(original):
    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if past_key_values is not None:  # generation with a KV cache: the original model, unsharded
            fallback = self.__dict__.get("_lightseq_fallback_attn")
            previous = self.config._attn_implementation
            if fallback is not None:
                self.config._attn_implementation = fallback
            try:
                return original(self, input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids, past_key_values=past_key_values,
                                inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                logits_to_keep=logits_to_keep, **kwargs)
            finally:
                self.config._attn_implementation = previous
        settings = _settings_of(self)
        if self.config._attn_implementation != ATTN_IMPLEMENTATION or self not in _adopted:
            _adopt(self, settings)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        out = _sequence_parallel_forward(self, settings, input_ids, attention_mask, position_ids,
                                         inputs_embeds, labels, logits_to_keep, kwargs)
        return out if return_dict is not False else out.to_tuple()

    forward._lightseq_patched = True
    return forward


# ----------------------------------------------------------------------------- the forward


def _segments_of(attention_mask, position_ids, kwargs: dict, batch: int, seq: int,
                 padded_len: int) -> Segments | None:
    """Documents of the full rows from HF inputs (restarting ``position_ids``, ``cu_seq_lens_*`` kwargs,
    2-D padding masks), extended over the right-padding to ``padded_len``; ``None`` for plain rows.
    Pops the flash-attn varlen kwargs, which describe the full rows, not this rank's slice."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    segments = segments_from_hf(batch=batch, length=seq, attention_mask=attention_mask,
                                position_ids=position_ids, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    return None if segments is None else segments.padded(padded_len)


def _check_same_batch(group, batch: int, seq: int, input_ids, labels, device: torch.device,
                      segments: Segments | None = None) -> None:
    """All-gather a fingerprint of the batch: every rank of the group must hold the same one."""
    backend = dist.get_backend(group)
    where = device if backend == "nccl" else torch.device("cpu")

    labels_ok = labels is None or tuple(labels.shape) == (batch, seq)

    def checksums(x):
        """Two sums: plain, and weighted by position + 1 (never 0 for any position, no modulus), so two
        batches that differ at one position always differ in the second sum."""
        if x is None:
            return torch.zeros(2, dtype=torch.int64, device=where)
        x = x.to(where).long().flatten()
        weights = torch.arange(1, x.numel() + 1, device=where, dtype=torch.int64)
        return torch.stack([x.sum(), (x * weights).sum()])

    mine = torch.cat([torch.tensor([batch, seq, int(labels is not None), int(labels_ok)], device=where,
                                   dtype=torch.int64),
                      checksums(input_ids), checksums(labels if labels_ok else None),
                      torch.tensor([0 if segments is None else segments.checksum()], device=where,
                                   dtype=torch.int64)])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(t.tolist()) for t in gathered]
    if not labels_ok:  # raised after the all-gather, so that no rank is left waiting in it
        raise ValueError(f"labels have shape {tuple(labels.shape)}; expected length {seq} and batch {batch} "
                         "like input_ids: labels must be (batch, length).")
    if len(set(rows)) > 1:
        described = "; ".join(f"rank {r}: batch {x[0]}, length {x[1]}, labels {bool(x[2])}"
                              + ("" if x[3] else " (wrong shape)") for r, x in enumerate(rows))
        raise ValueError(
            "the ranks of a sequence-parallel group received different batches (" + described + "). Every "
            "rank of the group must get the same full batch and the patch slices it: call "
            "lightseq_hf.patch_llama() before building the Trainer, or shard your data by the data-parallel "
            "rank (lightseq_hf.parallel.current_groups().dp_rank), not by the global rank."
        )


def _sequence_parallel_forward(model, settings, input_ids, attention_mask, position_ids, inputs_embeds,
                               labels, logits_to_keep, kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds.")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            "logits_to_keep is not supported by lightseq_hf's sequence-parallel forward (every rank returns "
            "the logits of its slice); generation with a KV cache runs the unpatched forward."
        )
    full = input_ids if input_ids is not None else inputs_embeds
    batch, seq = full.shape[:2]
    device = full.device
    shifted = kwargs.pop("shift_labels", None)
    if shifted is None and labels is not None:
        shifted = shift_labels(labels)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("use_cache", None)

    group = resolve_sp_group(settings)
    rank, world = group_rank_and_size(group)
    shard = shard_for(seq, rank, world)
    segments = _segments_of(attention_mask, position_ids, kwargs, batch, seq, shard.padded_len)
    if world > 1:
        _check_same_batch(group, batch, seq, input_ids, shifted, device, segments)
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    local_ids = take_shard(input_ids, shard, value=pad_id) if input_ids is not None else None
    local_embeds = take_shard(inputs_embeds, shard) if inputs_embeds is not None else None
    if segments is not None and position_ids is not None:  # packed: positions restart per document
        local_pos = take_shard(position_ids.reshape(-1, seq).expand(batch, seq), shard)
    else:
        local_pos = global_position_ids(position_ids, batch, shard, device)
    context = SequenceParallelContext(group, settings.backend, seq, segments)

    base = getattr(model, model.base_model_prefix)
    outputs = base(input_ids=local_ids, inputs_embeds=local_embeds, attention_mask=None,
                   position_ids=local_pos, use_cache=False, lightseq_sp=context, **kwargs)
    hidden = outputs[0]
    head = model.get_output_embeddings()
    real = shard.real_end - shard.start

    loss = logits = None
    if shifted is not None:
        local_labels = take_shard(shifted, shard, value=IGNORE_INDEX)
        local_sum = chunked_loss_sum(hidden, local_labels, head, model.config.vocab_size, LOSS_CHUNK_TOKENS)
        loss = sequence_parallel_loss(local_sum, num_loss_tokens(shifted), group, num_items_in_batch)
    if shifted is None or not model.training:
        logits = head(hidden[:, :real])
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=None,
                                  hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))


# ----------------------------------------------------------------------------- attention


def lightseq_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention interface: q/k/v ``(batch, heads, seq, dim)`` -> out ``(batch, seq, heads, dim)``.

    Inside the patched forward (``lightseq_sp`` given) it is the distributed attention over the
    sequence-parallel group; elsewhere it is SDPA.
    """
    context = kwargs.pop("lightseq_sp", None)
    if context is None:
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) is not supported by lightseq_hf's distributed attention; set "
            "config.attention_dropout = 0.0."
        )
    window = kwargs.get("sliding_window")
    if window is not None and window >= context.seq_len:
        window = None  # no token is further back than the window
    out = dist_flash_attn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True,
                          softmax_scale=scaling, group=context.group, backend=context.backend,
                          check_shapes=False, segments=context.segments, window=window)
    return out, None


def _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None and query.shape[2] not in (1, key.shape[2]):
        raise ValueError(
            "a model patched by lightseq_hf was called with a KV cache outside its causal LM forward; call "
            "the *ForCausalLM model (or lightseq_hf.unpatch_llama() first)."
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)
