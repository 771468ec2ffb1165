"""Forward hooks users put on the modules around the split, run on what they see in the unpatched model.

* A forward hook or pre-hook on the output head, on the decoder stack or on its final norm (logit
  temperature, distillation, activation steering) sees the whole sequence in the unpatched model. Where
  one is installed, the causal LM runs from the final norm on as unpatched (:func:`hooked_outputs` names
  them): the decoder stack gathers the rows before its final norm, the norm, the head and the model's own
  loss run on the whole sequence on every rank, so each hook gets the tensors it gets unsplit. The cost is
  the unfused path's: the full logits of the batch on every rank.
* NEFTune (Transformers' hook on the input embeddings, which the Trainer and TRL install with
  ``neftune_noise_alpha``) scales its noise by the length of the rows it sees: with it on, the input
  embeddings run on the whole rows (:func:`whole_row_embeddings`), so its noise is the unpatched model's,
  the same draw for the same random state, and each rank keeps its slice.

Hooks of the parallelism frameworks (``torch.distributed``: FSDP, replicate; DeepSpeed; Accelerate) only
gather and release parameters: they are not the user's and run where they are. Hooks inside the decoder
stack (layers, attention, MLPs, embeddings other than NEFTune) run on each rank's slice.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..parallel.sharding import SequenceShard, take_shard

__all__ = ["has_user_hooks", "hooked_outputs", "hooks_held_aside", "module_names", "whole_row_embeddings"]

#: packages whose hooks manage parameters (unshard, fetch, release) and leave the values alone
_FRAMEWORK_HOOK_PACKAGES = ("torch.distributed.", "deepspeed.", "accelerate.")
_MISSING = object()


def _defined_in(hook: Any) -> str:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None) or ""


def has_user_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a module inside it has a forward hook or pre-hook that is not a
    parallelism framework's (:data:`_FRAMEWORK_HOOK_PACKAGES`)."""
    return any(not _defined_in(hook).startswith(_FRAMEWORK_HOOK_PACKAGES)
               for inner in module.modules()
               for hook in (*inner._forward_pre_hooks.values(), *inner._forward_hooks.values()))


def hooked_outputs(model: torch.nn.Module, decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules among the output head, the decoder stack itself and its final norm that carry user
    hooks (for the decoder stack, only hooks on the stack module count: its layers run on slices)."""
    head = model.get_output_embeddings()
    norm = decoder.__dict__.get("_lightseq_final_norm")
    found = [m for m in (head, norm) if m is not None and has_user_hooks(m)]
    if any(not _defined_in(h).startswith(_FRAMEWORK_HOOK_PACKAGES)
           for h in (*decoder._forward_pre_hooks.values(), *decoder._forward_hooks.values())):
        found.append(decoder)
    return found


def module_names(model: torch.nn.Module, modules: list[torch.nn.Module]) -> str:
    """The names of ``modules`` inside ``model``, comma-separated (for messages)."""
    names = {id(m): name for name, m in model.named_modules()}
    return ", ".join(names.get(id(m), type(m).__name__) or type(m).__name__ for m in modules)


@contextlib.contextmanager
def hooks_held_aside(module: torch.nn.Module | None) -> Iterator[None]:
    """Within the context, calling ``module`` runs none of its forward hooks or pre-hooks (they stay
    registered and run again afterwards)."""
    if module is None:
        yield
        return
    held = module._forward_pre_hooks, module._forward_hooks
    module._forward_pre_hooks, module._forward_hooks = collections.OrderedDict(), collections.OrderedDict()
    try:
        yield
    finally:
        module._forward_pre_hooks, module._forward_hooks = held


def _neftune_on(embedding: torch.nn.Module | None) -> bool:
    """Whether Transformers' NEFTune noise is on for ``embedding`` (its ``neftune_noise_alpha``, training)."""
    return (embedding is not None and embedding.training
            and getattr(embedding, "neftune_noise_alpha", None) is not None)


@contextlib.contextmanager
def whole_row_embeddings(decoder: torch.nn.Module, input_ids: torch.Tensor | None,
                         shard: SequenceShard) -> Iterator[None]:
    """With NEFTune on the decoder stack's input embeddings, run them (hooks included) on the whole rows
    ``input_ids`` now; within the context the stack's own call of the embeddings on its slice returns this
    rank's slice of that result (no hook runs twice). Without NEFTune, or given no token ids, nothing
    changes."""
    embedding = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    if input_ids is None or not _neftune_on(embedding):
        yield
        return
    local = take_shard(embedding(input_ids), shard)  # the right padding: zero rows, seen by no real token
    calls = []

    def stand_in(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tuple(ids.shape) != tuple(local.shape[:2]):
            raise RuntimeError(f"{type(decoder).__name__} called its input embeddings on {tuple(ids.shape)} "
                               f"tokens, not on this rank's slice {tuple(local.shape[:2])}; lightseq_hf "
                               "cannot run NEFTune on the whole rows. Report the model type.")
        calls.append(1)
        return local

    previous = embedding.__dict__.get("forward", _MISSING)
    embedding.forward = stand_in
    try:
        with hooks_held_aside(embedding):
            yield
    finally:
        if previous is _MISSING:
            del embedding.forward
        else:
            embedding.forward = previous
    if len(calls) != 1:
        raise RuntimeError(f"{type(decoder).__name__} called its input embeddings {len(calls)} times, not "
                           "once; lightseq_hf cannot run NEFTune on the whole rows. Report the model type.")
