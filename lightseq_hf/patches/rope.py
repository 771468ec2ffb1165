"""Rotary embeddings whose frequencies depend on the call's length, computed from the whole sequence.

Transformers' dynamic-NTK and LongRoPE embeddings (``dynamic_rope_update``) choose their frequencies from
``max(position_ids) + 1`` of each call. Under the split every rank sees only its slice's positions, so
the ranks would rotate with different frequencies. :func:`whole_sequence_frequencies` runs the
embedding's frequency update once with the last position of the whole sequence, then, for the call,
lets the embedding rotate without updating again: every rank uses the frequencies the unpatched model
uses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

__all__ = ["length_dependent_embeddings", "whole_sequence_frequencies"]

#: rope types whose frequencies ``dynamic_rope_update`` recomputes from each call's positions
_LENGTH_DEPENDENT = ("dynamic", "longrope")


@functools.cache
def _update_wrapper_code():
    """The code object of the function ``dynamic_rope_update`` wraps a rotary forward in."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda *args, **kwargs: None).__code__


def _rotation_only(cls: type):
    """The forward of ``cls`` under Transformers' ``dynamic_rope_update`` (the rotation without the
    frequency update), or None when ``cls.forward`` is not so decorated."""
    fn = getattr(cls, "forward", None)
    for _ in range(8):
        if fn is None:
            return None
        if getattr(fn, "__code__", None) is _update_wrapper_code():
            return getattr(fn, "__wrapped__", None)
        fn = getattr(fn, "__wrapped__", None)
    return None


def _length_dependent_types(module: torch.nn.Module) -> list[str | None]:
    """The layer types (``None``: the single one) of a rotary embedding whose frequencies follow the call's
    length; empty for any other module."""
    if _rotation_only(type(module)) is None:
        return []
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return [None] if any(kind in rope_type for kind in _LENGTH_DEPENDENT) else []
    if isinstance(rope_type, dict):
        return [layer for layer, kind in rope_type.items()
                if isinstance(kind, str) and any(k in kind for k in _LENGTH_DEPENDENT)]
    return []


def length_dependent_embeddings(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[str | None]]]:
    """Each rotary embedding of ``model`` whose frequencies depend on the call's length, with its layer
    types (found once per model)."""
    found = model.__dict__.get("_lightseq_length_dependent_rope")
    if found is None:
        found = [(m, types) for m in model.modules() if (types := _length_dependent_types(m))]
        model.__dict__["_lightseq_length_dependent_rope"] = found
    return found


def _without_update(module: torch.nn.Module):
    rotate = _rotation_only(type(module))

    def forward(*args, **kwargs):
        with torch.no_grad():
            return rotate(module, *args, **kwargs)

    return forward


@contextlib.contextmanager
def whole_sequence_frequencies(model: torch.nn.Module, last_position: torch.Tensor) -> Iterator[None]:
    """Inside the block, ``model``'s length-dependent rotary embeddings use the frequencies of a call whose
    last position is ``last_position`` (a 0-d integer tensor on the inputs' device: the whole sequence's,
    the same on every rank)."""
    embeddings = length_dependent_embeddings(model)
    if not embeddings:
        yield
        return
    probe = torch.zeros((1, 1, 1), device=last_position.device)
    position = last_position.reshape(1, 1)
    for module, types in embeddings:
        for layer_type in types:  # the frequency update the unpatched call makes, with the whole length
            module(probe, position, **({} if layer_type is None else {"layer_type": layer_type}))
        module.forward = _without_update(module)
    try:
        yield
    finally:
        for module, _ in embeddings:
            module.__dict__.pop("forward", None)
