"""What :func:`lightseq_hf.patch` was asked for, and the sequence-parallel group a forward uses."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.groups import check_launched, current_groups

__all__ = [
    "ATTN_IMPLEMENTATION", "PatchSettings", "as_unpatched", "current_settings", "resolve_sp_group",
    "running_unpatched", "set_settings", "settings_of",
]

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


#: True while :func:`as_unpatched` is active
_unpatched: contextvars.ContextVar[bool] = contextvars.ContextVar("lightseq_unpatched", default=False)


@contextlib.contextmanager
def as_unpatched() -> Iterator[None]:
    """Patched forwards called inside run the model's own forward, unsharded: the parity check's
    reference, whose caller also gives the model back its own attention implementation."""
    token = _unpatched.set(True)
    try:
        yield
    finally:
        _unpatched.reset(token)


def running_unpatched() -> bool:
    """Whether :func:`as_unpatched` is active."""
    return _unpatched.get()


def resolve_sp_group(settings: PatchSettings | None = None) -> dist.ProcessGroup | None:
    """The sequence-parallel group a patched forward uses now (``None``: no parallelism; refused when a
    launcher started several processes and no process group exists)."""
    settings = settings or _settings
    if settings is not None and settings.sp_group is not None:
        return settings.sp_group
    if not (dist.is_available() and dist.is_initialized()):
        check_launched("a model patched by lightseq_hf")
        return None
    groups = current_groups()
    if groups is not None and groups.sp_group is not None:
        return groups.sp_group
    return dist.group.WORLD
