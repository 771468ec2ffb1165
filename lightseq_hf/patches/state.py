"""What :func:`lightseq_hf.patch` was asked for, and the sequence-parallel group a forward uses."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.groups import current_groups

ATTN_IMPLEMENTATION = "lightseq_dist"


@dataclass(frozen=True)
class PatchSettings:
    """The options of one :func:`lightseq_hf.patch` call."""

    sp_group: dist.ProcessGroup | None
    checkpointing: str
    backend: str
    # memory options: checkpoint offload to host memory; MLP tokens per tile (None: untiled)
    offload_checkpoints: bool | int | Any = False  # True: every layer; N: the first N; or an OffloadPlan
    tiled_mlp: int | None = None


#: the settings of the class-level patch (None: not patched)
_settings: PatchSettings | None = None


def current_settings() -> PatchSettings | None:
    return _settings


def set_settings(settings: PatchSettings | None) -> None:
    global _settings
    _settings = settings


def settings_of(model: torch.nn.Module) -> PatchSettings:
    """The settings a patched model was given, else those of the class-level patch."""
    settings = model.__dict__.get("_lightseq_settings") or _settings
    if settings is None:  # a forward kept from before unpatch(); cannot happen through the API
        raise RuntimeError("lightseq_hf is not patched; call lightseq_hf.patch() first.")
    return settings


#: (attention, group of this rank alone) while :func:`unsharded` is active
_unsharded: contextvars.ContextVar[tuple[Callable, dist.ProcessGroup] | None] = contextvars.ContextVar(
    "lightseq_unsharded", default=None)


@contextlib.contextmanager
def unsharded(attention: Callable, solo_group: dist.ProcessGroup) -> Iterator[None]:
    """Patched forwards started inside run unsharded on this rank (the reference pass of a parity
    check): ``solo_group`` (this rank alone) is their group, so they do not split the rows, and
    ``attention(module, query, key, value, scaling, **kwargs)`` (HF layout) replaces the distributed
    attention, in checkpoint recomputes too."""
    token = _unsharded.set((attention, solo_group))
    try:
        yield
    finally:
        _unsharded.reset(token)


def unsharded_attention() -> Callable | None:
    """The attention :func:`unsharded` gave, while it is active."""
    active = _unsharded.get()
    return None if active is None else active[0]


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
