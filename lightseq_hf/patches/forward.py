"""The patched forwards: the split at the decoder stack, and the causal LM's loss on the slice.

* The decoder stack (``model.<base_model_prefix>``, e.g. ``LlamaModel``) takes the full rows every
  rank of the group received, keeps this rank's contiguous slice (right-padding to a multiple of the
  group size, global position ids), runs its layers with the sequence-parallel context as a keyword
  argument (it survives the recompute of checkpointed layers), and all-gathers along the sequence at
  its exit (differentiable: :func:`~lightseq_hf.parallel.sharding.gather_sequence`): the final hidden
  states, and always the MoE router logits, so an auxiliary load-balancing loss formed from them is
  the unsharded model's.
* The causal LM's own ``forward`` runs around it, with its head on this rank's slice and its
  ``loss_function`` replaced for the call by the group's exact loss: a plain head
  (``logits = self.lm_head(...)``) takes the fused chunked loss (no full-vocabulary logits of the
  slice); a head with extras (soft-capping, logit scaling) computes the slice's logits itself and
  the loss is taken from them. The model's own code adds what it adds (the router aux loss).
* With the fused loss, the decoder stack's final norm (:func:`_final_norm`: its forward's last
  assignment of the hidden states is ``hidden_states = self.<norm>(hidden_states)``) passes its input
  through inside the stack and runs in the loss instead, one chunk at a time, so no normalized copy
  of the whole slice exists; where the norm is not recognized, or the hidden states are asked for,
  it runs in the stack as usual. The norm gets its :class:`_FinalNormForward` when the model is
  adopted, so no forward sets a module's ``forward`` (``torch.compile`` traces these forwards).
* Forward hooks a user put on the head, the decoder stack or its final norm (:mod:`.user_hooks`) see the
  whole sequence: the causal LM then runs the unfused path, the decoder stack gathers the rows before its
  final norm and the norm runs after the gather; with NEFTune the input embeddings run on the whole rows.

Calls with a KV cache (``use_cache=True``, ``cache`` or ``past_key_values``: generation, prefill) run the
unpatched model on every rank, unsharded; so does every call under :func:`.state.as_unpatched` (the
parity check's reference).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..parallel.fused_loss import fused_head
from ..parallel.sharding import (
    IGNORE_INDEX,
    gather_sequence,
    num_loss_tokens,
    sequence_parallel_loss,
    shift_labels,
    take_shard,
)
from .architectures import MEDIA_WORDS, Architecture, decoder_stack, forward_tree
from .attention import ACTIVE_MODEL
from .batch import SplitBatch, split_batch
from .rope import whole_sequence_frequencies
from .state import PatchSettings, running_unpatched, settings_of
from .user_hooks import has_user_hooks, hooked_outputs, hooks_held_aside, module_names, whole_row_embeddings

__all__ = [
    "LOSS_CHUNK_TOKENS", "cache_keyword", "install_final_norm", "make_causal_lm_forward",
    "make_decoder_forward", "remove_final_norm", "warn_once",
]

#: ``lightseq_logits`` values: logits of the whole sequence on every rank, or of this rank's slice
_LOGITS_LAYOUTS = ("full", "shard")
#: tokens per chunk of the chunked loss (full-vocabulary float32 logits of one chunk at a time)
LOSS_CHUNK_TOKENS = 2048

_logger = logging.getLogger("lightseq_hf")
_MISSING = object()


@dataclass
class _PendingSplit:
    """Handed from the causal LM's forward to its decoder stack for one call."""

    split: SplitBatch
    gather: bool  # gather the final hidden states (the head then runs on the whole sequence)
    hidden: torch.Tensor | None = None  # the decoder's sharded final hidden states (fused loss)
    loss_calls: list = field(default_factory=list)
    final_norm: torch.nn.Module | None = None  # run inside the fused loss instead of the decoder stack
    norm_calls: list = field(default_factory=list)  # the final norm's calls that passed their input through


_CACHE_NAMES = ("cache", "past_key_values")  # Transformers 5.24 renamed past_key_values to cache


def _take_cache(cache: Any, kwargs: dict[str, Any]) -> Any:
    """The KV cache of a call, under either of its names (removed from ``kwargs``)."""
    for name in _CACHE_NAMES:
        given = kwargs.pop(name, None)
        if given is not None and cache is not None and given is not cache:
            raise ValueError("Pass the KV cache once: as cache (Transformers >= 5.24) or past_key_values.")
        cache = given if given is not None else cache
    return cache


def cache_keyword(original) -> str:
    """The name under which ``original`` (a model's forward) takes the KV cache."""
    parameters = inspect.signature(original).parameters
    return next((name for name in _CACHE_NAMES if name in parameters), "past_key_values")


def _wants_cache(use_cache: Any, cache: Any) -> bool:
    return cache is not None or use_cache is True


def _with_fallback_attention(model: torch.nn.Module, call):
    """Run ``call()`` with the model's own attention implementation (the one before the patch)."""
    warn_once("cache", "lightseq_hf: a call with a KV cache (use_cache=True, cache or past_key_values: "
              "generation, prefill) runs the unpatched model on every rank, unsharded.")
    fallback = model.__dict__.get("_lightseq_fallback_attn")
    previous = model.config._attn_implementation
    if fallback is not None:
        model.config._attn_implementation = fallback
    try:
        return call()
    finally:
        model.config._attn_implementation = previous


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _logger.warning(message)


def _check_outputs(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    given = [name for name, value in kwargs.items()
             if value is not None and any(word in name for word in MEDIA_WORDS)]
    if given:
        raise ValueError(f"{', '.join(given)}: image, audio and cross-attention inputs cannot be split along "
                         "the text sequence; a patched model takes text only. Call lightseq_hf.unpatch() "
                         "to run the model with them.")
    if kwargs.get("output_attentions", getattr(model.config, "output_attentions", False)):
        raise ValueError(
            "output_attentions=True is not supported by lightseq_hf's distributed attention: it never forms "
            "the attention matrix. Call the model without output_attentions (and with "
            "config.output_attentions=False), or call lightseq_hf.unpatch() first to get attention "
            "maps from the unpatched model."
        )


def _gather_router_logits(router_logits: tuple, split: SplitBatch) -> tuple:
    """Each layer's router logits of this slice (``(batch * local, experts)`` or ``(batch, local,
    experts)``) -> those of the whole sequence, in the same layout (padding dropped)."""
    rows = split.input_ids if split.input_ids is not None else split.inputs_embeds
    batch, shard = rows.shape[0], split.shard
    gathered = []
    for logits in router_logits:
        if logits is None or not torch.is_tensor(logits):
            gathered.append(logits)
            continue
        flat = logits.dim() == 2
        if flat and logits.shape[0] != batch * shard.local_len:
            raise ValueError(f"router logits of shape {tuple(logits.shape)} are not (batch x tokens, "
                             f"experts) of this slice ({batch} x {shard.local_len}); cannot gather them.")
        rows_first = logits.view(batch, shard.local_len, -1) if flat else logits
        full = gather_sequence(rows_first, split.group, shard)
        gathered.append(full.reshape(-1, full.shape[-1]) if flat else full)
    return tuple(gathered)


def make_decoder_forward(original, architecture_of):
    cache_name = cache_keyword(original)

    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        cache = _take_cache(cache, kwargs)
        pending: _PendingSplit | None = self.__dict__.pop("_lightseq_pending", None)
        own = "lightseq_sp" in kwargs or running_unpatched()
        if own or (pending is None and _wants_cache(use_cache, cache)):
            kwargs[cache_name] = cache
            call = lambda: original(self, input_ids=input_ids, attention_mask=attention_mask,  # noqa: E731
                                    position_ids=position_ids, inputs_embeds=inputs_embeds,
                                    use_cache=use_cache, **kwargs)
            return call() if own else _with_fallback_attention(self, call)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        _check_outputs(self, kwargs)
        arch = architecture_of(self)
        if pending is None:  # called on its own (or its inputs may have been changed by a user pre-hook)
            pending = _PendingSplit(split_batch(
                self, settings_of(self), input_ids, inputs_embeds, attention_mask, position_ids, kwargs,
                layer_kinds=arch.layer_kinds, positions_from_mask=arch.positions_from_mask), gather=True)
        split = pending.split
        norm_after = _hooked_final_norm(self, pending)  # runs on the gathered rows, as its hooks expect
        moved = pending.final_norm is not None or norm_after is not None
        token = ACTIVE_MODEL.set(arch.model_type)
        if moved:
            self.__dict__["_lightseq_norm_in_loss"] = pending  # _FinalNormForward passes its input through
        try:
            with (whole_sequence_frequencies(self, split.last_position), hooks_held_aside(norm_after),
                  whole_row_embeddings(self, input_ids, split.shard)):
                outputs = original(self, input_ids=split.input_ids, inputs_embeds=split.inputs_embeds,
                                   attention_mask=None, position_ids=split.position_ids, use_cache=False,
                                   lightseq_sp=split.context, return_dict=True, **kwargs)
        finally:
            ACTIVE_MODEL.reset(token)
            self.__dict__.pop("_lightseq_norm_in_loss", None)
        if moved and len(pending.norm_calls) != 1:
            raise RuntimeError(f"{arch.model_type}: the decoder stack called its final norm "
                               f"{len(pending.norm_calls)} times, not once at its end; lightseq_hf cannot "
                               "run it outside the stack. Report the model type.")
        if getattr(outputs, "router_logits", None) is not None:
            outputs.router_logits = _gather_router_logits(outputs.router_logits, split)
        if pending.gather:
            _gather_outputs(outputs, split, norm_after)
        else:
            pending.hidden = outputs.last_hidden_state
        return outputs if return_dict is not False else outputs.to_tuple()

    forward._lightseq_patched = True
    return forward


def _hooked_final_norm(decoder: torch.nn.Module, pending: _PendingSplit) -> torch.nn.Module | None:
    """The decoder stack's final norm when it carries user hooks and the stack gathers its output: it
    then runs on the whole sequence, after the gather, as in the unpatched model (else None)."""
    norm = decoder.__dict__.get("_lightseq_final_norm")
    return norm if pending.gather and norm is not None and has_user_hooks(norm) else None


def _gather_outputs(outputs, split: SplitBatch, norm_after: torch.nn.Module | None) -> None:
    """The decoder stack's outputs of this slice -> those of the whole sequence (``norm_after``: the final
    norm, applied to the gathered rows)."""
    states = getattr(outputs, "hidden_states", None)
    tied = states is not None and states[-1] is outputs.last_hidden_state  # Transformers ties the last one
    last = gather_sequence(outputs.last_hidden_state, split.group, split.shard)
    outputs.last_hidden_state = norm_after(last) if norm_after is not None else last
    if states is not None:
        gathered = [gather_sequence(h, split.group, split.shard) for h in (states[:-1] if tied else states)]
        outputs.hidden_states = (*gathered, outputs.last_hidden_state) if tied else tuple(gathered)


def make_causal_lm_forward(original, architecture_of):
    cache_name = cache_keyword(original)

    @functools.wraps(original)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, **kwargs):
        cache = _take_cache(cache, kwargs)
        layout = kwargs.pop("lightseq_logits", "full")
        if running_unpatched() or _wants_cache(use_cache, cache):  # the original model, unsharded
            call = lambda: original(  # noqa: E731
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **{cache_name: cache},
                **kwargs)
            return call() if running_unpatched() else _with_fallback_attention(self, call)
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        out = _causal_lm_forward(self, original, architecture_of(self), settings_of(self), layout,
                                dict(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids, inputs_embeds=inputs_embeds),
                                labels, kwargs)
        return out if return_dict is not False else out.to_tuple()

    forward._lightseq_patched = True
    return forward


def _causal_lm_forward(model, original, arch: Architecture, settings: PatchSettings, layout: str,
                      inputs: dict[str, Any], labels, kwargs: dict[str, Any]):
    """The model's own forward on this rank's slice, with the group's loss (see the module docstring)."""
    if layout not in _LOGITS_LAYOUTS:
        raise ValueError(f"lightseq_logits={layout!r}: choose 'full' (the whole sequence on every rank, "
                         "the default) or 'shard' (this rank's slice of the sequence).")
    keep = kwargs.get("logits_to_keep", 0)
    if layout == "shard" and not (isinstance(keep, int) and keep == 0):
        raise ValueError("logits_to_keep selects positions of the whole sequence; use it with "
                         "lightseq_logits='full'.")
    shifted = kwargs_shift = kwargs.pop("shift_labels", None)
    if shifted is None and labels is not None:
        shifted = shift_labels(labels)
    num_items = kwargs.pop("num_items_in_batch", None)
    _check_outputs(model, kwargs)
    full = inputs["input_ids"] if inputs["input_ids"] is not None else inputs["inputs_embeds"]
    if shifted is not None and (shifted.is_floating_point() or shifted.dtype == torch.bool):
        raise ValueError(f"labels must be integer token ids (int64, -100 where no loss is taken); got dtype "
                         f"{shifted.dtype}.")
    if shifted is not None and full is not None and shifted.shape[:2] != full.shape[:2]:
        raise ValueError(f"labels have shape {tuple(shifted.shape)} but the inputs have "
                         f"{tuple(full.shape[:2])} (batch, tokens): expected length {full.shape[1]}.")
    decoder = decoder_stack(model)
    split = split_batch(model, settings, inputs["input_ids"], inputs["inputs_embeds"],
                        inputs["attention_mask"], inputs["position_ids"], kwargs, shifted_labels=shifted,
                        layer_kinds=arch.layer_kinds, positions_from_mask=arch.positions_from_mask)
    mode = ("fused" if arch.fused_head else "shard") if shifted is not None else layout
    hooked = hooked_outputs(model, decoder)
    if hooked:  # the hooks see the whole sequence: the model's own head and loss on it, as unpatched
        mode = "full"
        _notice_hooks(model, hooked)
    wants_states = kwargs.get("output_hidden_states", getattr(model.config, "output_hidden_states", False))
    norm = decoder.__dict__.get("_lightseq_final_norm") if mode == "fused" and not wants_states else None
    if norm is not None and (norm._forward_hooks or norm._forward_pre_hooks):
        norm = None  # a unit of its own (FSDP): its parameters are the hooks' to gather, in its own call
    pending = _PendingSplit(split, gather=mode == "full", final_norm=norm)
    if mode == "full":  # the model's own head and loss on the whole sequence, as unpatched
        given_labels = labels
        kwargs.update({k: v for k, v in (("shift_labels", kwargs_shift), ("num_items_in_batch", num_items))
                       if v is not None})
    else:  # labels only make the model call its loss_function: the group's loss, given below
        given_labels = None if shifted is None else (labels if labels is not None else shifted)
        if "logits_to_keep" in inspect.signature(original).parameters:
            kwargs["logits_to_keep"] = 0  # every row of the slice (fused: the head call is the loss)
    loss_function, head_call = _group_loss(model, mode, pending, shifted, num_items)
    if not hooked:  # with hooks the stack splits what it is called with (a pre-hook may change it)
        decoder.__dict__["_lightseq_pending"] = pending
    previous = model.__dict__.get("_loss_function", _MISSING)
    if loss_function is not None:
        model.loss_function = loss_function
    try:
        with head_call:
            out = original(model, **inputs, labels=given_labels, use_cache=False, **kwargs)
    finally:
        decoder.__dict__.pop("_lightseq_pending", None)
        if loss_function is not None:
            model.__dict__.pop("_loss_function", None)
            if previous is not _MISSING:
                model.__dict__["_loss_function"] = previous
    if loss_function is not None and len(pending.loss_calls) != 1:
        raise RuntimeError(f"{type(model).__name__}.forward called its loss_function "
                           f"{len(pending.loss_calls)} times; lightseq_hf expects one call.")
    out.logits = _logits(model, mode, layout, keep, pending, out.logits) if not (
        shifted is not None and model.training) else None
    if mode != "full" and layout == "full" and getattr(out, "hidden_states", None) is not None:
        out.hidden_states = tuple(gather_sequence(h, split.group, split.shard) for h in out.hidden_states)
    return out


def _logits(model, mode: str, layout: str, keep, pending: _PendingSplit, logits: torch.Tensor | None):
    """The logits to return: of the whole sequence (``layout="full"``, ``keep`` applied) or of this
    rank's slice, whichever way the forward ran."""
    split = pending.split
    shard = split.shard
    if mode == "full":  # the model's own head on the whole sequence
        return logits if layout == "full" else logits[:, shard.start:shard.real_end]
    if mode == "fused":  # the head call was the loss; logits for evaluation with labels come now
        hidden = pending.hidden if pending.final_norm is None else pending.final_norm(pending.hidden)
        head = model.get_output_embeddings()
        if layout == "shard":
            return head(hidden[:, :shard.real_end - shard.start])
        return head(_keep_logits(gather_sequence(hidden, split.group, shard), keep))
    if layout == "shard":
        return logits[:, :shard.real_end - shard.start]
    return _keep_logits(gather_sequence(logits, split.group, shard), keep)


def _notice_hooks(model, hooked: list[torch.nn.Module]) -> None:
    names = module_names(model, hooked)
    warn_once(f"hooks {names}", f"lightseq_hf: forward hooks on {names}: the final norm, the head and the "
              "loss run on the whole sequence on every rank, as unpatched, so the hooks see the tensors they "
              "expect (this forms the full logits on every rank instead of the fused chunked loss's chunks).")


def _keep_logits(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(keep, int):
        return hidden[:, -keep:] if keep > 0 else hidden
    return hidden[:, keep]


def _group_loss(model, mode: str, pending: _PendingSplit, shifted, num_items):
    """The ``loss_function`` for the model's forward (the group's mean token loss; None: keep the model's)
    and the context to run the forward in: with the fused loss, the model's own head call returns this
    slice's summed cross-entropy (one call of the head, through its FSDP or DDP hooks)."""
    if shifted is None or mode == "full":
        return None, contextlib.nullcontext()  # the model's own loss on the gathered, whole-sequence logits
    split = pending.split
    local_labels = take_shard(shifted, split.shard, value=IGNORE_INDEX)

    def loss_function(logits, labels=None, vocab_size=None, **_):
        pending.loss_calls.append(mode)
        if mode == "fused" and logits.dim() != 0:
            raise RuntimeError(f"{type(model).__name__}.forward did not pass its hidden states to its output "
                               "head; lightseq_hf's fused loss cannot run. Report the model type.")
        local_sum = logits if mode == "fused" else _cross_entropy_sum(logits, local_labels)
        return sequence_parallel_loss(local_sum, num_loss_tokens(shifted), split.group, num_items)

    if mode != "fused":
        return loss_function, contextlib.nullcontext()
    head = model.get_output_embeddings()
    count = num_items if num_items is not None else num_loss_tokens(shifted)
    scale = 1 / torch.as_tensor(count).clamp(min=1).double()  # the loss divides the group's sum by it
    return loss_function, fused_head(head, local_labels, model.config.vocab_size, LOSS_CHUNK_TOKENS,
                                     pending.final_norm, scale)


def _final_norm(decoder: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack's final norm, when its forward's last assignment of ``hidden_states`` is
    ``hidden_states = self.<name>(hidden_states)`` at the top level of the function, and that module is
    a norm (its class name says so, its parameters are vectors) without a forward of its own (other than
    :class:`_FinalNormForward`); else None. Its hooks decide at each call where it runs: with a user's it runs
    after the gather, with a framework's in the stack, without any in the fused loss."""
    name = _final_norm_name(type(decoder))
    module = getattr(decoder, name, None) if name else None
    if not isinstance(module, torch.nn.Module) or "norm" not in type(module).__name__.lower():
        return None
    own = module.__dict__.get("forward")
    if ((own is not None and not isinstance(own, _FinalNormForward))
            or any(p.dim() > 1 for p in module.parameters())):
        return None
    return module


@functools.cache
def _final_norm_name(decoder_cls: type) -> str | None:
    tree = forward_tree(decoder_cls)
    if tree is None:
        return None
    kinds = (ast.Assign, ast.AugAssign, ast.AnnAssign)
    assigned = [node for node in ast.walk(tree) if isinstance(node, kinds)
                and any(isinstance(t, ast.Name) and t.id == "hidden_states"
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    if not assigned:
        return None
    last = max(assigned, key=lambda node: node.lineno)
    value = last.value
    if (last not in tree.body or not isinstance(last, ast.Assign) or len(last.targets) != 1
            or not isinstance(value, ast.Call) or value.keywords or len(value.args) != 1):
        return None
    func, arg = value.func, value.args[0]
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
            and isinstance(arg, ast.Name) and arg.id == "hidden_states"):
        return func.attr
    return None


class _FinalNormForward:
    """The decoder stack's final norm's ``forward`` (an instance attribute): the norm's own, except
    inside a patched forward that runs it in the fused loss or after the gather, where it returns its
    input (and records the call in the split's ``norm_calls``)."""

    def __init__(self, norm: torch.nn.Module, decoder: torch.nn.Module) -> None:
        self.norm = norm
        self.decoder = decoder

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pending = self.decoder.__dict__.get("_lightseq_norm_in_loss")
        if pending is not None and not args and not kwargs:
            pending.norm_calls.append(1)
            return hidden_states
        return type(self.norm).forward(self.norm, hidden_states, *args, **kwargs)


def install_final_norm(decoder: torch.nn.Module) -> torch.nn.Module | None:
    """Give the decoder stack's final norm its :class:`_FinalNormForward`, and the stack a reference to
    it (None when the norm is not recognized)."""
    norm = _final_norm(decoder)
    if norm is not None:
        norm.forward = _FinalNormForward(norm, decoder)
    decoder.__dict__["_lightseq_final_norm"] = norm
    return norm


def remove_final_norm(model: torch.nn.Module) -> None:
    """Give every final norm of ``model`` its own forward back."""
    for module in model.modules():
        module.__dict__.pop("_lightseq_final_norm", None)
        if isinstance(module.__dict__.get("forward"), _FinalNormForward):
            del module.forward


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed float32 token cross-entropy of this slice's logits, a chunk of rows at a time."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device)
    total = logits.new_zeros((), dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    for i in range(0, flat.shape[0], LOSS_CHUNK_TOKENS):
        total = total + torch.nn.functional.cross_entropy(
            flat[i:i + LOSS_CHUNK_TOKENS].to(total.dtype), targets[i:i + LOSS_CHUNK_TOKENS],
            ignore_index=IGNORE_INDEX, reduction="sum")
    return total
