"""Which causal LMs the patch serves, found from the model itself: its classes, config and code.

A model is served when it is a decoder-only causal LM of Transformers (its class is one that
``AutoModelForCausalLM`` builds) whose decoder stack (``model.<base_model_prefix>``) runs a list
of decoder layers (``GradientCheckpointingLayer``) in which every layer's token mixing goes through
Transformers' ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS``), with causal attention of the
kinds the distributed attention computes exactly: full, sliding-window, chunked. Everything else is
refused here, at patch time, by a :class:`UnsupportedModel` error naming the feature and the model type.

The causal LM's own ``forward`` is kept: the patch runs it on this rank's slice of the sequence.
Its head is read from its source (:func:`_head_extras`): a head that is ``logits = self.lm_head(...)``
alone takes the fused chunked loss; statements that change the logits afterwards (soft-capping,
scaling) keep the model's own head and loss code on the slice.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass

import torch

__all__ = [
    "Architecture", "MEDIA_WORDS", "UnsupportedModel", "decoder_layers", "decoder_stack", "describe",
    "forward_tree", "is_causal_lm", "uses_attention_interface",
]

#: layer kinds (``config.layer_types``) the distributed attention computes exactly
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
#: what the other layer kinds of Transformers are, for the refusal message
_OTHER_KINDS = {
    "linear_attention": "linear-attention / state-space (Mamba, gated delta net)",
    "conv": "short-convolution",
    "hybrid": "hybrid attention + state-space",
    "hybrid_sliding": "hybrid attention + state-space",
    "indexed_attention": "sparse indexed attention",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed sparse attention",
    "mlp": "attention-free (MLP-only)",
    "moe": "attention-free (MoE-only)",
}
#: words of the forward arguments of multimodal models (images, audio, cross-attention states)
MEDIA_WORDS = ("pixel", "image", "audio", "video", "vision", "speech", "cross_attention", "encoder_hidden")
_CROSS_WORDS = ("cross_attention", "encoder_hidden")
#: arguments the decoder stack's forward must take (the split passes them)
_DECODER_PARAMS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


class UnsupportedModel(ValueError):
    """A model the patch refuses; the message names the feature and the model type."""


@dataclass(frozen=True)
class Architecture:
    """What the patch needs to know about one causal LM."""

    model_type: str
    lm_class: type
    decoder_class: type
    pretrained_class: type  # the ``*PreTrainedModel`` base of both (its gradient checkpointing is routed)
    layer_kinds: tuple[str, ...]
    attention_classes: tuple[type, ...]
    head_extras: str  # the statements changing the logits after the head ("" : a plain head, fused loss)
    features: tuple[str, ...]
    positions_from_mask: bool = False  # the decoder derives absent position_ids from the padding mask (OPT)

    @property
    def fused_head(self) -> bool:
        return not self.head_extras


def _causal_lm_class_names() -> frozenset[str]:
    """Names of the classes ``AutoModelForCausalLM`` builds, for every model type Transformers has."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return frozenset(names)


def _seq2seq_model_types() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def is_causal_lm(model: object) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) and type(model).__name__ in _causal_lm_class_names()


@functools.cache
def _source(function) -> str:
    try:
        return textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError):
        return ""


@functools.cache
def uses_attention_interface(cls: type) -> bool:
    """True for a module class whose forward dispatches through ``ALL_ATTENTION_FUNCTIONS``."""
    forward = cls.__dict__.get("forward")
    return forward is not None and "ALL_ATTENTION_FUNCTIONS" in _source(forward)


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack of a causal LM: the module holding the decoder layers that its ``forward``
    calls (``self.model(...)``, OPT's ``self.model.decoder(...)``), else ``model.<base_model_prefix>``."""
    prefix = getattr(model, "base_model_prefix", "") or "model"
    for path in (*_called_submodules(type(model)), prefix, "model"):
        stack = model
        for name in path.split("."):
            stack = getattr(stack, name, None)
        if isinstance(stack, torch.nn.Module) and stack is not model and decoder_layers(stack) is not None:
            return stack
    return None


@functools.cache
def _called_submodules(cls: type) -> tuple[str, ...]:
    """Dotted attribute paths ``a.b`` of every ``self.a.b(...)`` call in ``cls.forward``, in source order."""
    tree = forward_tree(cls)
    paths = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call):
            chain, target = [], node.func
            while isinstance(target, ast.Attribute):
                chain.append(target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id == "self" and chain:
                paths.append((node.lineno, node.col_offset, ".".join(reversed(chain))))
    return tuple(path for *_, path in sorted(paths))


def decoder_layers(stack: torch.nn.Module | None) -> torch.nn.ModuleList | None:
    """The decoder stack's list of layers: its ``ModuleList`` of ``GradientCheckpointingLayer`` (``layers``,
    GPT-2's ``h``, OPT's ``decoder.layers``...)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if stack is None:
        return None
    for module in stack.modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module)
                and all(isinstance(m, GradientCheckpointingLayer) for m in module)):
            return module
    return None


def _pretrained_base(cls: type) -> type:
    """The model family's ``*PreTrainedModel`` class (the direct subclass of ``PreTrainedModel``)."""
    from transformers import PreTrainedModel

    for klass in cls.__mro__:
        if PreTrainedModel in klass.__bases__:
            return klass
    return cls


def describe(model: torch.nn.Module) -> Architecture:
    """The :class:`Architecture` of a causal LM, or :class:`UnsupportedModel` naming what is not served."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__

    def refuse(feature: str, fix: str = "") -> UnsupportedModel:
        return UnsupportedModel(f"lightseq_hf cannot patch {name} (model_type {model_type!r}): {feature}."
                                + (f" {fix}" if fix else ""))

    if not isinstance(model, PreTrainedModel):
        raise refuse("not a Transformers PreTrainedModel", "Pass the causal LM (AutoModelForCausalLM).")
    if getattr(config, "is_encoder_decoder", False) or model_type in _seq2seq_model_types():
        raise refuse("encoder-decoder models (and their decoders, which attend to encoder states) are not "
                     "supported; the split serves decoder-only causal LMs")
    if name not in _causal_lm_class_names():
        raise refuse("not a causal language model", "Load it with AutoModelForCausalLM.")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        raise refuse("a composite (multimodal) model; its text decoder alone can be sequence-parallel",
                     "Load the text model with AutoModelForCausalLM.")
    decoder = decoder_stack(model)
    layers = decoder_layers(decoder)
    if not isinstance(decoder, PreTrainedModel) or layers is None:
        raise refuse("no decoder stack with a list of decoder layers (composite and multimodal models are "
                     "not supported)", "Load the text model with AutoModelForCausalLM.")
    kinds = _layer_kinds(config, decoder, len(layers), refuse)
    if not type(model)._supports_attention_backend:
        raise refuse("its attention does not go through Transformers' AttentionInterface")
    attention = _attention_modules(layers, refuse)
    signature = inspect.signature(type(decoder).forward).parameters
    media = [p for p in (*signature, *inspect.signature(type(model).forward).parameters)
             if any(word in p for word in MEDIA_WORDS)]
    if not getattr(config, "add_cross_attention", False):  # GPT-2 and kin: cross-attention inputs unused
        media = [p for p in media if not any(word in p for word in _CROSS_WORDS)]
    if media:
        raise refuse(f"a multimodal model (its forward takes {', '.join(dict.fromkeys(media))}); its image, "
                     "audio or cross-attention inputs cannot be split along the text sequence")
    missing = [p for p in _DECODER_PARAMS if p not in signature]
    if missing:
        raise refuse(f"{type(decoder).__name__}.forward does not take {', '.join(missing)}")
    head = _head_extras(model)
    if head is None:
        raise refuse(f"{name}.forward computes its loss without self.loss_function")
    features = _features(model, config, kinds, attention, head, refuse)
    return Architecture(
        model_type=model_type, lm_class=type(model), decoder_class=type(decoder),
        pretrained_class=_pretrained_base(type(model)), layer_kinds=kinds,
        attention_classes=tuple(dict.fromkeys(type(m) for m in attention)), head_extras=head,
        features=features, positions_from_mask=_positions_from_mask(type(decoder)),
    )


@functools.cache
def _positions_from_mask(decoder_class: type) -> bool:
    """Whether the decoder stack counts the positions of absent ``position_ids`` along the padding mask
    (``position_ids = torch.cumsum(attention_mask, ...)``, OPT) rather than along the row."""
    counting = re.compile(r"position_ids\s*=\s*torch\.cumsum\(\s*\w*mask")
    return counting.search(_source(decoder_class.forward)) is not None


def _layer_kinds(config, decoder: torch.nn.Module, num_layers: int, refuse) -> tuple[str, ...]:
    """``config.layer_types``; without it, every layer is sliding-window when the decoder stack builds
    Transformers' sliding-window mask from ``config.sliding_window`` (Mistral, Phi-3, PhiMoE...), else
    empty (each attention passes its own ``sliding_window``, if any)."""
    kinds = tuple(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if (not kinds and window and getattr(config, "use_sliding_window", True) is not False
            and "create_sliding_window_causal_mask" in _source(type(decoder).forward)):
        kinds = ("sliding_attention",) * num_layers
    other = [k for k in dict.fromkeys(kinds) if k not in _ATTENTION_KINDS]
    if other:
        where = ", ".join(f"{kinds.count(k)} of {len(kinds)} {k!r}" for k in other)
        what = ", ".join(_OTHER_KINDS.get(k, k) for k in other)
        raise refuse(f"{what} layers ({where}); only full, sliding-window and chunked attention layers are "
                     "split exactly (linear-attention and state-space hybrids are not supported)")
    if "chunked_attention" in kinds and not getattr(config, "attention_chunk_size", None):
        raise refuse("chunked attention layers without config.attention_chunk_size")
    return kinds


def _attention_modules(layers: torch.nn.ModuleList, refuse) -> list[torch.nn.Module]:
    """The one attention module of each decoder layer; refuses other token mixers."""
    found = []
    for i, layer in enumerate(layers):
        attention = [m for m in layer.modules() if uses_attention_interface(type(m))]
        if not attention:
            raise refuse(f"decoder layer {i} ({type(layer).__name__}) runs no attention through the "
                         "AttentionInterface (a linear-attention, state-space or recurrent layer)")
        convolutions = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Conv1d)]
        if convolutions:
            raise refuse(f"decoder layer {i} has a sequence convolution ({convolutions[0]}: a "
                         "short-convolution or state-space mixer) that the split cannot run exactly")
        for name, child in layer.named_children():
            if any(m in attention for m in child.modules()) and not _passes_keywords(type(layer), name):
                raise refuse(f"{type(layer).__name__}.forward calls self.{name}(...) without its keyword "
                             "arguments, so the sequence-parallel context cannot reach the attention")
        bidirectional = [type(m).__name__ for m in attention if getattr(m, "is_causal", True) is False]
        if bidirectional:
            raise refuse(f"bidirectional attention ({bidirectional[0]}.is_causal is False); only causal "
                         "decoders are supported")
        found += attention
    return found


@functools.cache
def _passes_keywords(cls: type, attribute: str) -> bool:
    """Whether every ``self.<attribute>(...)`` call in ``cls.forward`` passes ``**kwargs`` on (True when
    the source shows no such call: the run-time check then decides)."""
    tree = forward_tree(cls)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == attribute
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"] if tree else []
    return all(any(k.arg is None for k in call.keywords) for call in calls)


def _features(model, config, kinds, attention, head: str, refuse) -> tuple[str, ...]:
    """What the README lists for a served model; refuses configured features that cannot be exact."""
    from ..parallel.api import dist_flash_attn

    features = []
    if "sliding_attention" in kinds or (getattr(config, "sliding_window", None)
                                        and getattr(config, "use_sliding_window", True) is not False):
        features.append("sliding window")
    if "chunked_attention" in kinds:
        features.append("chunked attention")
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not all(no_rope):
        if getattr(config, "attn_temperature_tuning", False):
            raise refuse("attention temperature tuning on layers without RoPE "
                         "(config.attn_temperature_tuning: it scales queries by the token's index in the "
                         "local slice)",
                         "Set config.attn_temperature_tuning = False to train it sequence-parallel.")
        features.append("layers without RoPE")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in attention):
        features.append("attention sinks")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        if "softcap" not in inspect.signature(dist_flash_attn).parameters:
            raise refuse(f"attention logit soft-capping (config.attn_logit_softcapping={softcap}) is not in "
                         "the distributed attention kernels yet",
                         "Set config.attn_logit_softcapping = None to train without it.")
        features.append("attention soft-capping")
    v_dim = getattr(config, "v_head_dim", None)
    qk_dim = getattr(config, "qk_head_dim", None) or (
        (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0))
    if v_dim and qk_dim and v_dim != qk_dim:
        features.append("different q/k and v head dims")
    if hasattr(config, "output_router_logits"):
        features.append("MoE router aux loss")
    if head:
        features.append("model's own head (" + " ".join(head.split()) + ")")
    return tuple(features)


# ----------------------------------------------------------------------------- the head, from the source


def _head_extras(model: torch.nn.Module) -> str | None:
    """The statements of the causal LM's ``forward`` that change the logits after its head, as source.

    ``""``: the head is ``logits = self.<output embeddings>(hidden_states[:, slice_indices, :])`` (or of a
    name assigned that slice) alone
    (an ``if self.config.<x> is not None:`` block whose ``x`` is None does not count), so the fused
    loss reproduces it; a non-empty string: keep the model's own head; ``None``: the forward does
    not compute its loss through ``self.loss_function``.
    """
    tree = forward_tree(type(model))
    if tree is None or not any(isinstance(n, ast.Attribute) and n.attr == "loss_function"
                               and isinstance(n.value, ast.Name) and n.value.id == "self"
                               for n in ast.walk(tree)):
        return None
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return "no logits_to_keep argument"
    body = tree.body
    sliced = set()
    for stmt in body:  # ``hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)``
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and _keeps_logits(stmt.value)):
            sliced.add(stmt.targets[0].id)
    start = next((i for i, stmt in enumerate(body) if _is_head_call(stmt, model, sliced)), None)
    if start is None:
        return "no `logits = self.<head>(<the rows logits_to_keep selects>)`"
    extras = _before_head(model, body[:start])
    for stmt in body[start + 1:]:
        names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        if isinstance(stmt, ast.Return) or names & {"loss", "labels"}:
            break
        if "logits" in names and not _skipped(stmt, model) and not _is_float_cast(stmt):
            extras.append(ast.unparse(stmt))
    return "; ".join(extras)


def _before_head(model: torch.nn.Module, body: list[ast.stmt]) -> list[str]:
    """Statements between the decoder stack's call and the head that change the hidden states (MiniCPM3
    divides them by ``config.logits_scaling``): anything but taking the output and slicing it."""
    stack = decoder_stack(model)
    calls = [p for p in _called_submodules(type(model)) if _resolve(model, p) is stack]
    first = next((i for i, stmt in enumerate(body)
                  if any(f"self.{p}(" in ast.unparse(stmt) for p in calls)), None)
    if first is None:
        return ["the decoder stack's call was not found"]
    output = body[first].target if isinstance(body[first], ast.AnnAssign) else (
        body[first].targets[0] if isinstance(body[first], ast.Assign) else None)
    root = output.id if isinstance(output, ast.Name) else None
    extras = []
    for stmt in body[first + 1:]:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            value = stmt.value
            target = stmt.target if isinstance(stmt, ast.AnnAssign) else stmt.targets[0]
            node = value
            while isinstance(node, (ast.Attribute, ast.Subscript)):
                node = node.value
            if ((isinstance(node, ast.Name) and node.id == root) or _keeps_logits(value)
                    or (isinstance(target, ast.Name) and target.id == "slice_indices")):
                continue
        extras.append(ast.unparse(stmt))
    return extras


def _resolve(model: torch.nn.Module, path: str):
    for name in path.split("."):
        model = getattr(model, name, None)
    return model


@functools.cache
def forward_tree(cls: type) -> ast.FunctionDef | None:
    source = _source(cls.forward)
    if not source:
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.FunctionDef) else None


def _is_head_call(stmt: ast.stmt, model: torch.nn.Module, sliced: set[str]) -> bool:
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == "logits" and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
        return False
    head = getattr(model, func.attr, None)
    args = stmt.value.args
    return (head is not None and head is model.get_output_embeddings() and len(args) == 1
            and (_keeps_logits(args[0]) or (isinstance(args[0], ast.Name) and args[0].id in sliced)))


def _keeps_logits(node: ast.expr) -> bool:
    """``x[:, slice_indices, :]`` or ``slice_logits_to_keep(x, logits_to_keep)``: the head's rows."""
    source = ast.unparse(node)
    return ((isinstance(node, ast.Subscript) and "slice_indices" in source)
            or (isinstance(node, ast.Call) and source.startswith("slice_logits_to_keep(")))


def _skipped(stmt: ast.stmt, model: torch.nn.Module) -> bool:
    """An ``if self.a.b is not None:`` block without ``else`` whose attribute is None on this model."""
    if not isinstance(stmt, ast.If) or stmt.orelse:
        return False
    test = stmt.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        return False
    chain, node = [], test.left
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and chain):
        return False
    value = model
    for attr in reversed(chain):
        value = getattr(value, attr, None)
    return value is None


def _is_float_cast(stmt: ast.stmt) -> bool:
    """``logits = logits.float()``: the fused loss computes in float32 anyway."""
    return isinstance(stmt, ast.Assign) and ast.unparse(stmt) == "logits = logits.float()"
