"""The public entry points: :func:`patch`, :func:`patch_model`, :func:`unpatch` (and the Llama-era aliases).

Patching a causal LM sets three things, on its classes (every instance of them) and on the instance:

* the attention implementation ``"lightseq_dist"`` (:mod:`.attention`) registered in Transformers'
  ``AttentionInterface``; the model's ``config._attn_implementation`` points at it (logged);
* the decoder stack's and the causal LM's ``forward`` (:mod:`.forward`): the split, the gather and the
  group's loss;
* the family's ``_set_gradient_checkpointing`` (``*PreTrainedModel``): gradient checkpointing enabled
  through ``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()`` uses
  :mod:`lightseq_hf.checkpoint`'s rematerialization-aware policy (``checkpointing="remat"``).

Which classes those are is read from the model (:mod:`.architectures`). Called before any model
exists, :func:`patch` patches every causal LM class when its first instance is built (a model the
patch refuses stays unpatched, with the reason logged; :func:`patch` on it raises).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .._values import check_group
from ..checkpoint import CHECKPOINTING_MODES, restore_checkpointing, route_checkpointing
from ..kernels import BACKENDS
from ..offload import OffloadPlan, offload_plan
from ..parallel.groups import check_launched, launched_world_size
from . import state
from .architectures import Architecture, UnsupportedModel, decoder_stack, describe, is_causal_lm
from .attention import lightseq_attention
from .forward import (
    install_final_norm,
    make_causal_lm_forward,
    make_decoder_forward,
    remove_final_norm,
    warn_once,
)
from .state import ATTN_IMPLEMENTATION, PatchSettings
from .tiled_mlp import apply_tiled_mlp, check_tiled_mlp, remove_tiled_mlp

__all__ = ["patch", "patch_llama", "patch_model", "unpatch", "unpatch_llama"]

_SUPPORTED_TRANSFORMERS = "5.x (tested with 5.17, 5.23 and 5.24)"

_logger = logging.getLogger("lightseq_hf")
_saved: dict[tuple[type, str], Any] = {}
_adopted: weakref.WeakSet = weakref.WeakSet()
_MISSING = object()


def patch(
    model: torch.nn.Module | None = None,
    *,
    sp_group: dist.ProcessGroup | None = None,
    checkpointing: str = "remat",
    backend: str = "auto",
    offload_checkpoints: bool | int | dict | OffloadPlan = False,
    tiled_mlp: int | None = None,
) -> torch.nn.Module | None:
    """Make decoder-only causal LMs of Transformers sequence-parallel; return ``model``.

    Given a model (PEFT- or DDP-wrapped too) it checks the architecture (a model it cannot run exactly
    raises ValueError naming the feature and the model type) and patches that instance with these
    settings; called before the model exists it patches each causal LM class as its first instance
    is built, and Hugging Face's ``Trainer`` data loading. Idempotent. ``sp_group`` defaults, at each
    forward, to the group of :func:`lightseq_hf.parallel.init_sequence_parallel` if it was called,
    else the world, else no parallelism. ``checkpointing``: ``"remat"`` (rematerialization-aware) or
    ``"hf"`` (Hugging Face's layer checkpointing); either only applies once gradient checkpointing is
    enabled. Under a launcher (``WORLD_SIZE`` > 1) the process group must exist before a model is patched
    or called (RuntimeError otherwise: each process would run whole sequences alone). ``backend``: the
    local attention backend of ``dist_flash_attn``.
    ``offload_checkpoints``: keep what checkpointed layers save in pinned host memory (also turned on
    by Transformers' ``activation_checkpointing_enable(offload=True)``); ``N``: only the first N
    layers'; ``{"layers": N, "recompute": R}`` (an :class:`~lightseq_hf.offload.OffloadPlan`): also
    the first R layers keep only their input (plain recompute), as ``offload_checkpoints: auto``
    chooses. ``tiled_mlp``: run the dense MLPs and the layers' norms this many tokens at a time
    (:mod:`lightseq_hf.patches.tiled_mlp`; None: untiled).
    """
    _check_transformers()
    if checkpointing not in CHECKPOINTING_MODES:
        raise ValueError(
            f"checkpointing={checkpointing!r} is not supported; choose 'remat' (rematerialization-aware, "
            "the default) or 'hf' (Hugging Face's layer checkpointing, for comparison)."
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    check_group(sp_group, "sp_group", "the world, or the groups of init_sequence_parallel")
    plan = offload_plan(offload_checkpoints)  # ValueError for a bad value
    if not isinstance(offload_checkpoints, (bool, int)):
        offload_checkpoints = plan
    if model is not None and sp_group is None:
        check_launched("lightseq_hf.patch(model)")
    alone = launched_world_size() == 1 and not (dist.is_available() and dist.is_initialized())
    if sp_group is None and alone:
        warn_once("one process", "lightseq_hf: one process, so nothing is split: each sequence runs whole; "
                  "launch several to split it (torchrun --nproc_per_node N, accelerate launch, or "
                  "lightseq-finetune --nproc N).")
    settings = PatchSettings(sp_group, checkpointing, backend, offload_checkpoints,
                             check_tiled_mlp(tiled_mlp))
    target = _unwrap(model) if model is not None else None
    arch = describe(target) if target is not None else None  # raises for what is not served
    if model is None or state.current_settings() is None:
        state.set_settings(settings)
    _patch_common()
    from .trainer import patch_trainer

    patch_trainer()
    if target is not None:
        _patch_classes(arch)
        for member in _members(target):
            member._lightseq_settings = settings
        _adopt(target, settings, arch)
    return model


def patch_model(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """:func:`patch` for an existing model (required here); returns it."""
    if model is None:
        raise ValueError("patch_model needs a model; call lightseq_hf.patch() to patch the classes instead.")
    return patch(model, **options)


def unpatch() -> None:
    """Undo :func:`patch`: classes, the Trainer, and every model it adopted."""
    for model in list(_adopted):
        fallback = model.__dict__.get("_lightseq_fallback_attn")
        if fallback is not None and model.config._attn_implementation == ATTN_IMPLEMENTATION:
            model.config._attn_implementation = fallback
        restore_checkpointing(model)
        remove_tiled_mlp(model)
        remove_final_norm(model)
        for name in ("_lightseq_settings", "_lightseq_fallback_attn", "_lightseq_arch"):
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
    state.set_settings(None)


#: the names of the first release, which served the Llama family only
patch_llama = patch
unpatch_llama = unpatch


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
            f"lightseq_hf.patch supports transformers {_SUPPORTED_TRANSFORMERS}; found {version}. "
            "Install a supported version: pip install 'transformers>=5,<6'."
        )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside ``model`` (PEFT, DDP/FSDP ``.module`` wrappers), or ``model`` itself."""
    current = model
    for _ in range(8):
        if is_causal_lm(current):
            return current
        if hasattr(current, "get_base_model") and current.get_base_model() is not current:
            current = current.get_base_model()
        elif isinstance(getattr(current, "module", None), torch.nn.Module):
            current = current.module
        else:
            break
    return current


def _save_and_set(cls: type, name: str, value: Any) -> None:
    if (cls, name) not in _saved:
        _saved[(cls, name)] = cls.__dict__.get(name, _MISSING)
    setattr(cls, name, value)


def _patch_common() -> None:
    """The attention implementation, and the hook that patches causal LM classes as they are built."""
    from transformers import PreTrainedModel
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, lightseq_attention)
    if not getattr(PreTrainedModel.post_init, "_lightseq_patched", False):
        _save_and_set(PreTrainedModel, "post_init", _make_post_init(PreTrainedModel.post_init))


def _make_post_init(original):
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if is_causal_lm(self) and state.current_settings() is not None:
            try:
                arch = describe(self)
            except UnsupportedModel as refused:  # it stays unpatched: each rank runs it whole
                warn_once(f"refused {type(self).__name__}", f"{refused} It runs unpatched (whole sequences).")
                return
            _patch_classes(arch)
            for member in _members(self):
                member.__dict__["_lightseq_arch"] = arch

    post_init._lightseq_patched = True
    return post_init


def _patch_classes(arch: Architecture) -> None:
    decoder_cls, lm_cls = arch.decoder_class, arch.lm_class
    if not getattr(decoder_cls.forward, "_lightseq_patched", False):
        _save_and_set(decoder_cls, "forward",
                      make_decoder_forward(decoder_cls.forward, _adopted_architecture))
    base = arch.pretrained_class
    if not getattr(base._set_gradient_checkpointing, "_lightseq_patched", False):
        _save_and_set(base, "_set_gradient_checkpointing",
                      _make_set_gradient_checkpointing(base._set_gradient_checkpointing))
    forward = lm_cls.forward
    if getattr(forward, "_lightseq_patched", False):
        return
    if not getattr(forward, "__module__", "").startswith("transformers."):  # e.g. Liger's fused cross-entropy
        _logger.warning(
            "lightseq_hf: %s.forward was replaced by %s.%s; it is left in place. The sequence split "
            "happens in %s, which gathers the final hidden states along the sequence, so its loss head "
            "sees the whole sequence on every rank.", lm_cls.__name__, forward.__module__,
            getattr(forward, "__qualname__", "forward"), decoder_cls.__name__)
        return
    _save_and_set(lm_cls, "forward", make_causal_lm_forward(forward, _adopted_architecture))


def _members(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and, for a causal LM, its decoder stack (they share one config)."""
    base = decoder_stack(model) if is_causal_lm(model) else None
    return [model, base] if base is not None else [model]


def _adopt(model: torch.nn.Module, settings: PatchSettings, arch: Architecture) -> None:
    """Point the model's attention at ``lightseq_dist`` (logged), its checkpointing and MLPs at
    ``settings``."""
    current = model.config._attn_implementation
    for member in _members(model):
        member.__dict__["_lightseq_arch"] = arch
    if current != ATTN_IMPLEMENTATION:
        for member in _members(model):
            member._lightseq_fallback_attn = current
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        _logger.warning(
            "lightseq_hf: %s (%s) attention implementation %r -> %r (exact distributed attention over the "
            "sequence-parallel group; calls with a KV cache still use %r; lightseq_hf.unpatch() "
            "restores it).", type(model).__name__, arch.model_type, current, ATTN_IMPLEMENTATION, current)
    if not arch.fused_head and is_causal_lm(model):
        _logger.warning("lightseq_hf: %s: the head changes the logits (%s); the model's own head and loss "
                       "code run on each rank's slice of the sequence, not the fused chunked loss.",
                       arch.model_type, arch.head_extras)
    route_checkpointing(model, settings.checkpointing, settings.offload_checkpoints)
    apply_tiled_mlp(model, settings.tiled_mlp)
    decoder = decoder_stack(model) if is_causal_lm(model) else model
    if decoder is not None and "_lightseq_final_norm" not in decoder.__dict__:
        install_final_norm(decoder)
    _adopted.update(_members(model))


def _adopted_architecture(model: torch.nn.Module) -> Architecture:
    """The architecture of a causal LM or of its decoder stack, adopting it first if it is not yet (a
    model built before patch(), or a decoder stack called on its own)."""
    arch = model.__dict__.get("_lightseq_arch")
    if arch is None:
        if not is_causal_lm(model):
            raise UnsupportedModel(f"lightseq_hf: {type(model).__name__} is not the decoder stack of a "
                                   "causal LM the patch adopted; call lightseq_hf.patch(model) on it.")
        arch = describe(model)
    if model not in _adopted or model.config._attn_implementation != ATTN_IMPLEMENTATION:
        _adopt(model, state.settings_of(model), arch)
    return arch


def _make_set_gradient_checkpointing(original):
    @functools.wraps(original)
    def _set_gradient_checkpointing(self, *args, **kwargs):
        original(self, *args, **kwargs)
        settings = state.settings_of(self)
        route_checkpointing(self, settings.checkpointing, settings.offload_checkpoints)

    _set_gradient_checkpointing._lightseq_patched = True
    return _set_gradient_checkpointing
