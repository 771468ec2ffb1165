"""Rematerialization-aware checkpointing (DistFlashAttn section 3.3).

HF's layer checkpointing saves each decoder layer's input and re-runs the whole layer in
backward, distributed attention included (its compute and its communication). Here the layer
is still checkpointed, but with torch's selective checkpointing: the distributed attention op
(``torch.ops.lightseq_hf.dist_attn_fwd``) is MUST_SAVE, so its outputs (out, lse) are kept from
the forward and serve both the recompute of what follows and the attention backward; every other
op is PREFER_RECOMPUTE. The attention forward then runs once per layer per step, and the
gradients are those of no checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .parallel import ops as _ops  # noqa: F401  (registers torch.ops.lightseq_hf.*)

CHECKPOINTING_MODES = ("remat", "hf")


def remat_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the distributed attention's outputs; recompute everything else."""
    if op is torch.ops.lightseq_hf.dist_attn_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def remat_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for :func:`torch.utils.checkpoint.checkpoint` applying :func:`remat_policy`."""
    return create_selective_checkpoint_contexts(remat_policy)


def remat_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` with the rematerialization-aware policy (non-reentrant)."""
    return _remat_call(checkpoint, function, *args, **kwargs)


def _remat_call(inner: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
    kwargs.update(use_reentrant=False, context_fn=remat_context_fn)
    return inner(function, *args, **kwargs)


def as_remat(func: Callable) -> Callable:
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
    """The checkpoint function :func:`as_remat` wrapped (or ``func`` itself)."""
    if getattr(func, "_lightseq_remat", False):
        return func.args[0]  # type: ignore[attr-defined]
    return func


def route_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Make every checkpointed module of ``model`` use ``mode`` ("remat" or "hf"); return how many.

    Modules without gradient checkpointing enabled are left alone: enabling it stays the user's
    choice (``gradient_checkpointing_enable()``, ``activation_checkpointing_enable()`` or
    ``TrainingArguments(gradient_checkpointing=True)``).
    """
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(
            f"checkpointing={mode!r} is not supported; choose 'remat' (rematerialization-aware, the "
            "default) or 'hf' (Hugging Face's layer checkpointing, for comparison)."
        )
    count = 0
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None:
            continue
        module._gradient_checkpointing_func = as_remat(func) if mode == "remat" else as_hf(func)
        count += 1
    return count
