"""Sequence-tiled MLP for the Llama-family MLPs (gate/up/down projections and an activation).

An MLP of ``tokens x hidden`` input makes ``tokens x intermediate`` activations (gate, up, the
activation and the product: about 4x the hidden state at Llama's 2.7x expansion), in the forward
and again in the backward's recompute. :class:`TiledMLPFunction` runs the module on ``tile``
tokens at a time: the forward without autograd, the backward recomputing each tile's forward and
differentiating it at once, so at most one tile's intermediate activations are alive. The result
is the untiled MLP's (token rows are independent); parameter gradients are summed over the tiles
in float32 (float64 for float64 weights) and cast once.

The module's own ``forward`` runs per tile, so wrapped projections (PEFT's LoRA layers) work too.
:func:`apply_tiled_mlp` installs it on a model's MLPs; :func:`remove_tiled_mlp` takes it away.
"""

from __future__ import annotations

import torch

#: MLP classes served (the ``*MLP`` of the architectures lightseq_hf patches)
MLP_CLASS_NAMES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")

#: how many times each path ran (tests prove the tiling with it)
call_counts = {"tiled_forward": 0, "tile_forwards": 0, "tile_backwards": 0}


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype] | None:
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class TiledMLPFunction(torch.autograd.Function):
    """``module(x)`` a ``tile`` of tokens at a time; ``params`` are the module's trainable parameters
    (passed so that autograd hands their gradients to the optimizer, DDP and FSDP as usual)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: torch.nn.Module, tile: int, *params: torch.Tensor):
        ctx.module, ctx.tile = module, tile
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        forward = type(module).forward
        out = None
        for start in range(0, flat.shape[0], tile):
            piece = forward(module, flat[start:start + tile])
            if out is None:  # written tile by tile: no second full-length copy
                out = piece.new_empty(flat.shape[0], piece.shape[-1])
            out[start:start + tile] = piece
            call_counts["tile_forwards"] += 1
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
                out = forward(module, piece)
            inputs = ([piece] if need_x else []) + params
            grads = torch.autograd.grad(out, inputs, grad_flat[start:start + tile], allow_unused=True)
            call_counts["tile_backwards"] += 1
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
    """An MLP's ``forward`` replaced by the tiled one (installed as an instance attribute)."""

    def __init__(self, module: torch.nn.Module, tile: int) -> None:
        self.module_ref = module
        self.tile = tile

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module_ref
        tokens = x.numel() // x.shape[-1]
        if tokens <= self.tile:
            return type(module).forward(module, x)
        call_counts["tiled_forward"] += 1
        params = [p for p in module.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            with torch.no_grad():
                return TiledMLPFunction.forward(_NoCtx(), x, module, self.tile)
        return TiledMLPFunction.apply(x, module, self.tile, *params)


class _NoCtx:
    """Stands for autograd's ctx when the tiled forward runs without autograd."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


def _is_mlp(module: torch.nn.Module) -> bool:
    return type(module).__name__ in MLP_CLASS_NAMES


def check_tiled_mlp(tile_tokens: int | None) -> int | None:
    """``tile_tokens`` if it is a positive int or None; else a ValueError saying what is wanted."""
    if tile_tokens is not None and (isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int)
                                    or tile_tokens < 1):
        raise ValueError(f"tiled_mlp must be a positive number of tokens per tile (e.g. 8192) or None "
                         f"(untiled); got {tile_tokens!r}.")
    return tile_tokens


def apply_tiled_mlp(model: torch.nn.Module, tile_tokens: int | None) -> int:
    """Run every Llama-family MLP of ``model`` ``tile_tokens`` tokens at a time (None: untiled, undoing
    an earlier call). Returns how many MLPs are tiled."""
    check_tiled_mlp(tile_tokens)
    count = 0
    for module in model.modules():
        if not _is_mlp(module):
            continue
        if tile_tokens is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = TiledForward(module, tile_tokens)
            count += 1
    return count


def remove_tiled_mlp(model: torch.nn.Module) -> None:
    """Give every MLP of ``model`` its own forward back."""
    apply_tiled_mlp(model, None)
