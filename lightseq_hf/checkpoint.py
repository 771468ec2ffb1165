"""Rematerialization-aware checkpointing (DistFlashAttn section 3.3).

HF's layer checkpointing saves each decoder layer's input and re-runs the whole layer in
backward, distributed attention included (its compute and its communication). Here the layer
is still checkpointed, but with torch's selective checkpointing: the distributed attention op
(``torch.ops.lightseq_hf.dist_attn_fwd``) is MUST_SAVE, so its outputs (out, lse) are kept from
the forward and serve both the recompute of what follows and the attention backward; every other
op is PREFER_RECOMPUTE. The attention forward then runs once per layer per step, and the
gradients are those of no checkpointing.

With offload (``route_checkpointing(..., offload=True)``, or Transformers'
``activation_checkpointing_enable(offload=True)``), what each checkpointed layer keeps — its input
and, under remat, the attention's (out, lse) — lives in pinned host memory, copied on a side stream
and prefetched one layer ahead in backward (:mod:`lightseq_hf.offload`). An :class:`OffloadPlan`
chooses per layer: which layers offload, and which keep only their input (plain recompute: the
attention forward runs again in backward, for half of what remat keeps per token).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .offload import CheckpointOffloader, OffloadPlan, offload_plan
from .parallel import ops as _ops  # noqa: F401  (registers torch.ops.lightseq_hf.*)

__all__ = [
    "CHECKPOINTING_MODES", "OffloadingCheckpoint", "as_hf", "hf_checkpoint_parts", "remat_checkpoint",
    "remat_policy", "restore_checkpointing", "route_checkpointing",
]

CHECKPOINTING_MODES = ("remat", "hf")


def remat_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the distributed attention's outputs; recompute everything else."""
    if op is torch.ops.lightseq_hf.dist_attn_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SECOND_BACKWARD = (
    "lightseq_hf: a second backward through a layer checkpointed with remat (retain_graph=True, or another "
    "loss backpropagated through the same forward): remat keeps each layer's attention output for exactly "
    "one backward. Add the losses and call backward once, or patch with checkpointing='hf' (Hugging Face's "
    "layer checkpointing, which reruns the attention in each backward)."
)


class _OneBackward:
    """The recompute context of selective checkpointing, with torch's refusal of a second backward
    restated as what it means here and the fix."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, kind: Any, error: Any, trace: Any) -> Any:
        handled = self.inner.__exit__(kind, error, trace)
        if isinstance(error, RuntimeError) and "backward an extra time" in str(error):
            raise RuntimeError(_SECOND_BACKWARD) from error
        return handled


def _remat_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for :func:`torch.utils.checkpoint.checkpoint` applying :func:`remat_policy`."""
    caching, recompute = create_selective_checkpoint_contexts(remat_policy)
    return caching, _OneBackward(recompute)


def remat_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` with the rematerialization-aware policy (non-reentrant)."""
    return _remat_call(checkpoint, function, *args, **kwargs)


def _remat_call(inner: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
    kwargs.update(use_reentrant=False, context_fn=_remat_context_fn)
    return inner(function, *args, **kwargs)


def _as_remat(func: Callable) -> Callable:
    """Wrap a checkpoint function HF built (``partial(checkpoint, **kwargs)``, maybe with offload).

    Its other settings are kept; ``use_reentrant`` becomes False and ``context_fn`` the policy.
    Idempotent; :func:`as_hf` undoes it.
    """
    if getattr(func, "_lightseq_remat", False):
        return func
    wrapped = functools.partial(_remat_call, func)
    wrapped._lightseq_remat = True  # type: ignore[attr-defined]
    return wrapped


def as_hf(func: Callable) -> Callable:
    """The checkpoint function :func:`_as_remat` or :class:`OffloadingCheckpoint` wrapped (or ``func``)."""
    if isinstance(func, OffloadingCheckpoint):
        return func.original
    if getattr(func, "_lightseq_remat", False):
        return func.args[0]  # type: ignore[attr-defined]
    return func


def hf_checkpoint_parts(func: Callable) -> tuple[dict, bool] | None:
    """``(checkpoint kwargs, offload)`` of a checkpoint function Transformers built —
    ``partial(torch.utils.checkpoint.checkpoint, **kwargs)``, or with ``offload=True`` a ``partial``
    of its closure that runs the checkpoint under ``save_on_cpu`` — else None (a function of the
    user's own)."""
    if not isinstance(func, functools.partial) or func.args:
        return None
    if func.func is checkpoint:
        return dict(func.keywords), False
    code = getattr(func.func, "__code__", None)
    if code is not None and code.co_name == "checkpoint_func" and "save_on_cpu" in code.co_names:
        return dict(func.keywords), True
    return None


class OffloadingCheckpoint:
    """The checkpoint function of a layer whose kept tensors live in host memory.

    ``torch.utils.checkpoint.checkpoint`` (non-reentrant) with ``kwargs``, inside ``offloader``'s
    hooks; under ``remat`` with the rematerialization-aware policy, and the attention tensors its
    cache keeps are offloaded too. ``original`` is the function it replaces (restored by
    :func:`restore_checkpointing`).
    """

    def __init__(self, original: Callable, kwargs: dict, remat: bool, offloader: CheckpointOffloader) -> None:
        self.original = original
        self.kwargs = {**kwargs, "use_reentrant": False}
        self.remat = remat
        self.offloader = offloader

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        kwargs = {**self.kwargs, **kwargs, "use_reentrant": False}
        caches = []
        if self.remat:
            def context_fn() -> tuple[Any, Any]:
                pair = _remat_context_fn()
                caches.append(pair[0])
                return pair

            kwargs["context_fn"] = context_fn
        with self.offloader.group() as group:
            out = checkpoint(function, *args, **kwargs)
        if caches:
            self.offloader.take_cache(group, caches[0].storage)
        return out


def restore_checkpointing(model: torch.nn.Module) -> None:
    """Give every checkpointed module of ``model`` back the checkpoint function Transformers built."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None:
            module._gradient_checkpointing_func = as_hf(func)


def _checkpoints_itself(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs its own forward through the checkpoint function (a decoder layer),
    rather than only carrying it (Transformers sets it on the decoder stack too)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older Transformers: the stack module is the one with a `layers` list
        return not isinstance(getattr(module, "layers", None), torch.nn.ModuleList)
    return isinstance(module, GradientCheckpointingLayer)


def route_checkpointing(model: torch.nn.Module, mode: str,
                        offload: bool | int | Mapping | OffloadPlan = False) -> int:
    """Make every checkpointed module of ``model`` use ``mode`` ("remat" or "hf"); return how many.

    Modules without gradient checkpointing enabled are left alone: enabling it stays the user's
    choice (``gradient_checkpointing_enable()``, ``activation_checkpointing_enable()`` or
    ``TrainingArguments(gradient_checkpointing=True)``). ``offload`` (or a checkpoint function
    Transformers built with ``offload=True``) keeps what the layers save in host memory through one
    :class:`~lightseq_hf.offload.CheckpointOffloader` per model (``model.lightseq_offloader``);
    an integer ``N`` offloads the first N checkpointed layers only (the last ones, which backward
    needs first, keep theirs on the device); an :class:`OffloadPlan` (or its mapping) also runs its
    first ``recompute`` layers under plain recompute.
    """
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(
            f"checkpointing={mode!r} is not supported; choose 'remat' (rematerialization-aware, the "
            "default) or 'hf' (Hugging Face's layer checkpointing, for comparison)."
        )
    plan = offload_plan(offload)
    count = layer_index = 0
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None:
            continue
        base = as_hf(func)
        parts = hf_checkpoint_parts(base)
        wanted = ((parts is not None and parts[1])  # Transformers' offload=True: every layer
                  or layer_index < plan.layers)
        remat = mode == "remat" and layer_index >= plan.recompute
        layer_index += _checkpoints_itself(module)
        if wanted:
            if parts is None:
                raise ValueError(
                    f"checkpoint offload needs the checkpoint function Transformers builds; "
                    f"{type(model).__name__} has {base!r}. Enable checkpointing with "
                    "model.activation_checkpointing_enable() (or gradient_checkpointing_enable()) only."
                )
            offloader = model.__dict__.get("lightseq_offloader")
            if offloader is None:
                offloader = model.__dict__["lightseq_offloader"] = CheckpointOffloader()
            module._gradient_checkpointing_func = OffloadingCheckpoint(base, parts[0], remat, offloader)
        else:
            module._gradient_checkpointing_func = _as_remat(base) if remat else base
        count += 1
    return count
