"""Sequence tiling of the token-wise modules of decoder layers: the dense MLPs and the norms.

An MLP of ``tokens x hidden`` input makes ``tokens x intermediate`` activations (gate, up, the
activation and the product: about 4x the hidden state at Llama's 2.7x expansion), in the forward
and again in the backward's recompute; a norm keeps a float32 copy of its input and its normalized
output (three hidden states' worth in bf16). :class:`_TiledFunction` runs such a module on ``tile``
tokens at a time (each tile a batch of one sequence): the forward without autograd, keeping only the
input, the backward recomputing each tile's forward and differentiating it at once, so at most one
tile's activations are alive (the first norm of a layer then keeps nothing: its input is the layer
input checkpointing keeps anyway). The result is the untiled module's (token rows are independent);
parameter gradients are summed over the tiles in float32 (float64 for float64 weights) and cast once.

The module's own ``forward`` runs per tile, so wrapped projections (PEFT's LoRA layers) and any norm
(Llama's RMSNorm, Gemma's (1 + w) one, LayerNorm, per-head q/k norms) work too.
:func:`apply_tiled_mlp` installs it on a model's dense MLPs (:func:`layer_mlps`: the feed-forward
module of each decoder layer whose parameters all belong to two or more linear layers) and norms
(:func:`layer_norms`); mixture-of-experts blocks and other feed-forwards stay untiled, with a logged
note, and so does any module called with more than its input. :func:`remove_tiled_mlp` takes it away.
"""

from __future__ import annotations

import inspect
import logging
import math

import torch

from .._values import is_positive_int

__all__ = [
    "TiledForward", "apply_tiled_mlp", "check_tiled_mlp", "layer_mlps", "layer_norms", "remove_tiled_mlp",
]

_logger = logging.getLogger("lightseq_hf")


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype] | None:
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _TiledFunction(torch.autograd.Function):
    """``module(x)`` a ``tile`` of rows (of ``x`` flattened to its last dimension) at a time; ``params``
    are the module's trainable parameters (passed so that autograd hands their gradients to the
    optimizer, DDP and FSDP as usual)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: torch.nn.Module, tile: int, *params: torch.Tensor):
        ctx.module, ctx.tile = module, tile
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        forward = type(module).forward
        out = None
        for start in range(0, flat.shape[0], tile):
            piece = forward(module, flat[None, start:start + tile])[0]  # (1, tile, hidden): a short sequence
            if out is None:  # written tile by tile: no second full-length copy
                out = piece.new_empty(flat.shape[0], piece.shape[-1])
            out[start:start + tile] = piece
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        module, tile = ctx.module, ctx.tile
        params = [p for p in module.parameters() if p.requires_grad]
        need_x = ctx.needs_input_grad[0]
        flat = x.reshape(-1, x.shape[-1]).detach()
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if need_x else None
        sums = [torch.zeros_like(p, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
                for p in params]
        forward = type(module).forward
        autocast = (torch.autocast(x.device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0])
                    if ctx.autocast is not None else torch.autocast(x.device.type, enabled=False))
        for start in range(0, flat.shape[0], tile):
            piece = flat[start:start + tile].requires_grad_(need_x)
            with torch.enable_grad(), autocast:
                out = forward(module, piece[None])[0]
            inputs = ([piece] if need_x else []) + params
            grads = torch.autograd.grad(out, inputs, grad_flat[start:start + tile], allow_unused=True)
            if need_x:
                grad_x[start:start + tile] = grads[0]
                grads = grads[1:]
            for total, grad in zip(sums, grads):
                if grad is not None:
                    total += grad
        grad_params = tuple(total.to(p.dtype) for total, p in zip(sums, params))
        # the Function's params inputs are exactly the trainable parameters, in the same order
        return (grad_x.view(x.shape) if need_x else None, None, None, *grad_params)


class TiledForward:
    """A token-wise module's ``forward`` replaced by the tiled one (installed as an instance attribute)."""

    def __init__(self, module: torch.nn.Module, tile: int) -> None:
        self.module_ref = module
        self.tile = tile

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        module = self.module_ref
        per_token = math.prod(x.shape[2:-1])  # rows per token: heads, for a (batch, seq, heads, dim) input
        tokens = x.numel() // x.shape[-1] // max(per_token, 1)
        if tokens <= self.tile or args or kwargs:  # short, or called with more than its input
            return type(module).forward(module, x, *args, **kwargs)
        rows = self.tile * per_token
        params = [p for p in module.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            with torch.no_grad():
                return _TiledFunction.forward(_NoCtx(), x, module, rows)
        return _TiledFunction.apply(x, module, rows, *params)


class _NoCtx:
    """Stands for autograd's ctx when the tiled forward runs without autograd."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM or of its decoder stack (empty if it has none)."""
    from .architectures import decoder_layers, decoder_stack

    return decoder_layers(decoder_stack(model) or model) or torch.nn.ModuleList()


def _recorded_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """Classes whose outputs Transformers records through hooks (routers): never run them per tile."""
    found = []
    for module in model.modules():
        for target in getattr(module, "_can_record_outputs", None) or {}:
            value = module._can_record_outputs[target]
            cls = getattr(value, "target_class", value)
            if isinstance(cls, type) and target == "router_logits":
                found.append(cls)
    return tuple(found)


def _is_dense(module: torch.nn.Module, recorded: tuple[type, ...]) -> bool:
    """Two or more linear layers hold every parameter (so tokens are independent), and no router inside."""
    linear = 0
    for sub in module.modules():
        if recorded and isinstance(sub, recorded):
            return False
        if isinstance(sub, torch.nn.Linear):
            linear += 1
        elif any(True for _ in sub.parameters(recurse=False)):
            return False
    return linear >= 2


def layer_mlps(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[str]]:
    """The dense MLPs of the model's decoder layers, and the names of the feed-forward modules that are
    not (mixture-of-experts blocks and others), which stay untiled."""
    from .architectures import uses_attention_interface

    recorded = _recorded_classes(model)
    dense, other = [], []
    for i, layer in enumerate(_decoder_layers(model)):
        for name, child in layer.named_children():
            attention = any(uses_attention_interface(type(m)) for m in child.modules())
            if (attention or "norm" in name.lower() or isinstance(child, torch.nn.Linear)
                    or not any(True for _ in child.parameters())):
                continue  # attention, norms, bare projections (an MLP without a module of its own)
            if _is_dense(child, recorded):
                dense.append(child)
            else:
                other.append(f"layer {i} {name} ({type(child).__name__})")
    return dense, other


def _is_norm(module: torch.nn.Module) -> bool:
    """A normalization over the last dimension: "norm" in its class name, vector parameters only, a
    forward taking one tensor (batch, group and instance norms normalize over other dimensions)."""
    if "norm" not in type(module).__name__.lower() or isinstance(
            module, (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm)):
        return False
    if any(p.dim() > 1 for p in module.parameters()) or any(True for _ in module.children()):
        return False
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                          p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def layer_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The norms inside the model's decoder layers (the layers' own and their attention's q/k norms)."""
    return [m for layer in _decoder_layers(model) for m in layer.modules() if _is_norm(m)]


def check_tiled_mlp(tile_tokens: int | None) -> int | None:
    """``tile_tokens`` if it is a positive int or None; else a ValueError saying what is wanted."""
    if tile_tokens is not None and not is_positive_int(tile_tokens):
        raise ValueError(f"tiled_mlp must be a positive number of tokens per tile (e.g. 8192) or None "
                         f"(untiled); got {tile_tokens!r}.")
    return tile_tokens


def apply_tiled_mlp(model: torch.nn.Module, tile_tokens: int | None) -> int:
    """Run every dense MLP and every norm of ``model``'s decoder layers ``tile_tokens`` tokens at a time
    (None: untiled, undoing an earlier call). Returns how many MLPs are tiled; the feed-forwards that
    cannot be tiled are named in a log line."""
    check_tiled_mlp(tile_tokens)
    if tile_tokens is None:
        remove_tiled_mlp(model)
        return 0
    dense, other = layer_mlps(model)
    for module in [*dense, *layer_norms(model)]:
        if "forward" not in module.__dict__ or isinstance(module.__dict__["forward"], TiledForward):
            module.forward = TiledForward(module, tile_tokens)
    if other:
        _logger.warning("lightseq_hf: tiled_mlp=%d leaves %d feed-forward module(s) untiled (not dense MLPs: "
                       "mixture-of-experts blocks or others), e.g. %s.", tile_tokens, len(other), other[0])
    return len(dense)


def remove_tiled_mlp(model: torch.nn.Module) -> None:
    """Give every MLP of ``model`` its own forward back."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), TiledForward):
            del module.forward
