"""Sequence-parallel Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3) in Transformers 5.x.

The patch is thin and has three parts:

* an attention implementation ``"lightseq_dist"`` registered in Transformers' ``AttentionInterface``
  (the model's ``config._attn_implementation`` points at it, and the switch is logged): it turns the
  projected, rotated q/k/v of this rank's slice into :func:`lightseq_hf.dist_flash_attn`. Without
  the sequence-parallel context below it falls back to SDPA;
* the split, at the decoder stack's entry and exit (``LlamaModel.forward`` and its Mistral/Qwen2/Qwen3
  twins), where every client passes, its own LM head or loss included (TRL's fused head, Liger's
  fused linear cross-entropy, label smoothing, ``compute_metrics``): the base model takes the full
  rows every rank of the group received, keeps this rank's contiguous slice (right-padding to a
  multiple of the group size, global position ids), runs the layers with the context passed as a
  keyword argument (it survives the recompute of checkpointed layers), and all-gathers the final
  hidden states along the sequence (differentiable:
  :func:`~lightseq_hf.parallel.sharding.gather_sequence`);
* the ``*ForCausalLM.forward`` of each architecture (when it is still Transformers' own), replaced by
  one that asks the base model to leave its output sharded and computes the group's loss in chunks
  on the slice: no gathered hidden state, no redundant LM head. Logits it returns cover the whole
  sequence (``lightseq_logits="shard"``: this rank's slice only).

Calls with a KV cache (``use_cache=True``, ``past_key_values``: generation, prefill) run the unpatched
model on every rank, unsharded. Gradient checkpointing goes through the model's own
``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()``: their common
``_set_gradient_checkpointing`` is wrapped to use :mod:`lightseq_hf.checkpoint`'s
rematerialization-aware policy (``checkpointing="remat"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import CHECKPOINTING_MODES, check_offload_layers, restore_checkpointing, route_checkpointing
from ..kernels import BACKENDS
from ..parallel.api import dist_flash_attn
from ..parallel.groups import current_groups
from ..parallel.ops import group_rank_and_size
from ..parallel.segments import Segments, segments_from_hf
from ..parallel.sharding import (
    IGNORE_INDEX,
    chunked_loss_sum,
    gather_sequence,
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
#: model_type -> (module, causal LM class, pre-trained base class, decoder stack class)
ARCHITECTURES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaForCausalLM", "LlamaPreTrainedModel",
              "LlamaModel"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM",
                "MistralPreTrainedModel", "MistralModel"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM", "Qwen2PreTrainedModel",
              "Qwen2Model"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM", "Qwen3PreTrainedModel",
              "Qwen3Model"),
}
_FORWARD_PARAMS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds",
                   "labels", "use_cache", "logits_to_keep")
_DECODER_PARAMS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds",
                   "use_cache")
#: ``lightseq_logits`` values: logits of the whole sequence on every rank, or of this rank's slice
LOGITS_LAYOUTS = ("full", "shard")
#: tokens per chunk of the chunked loss (full-vocabulary float32 logits of one chunk at a time)
LOSS_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class PatchSettings:
    """What :func:`patch_llama` was asked for."""

    sp_group: dist.ProcessGroup | None
    checkpointing: str
    backend: str
    # memory options: checkpoint offload to host memory; MLP tokens per tile (None: untiled)
    offload_checkpoints: bool | int = False  # True: every layer; N: the first N
    tiled_mlp: int | None = None


@dataclass(frozen=True)
class SequenceParallelContext:
    """Passed to the attention function as the ``lightseq_sp`` keyword argument."""

    group: dist.ProcessGroup | None
    backend: str
    seq_len: int
    segments: Segments | None = None  # documents of the full (padded) rows; None: one per row
    reference_attention: Callable | None = None  # set under unsharded(): replaces the distributed attention


@dataclass(frozen=True)
class SplitBatch:
    """This rank's part of a batch of full rows: what the decoder stack runs on."""

    group: dist.ProcessGroup | None
    shard: Any  # parallel.sharding.SequenceShard
    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    position_ids: torch.Tensor
    context: SequenceParallelContext


logger = logging.getLogger("lightseq_hf")
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
    offload_checkpoints: bool | int = False,
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
    by Transformers' ``activation_checkpointing_enable(offload=True)``); ``N``: only the first N
    layers' (the rest stay on the device: fit the host, use the GPU's spare memory).
    ``tiled_mlp``: run the MLPs this many tokens at a time (:mod:`lightseq_hf.patches.tiled_mlp`;
    None: untiled).
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
    check_offload_layers(offload_checkpoints)
    settings = PatchSettings(sp_group, checkpointing, backend, offload_checkpoints,
                             check_tiled_mlp(tiled_mlp))
    target = _unwrap(model) if model is not None else None  # raises on unsupported architectures
    if model is None or _settings is None:
        _settings = settings
    _patch_classes()
    from .trainer import patch_trainer

    patch_trainer()
    if target is not None:
        for member in _members(target):
            member._lightseq_settings = settings
        _adopt(target, settings)
    return model


def patch_model(
    model: torch.nn.Module,
    *,
    sp_group: dist.ProcessGroup | None = None,
    checkpointing: str = "remat",
    backend: str = "auto",
    offload_checkpoints: bool | int = False,
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
        fallback = model.__dict__.get("_lightseq_fallback_attn")
        if fallback is not None and model.config._attn_implementation == ATTN_IMPLEMENTATION:
            model.config._attn_implementation = fallback
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


#: (attention, group of this rank alone) while :func:`unsharded` is active
_unsharded: contextvars.ContextVar[tuple[Callable, dist.ProcessGroup] | None] = contextvars.ContextVar(
    "lightseq_unsharded", default=None)


@contextlib.contextmanager
def unsharded(attention: Callable, solo_group: dist.ProcessGroup):
    """Patched forwards started inside run unsharded on this rank (the reference pass of
    :func:`lightseq_hf.check_parity`): ``solo_group`` (this rank alone) is their group, so they do not
    split the rows, and ``attention(module, query, key, value, scaling, **kwargs)`` (HF layout) replaces
    the distributed attention, in checkpoint recomputes too."""
    token = _unsharded.set((attention, solo_group))
    try:
        yield
    finally:
        _unsharded.reset(token)


def resolve_sp_group(settings: PatchSettings | None = None) -> dist.ProcessGroup | None:
    """The sequence-parallel group a patched forward uses now (``None``: no parallelism)."""
    if _unsharded.get() is not None:
        return _unsharded.get()[1]
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


def _architectures() -> dict[str, tuple[type, type, type]]:
    """model_type -> (causal LM class, pre-trained base class, decoder stack class), those installed."""
    found = {}
    for model_type, (module_name, *names) in ARCHITECTURES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found[model_type] = tuple(getattr(module, name) for name in names)
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


def _check_signature(cls: type, params: tuple[str, ...]) -> None:
    found = inspect.signature(cls.forward).parameters
    if any(p not in found for p in params):
        raise RuntimeError(
            f"{cls.__name__}.forward has an unexpected signature ({', '.join(found)}); "
            f"lightseq_hf.patch_llama supports transformers {SUPPORTED_TRANSFORMERS}."
        )


def _is_transformers_own(function: Any) -> bool:
    return getattr(function, "__module__", "").startswith("transformers.")


def _patch_classes() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, lightseq_attention)
    for lm_cls, base_cls, decoder_cls in _architectures().values():
        if not getattr(decoder_cls.forward, "_lightseq_patched", False):
            _check_signature(decoder_cls, _DECODER_PARAMS)
            _save_and_set(decoder_cls, "forward", _make_decoder_forward(decoder_cls.forward))
            _save_and_set(base_cls, "_set_gradient_checkpointing",
                          _make_set_gradient_checkpointing(base_cls._set_gradient_checkpointing))
        forward = lm_cls.forward
        if getattr(forward, "_lightseq_patched", False):
            continue
        if not _is_transformers_own(forward):  # e.g. Liger's fused linear cross-entropy forward
            logger.warning(
                "lightseq_hf: %s.forward was replaced by %s.%s; it is left in place. The sequence split "
                "happens in %s, whose output it receives gathered over the sequence-parallel group (its LM "
                "head and loss run on the whole sequence on every rank).", lm_cls.__name__,
                forward.__module__, forward.__qualname__, decoder_cls.__name__)
            continue
        _check_signature(lm_cls, _FORWARD_PARAMS)
        _save_and_set(lm_cls, "forward", _make_forward(forward))


def _members(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and, for a causal LM, its decoder stack (they share one config)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return [model, base] if isinstance(base, torch.nn.Module) and base is not model else [model]


def _settings_of(model: torch.nn.Module) -> PatchSettings:
    settings = model.__dict__.get("_lightseq_settings") or _settings
    if settings is None:  # a forward kept from before unpatch_llama(); cannot happen through the API
        raise RuntimeError("lightseq_hf is not patched; call lightseq_hf.patch_llama() first.")
    return settings


def _adopt(model: torch.nn.Module, settings: PatchSettings) -> None:
    """Point the model's attention at ``lightseq_dist`` (logged) and its checkpointing at ``settings``."""
    current = model.config._attn_implementation
    if current != ATTN_IMPLEMENTATION:
        for member in _members(model):
            member._lightseq_fallback_attn = current
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        logger.warning(
            "lightseq_hf: %s attention implementation %r -> %r (exact distributed attention over the "
            "sequence-parallel group; calls with a KV cache still use %r; lightseq_hf.unpatch_llama() "
            "restores it).", type(model).__name__, current, ATTN_IMPLEMENTATION, current)
    route_checkpointing(model, settings.checkpointing, settings.offload_checkpoints)
    apply_tiled_mlp(model, settings.tiled_mlp)
    _adopted.update(_members(model))


def _ensure_adopted(model: torch.nn.Module, settings: PatchSettings) -> None:
    if model.config._attn_implementation != ATTN_IMPLEMENTATION or model not in _adopted:
        _adopt(model, settings)


def _make_set_gradient_checkpointing(original):
    @functools.wraps(original)
    def _set_gradient_checkpointing(self, *args, **kwargs):
        original(self, *args, **kwargs)
        settings = _settings_of(self)
        route_checkpointing(self, settings.checkpointing, settings.offload_checkpoints)

    return _set_gradient_checkpointing


def _wants_cache(use_cache: Any, past_key_values: Any) -> bool:
    return past_key_values is not None or use_cache is True


def _with_fallback_attention(model: torch.nn.Module, call):
    """Run ``call()`` with the model's own attention implementation (the one before the patch)."""
    _warn_once("cache", "lightseq_hf: a call with a KV cache (use_cache=True or past_key_values: generation, "
               "prefill) runs the unpatched model on every rank, unsharded.")
    fallback = model.__dict__.get("_lightseq_fallback_attn")
    previous = model.config._attn_implementation
    if fallback is not None:
        model.config._attn_implementation = fallback
    try:
        return call()
    finally:
        model.config._attn_implementation = previous


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _make_forward(original):
    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        layout = kwargs.pop("lightseq_logits", "full")
        if _wants_cache(use_cache, past_key_values):  # generation, prefill: the original model, unsharded
            return _with_fallback_attention(self, lambda: original(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs))
        settings = _settings_of(self)
        _ensure_adopted(self, settings)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        out = _sequence_parallel_forward(self, settings, input_ids, attention_mask, position_ids,
                                         inputs_embeds, labels, logits_to_keep, layout, kwargs)
        return out if return_dict is not False else out.to_tuple()

    forward._lightseq_patched = True
    return forward


def _make_decoder_forward(original):
    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        split = kwargs.pop("lightseq_split", None)
        if "lightseq_sp" in kwargs or (split is None and _wants_cache(use_cache, past_key_values)):
            call = lambda: original(self, input_ids=input_ids, attention_mask=attention_mask,  # noqa: E731
                                    position_ids=position_ids, past_key_values=past_key_values,
                                    inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
            return call() if "lightseq_sp" in kwargs else _with_fallback_attention(self, call)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        _check_outputs(self, kwargs)
        settings = _settings_of(self)
        _ensure_adopted(self, settings)
        gather = split is None
        if gather:
            split = split_batch(self, settings, input_ids, inputs_embeds, attention_mask, position_ids,
                                kwargs)
        outputs = original(self, input_ids=split.input_ids, inputs_embeds=split.inputs_embeds,
                           attention_mask=None, position_ids=split.position_ids, use_cache=False,
                           lightseq_sp=split.context, return_dict=True, **kwargs)
        if gather:
            outputs.last_hidden_state = gather_sequence(outputs.last_hidden_state, split.group, split.shard)
            if getattr(outputs, "hidden_states", None) is not None:
                outputs.hidden_states = tuple(gather_sequence(h, split.group, split.shard)
                                              for h in outputs.hidden_states)
        return outputs if return_dict is not False else outputs.to_tuple()

    forward._lightseq_patched = True
    return forward


# ----------------------------------------------------------------------------- the forward


def _segments_of(attention_mask, position_ids, kwargs: dict, batch: int, seq: int,
                 padded_len: int) -> Segments | None:
    """Documents of the full rows from HF inputs (restarting ``position_ids``, ``cu_seq_lens_*`` kwargs,
    2-D padding masks), extended over the right-padding to ``padded_len``; ``None`` for plain rows.
    Pops the flash-attn varlen kwargs, which describe the full rows, not this rank's slice."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    for key in ("max_length_q", "max_length_k", "seq_idx"):
        kwargs.pop(key, None)
    segments = segments_from_hf(batch=batch, length=seq, attention_mask=attention_mask,
                                position_ids=position_ids, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    return None if segments is None else segments.padded(padded_len)


def _check_outputs(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("output_attentions", getattr(model.config, "output_attentions", False)):
        raise ValueError(
            "output_attentions=True is not supported by lightseq_hf's distributed attention: it never forms "
            "the attention matrix. Call the model without output_attentions (and with "
            "config.output_attentions=False), or call lightseq_hf.unpatch_llama() first to get attention "
            "maps from the unpatched model."
        )


def _check_padding_labels(attention_mask: torch.Tensor | None, shifted: torch.Tensor | None) -> None:
    """Padding is exact only if no padding position is a prediction target (its output is zero)."""
    if attention_mask is None or shifted is None or attention_mask.dim() != 2:
        return
    padding = ~attention_mask.bool()
    if bool(padding.any()) and bool((shifted[padding] != IGNORE_INDEX).any()):
        raise ValueError(
            "the labels of padding positions (attention_mask 0) predict tokens (with left padding, the last "
            "padding position predicts the first real token); set their shifted labels to -100 "
            "(Transformers' and TRL's collators do for right padding) so the loss ignores padding."
        )


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


def split_batch(model: torch.nn.Module, settings: PatchSettings, input_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, kwargs: dict[str, Any],
                shifted_labels: torch.Tensor | None = None) -> SplitBatch:
    """Check a batch of full rows and cut this rank's slice of it (every rank of the group must call)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds.")
    full = input_ids if input_ids is not None else inputs_embeds
    batch, seq = full.shape[:2]
    device = full.device
    group = resolve_sp_group(settings)
    rank, world = group_rank_and_size(group)
    shard = shard_for(seq, rank, world)
    segments = _segments_of(attention_mask, position_ids, kwargs, batch, seq, shard.padded_len)
    _check_padding_labels(attention_mask, shifted_labels)
    if world > 1:
        _check_same_batch(group, batch, seq, input_ids, shifted_labels, device, segments)
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    if segments is not None and position_ids is not None:  # packed: positions restart per document
        local_pos = take_shard(position_ids.reshape(-1, seq).expand(batch, seq), shard)
    else:
        local_pos = global_position_ids(position_ids, batch, shard, device)
    return SplitBatch(
        group=group, shard=shard,
        input_ids=take_shard(input_ids, shard, value=pad_id) if input_ids is not None else None,
        inputs_embeds=take_shard(inputs_embeds, shard) if inputs_embeds is not None else None,
        position_ids=local_pos,
        context=SequenceParallelContext(group, settings.backend, seq, segments,
                                        (_unsharded.get() or (None,))[0]),
    )


def _keep_logits(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
    return hidden[:, logits_to_keep]


def _sequence_parallel_forward(model, settings, input_ids, attention_mask, position_ids, inputs_embeds,
                               labels, logits_to_keep, layout, kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if layout not in LOGITS_LAYOUTS:
        raise ValueError(f"lightseq_logits={layout!r}: choose 'full' (the whole sequence on every rank, "
                         "the default) or 'shard' (this rank's slice of the sequence).")
    if layout == "shard" and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("logits_to_keep selects positions of the whole sequence; use it with "
                         "lightseq_logits='full'.")
    shifted = kwargs.pop("shift_labels", None)
    if shifted is None and labels is not None:
        shifted = shift_labels(labels)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("use_cache", None)
    _check_outputs(model, kwargs)
    full = input_ids if input_ids is not None else inputs_embeds
    if shifted is not None and full is not None and shifted.shape[:2] != full.shape[:2]:
        raise ValueError(f"labels have shape {tuple(shifted.shape)} but the inputs have "
                         f"{tuple(full.shape[:2])} (batch, tokens): expected length {full.shape[1]}.")
    split = split_batch(model, settings, input_ids, inputs_embeds, attention_mask, position_ids, kwargs,
                        shifted_labels=shifted)
    shard = split.shard

    base = getattr(model, model.base_model_prefix)
    outputs = base(lightseq_split=split, **kwargs)
    hidden = outputs.last_hidden_state
    head = model.get_output_embeddings()

    loss = logits = None
    if shifted is not None:
        local_labels = take_shard(shifted, shard, value=IGNORE_INDEX)
        local_sum = chunked_loss_sum(hidden, local_labels, head, model.config.vocab_size, LOSS_CHUNK_TOKENS)
        loss = sequence_parallel_loss(local_sum, num_loss_tokens(shifted), split.group, num_items_in_batch)
    if shifted is None or not model.training:
        if layout == "shard":
            logits = head(hidden[:, :shard.real_end - shard.start])
        else:
            logits = head(_keep_logits(gather_sequence(hidden, split.group, shard), logits_to_keep))
    hidden_states = getattr(outputs, "hidden_states", None)
    if hidden_states is not None and layout == "full":
        hidden_states = tuple(gather_sequence(h, split.group, shard) for h in hidden_states)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=None, hidden_states=hidden_states,
                                  attentions=None)


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
    if context.reference_attention is not None:  # under unsharded()
        return context.reference_attention(module, query, key, value, scaling, **kwargs), None
    window = kwargs.get("sliding_window")
    if window is not None and window >= context.seq_len:
        window = None  # no token is further back than the window
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # float32 RoPE promotes q and k; v keeps the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
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
