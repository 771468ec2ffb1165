"""The fused chunked cross-entropy of an output head: no full-vocabulary logits kept, none recomputed.

:func:`chunked_loss_sum` (and :func:`fused_head`, which turns a caller's own head call into it) runs
the head one chunk of tokens at a time and forms each chunk's gradients in the forward
(:class:`_HeadCrossEntropySum`); it finds the module that computes inside wrappers (FSDP1, DDP,
activation checkpointing) and the parameters the head reads (FSDP2's unsharded ones, or the autograd
leaves FSDP1 exposes), so the reduction hooks of data parallelism see ordinary gradients.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["IGNORE_INDEX", "chunked_loss_sum", "fused_head"]

#: The label cross-entropy ignores (Hugging Face's and PyTorch's convention).
IGNORE_INDEX = -100


def _innermost(module: torch.nn.Module) -> torch.nn.Module:
    """The module that computes ``module``'s output, inside wrapper modules that only forward the call.

    Wrappers (FSDP1's ``FullyShardedDataParallel``, DDP, activation-checkpoint wrappers) keep the
    real module under ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module`` / ``module``; their
    own forward (unshard, hooks) must still run, so the call goes to the outer module and the forward
    is replaced on the inner one. FSDP2's ``fully_shard`` and PEFT's LoRA layers are not wrappers in
    this sense: the module itself (a subclass of ``nn.Linear``, or LoRA's ``Linear``) computes.
    """
    for _ in range(8):
        inner = None
        for name in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module"):
            candidate = module._modules.get(name)
            if isinstance(candidate, torch.nn.Module) and len(module._modules) == 1:
                inner = candidate
                break
        if inner is None:
            return module
        module = inner
    return module


def _head_parameters(targets: list[torch.nn.Module], probe: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad that the head's output depends on, as this forward call sees them.

    The modules' own parameters first (under FSDP2 these are the unsharded parameters its
    pre-forward hook registered, the tensors whose gradients FSDP2 reduces). Only a head whose
    parameters are hidden from ``parameters()`` (FSDP1 with ``use_orig_params`` exposes views as
    plain attributes during forward) falls back to the leaves of the autograd graph of ``probe``.
    """
    own = list({id(p): p for target in targets for p in target.parameters() if p.requires_grad}.values())
    if own or not probe.requires_grad:
        return own
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [probe.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            leaves.setdefault(id(variable), variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class _HeadCrossEntropySum(torch.autograd.Function):
    """Sum of cross-entropies of ``head_fn(hidden)``, a chunk of rows at a time, gradients made in forward.

    For every chunk the head runs once, the float32 log-softmax gradient of the chunk's logits is
    formed at once, and ``autograd.grad`` turns it into the chunk's gradients for the hidden rows
    and for the head's parameters (``params``: passed as inputs so that their gradients arrive in
    backward through the ordinary ``AccumulateGrad`` path, where DDP and FSDP hooks expect them).
    Backward only scales the stored gradients: no logits are kept, none recomputed, and no
    parameter (which FSDP may have re-sharded after the forward) is read again. ``grad_scale`` (a 0-dim
    tensor, or None for 1) is the gradient the sum is expected to receive: the chunk gradients are formed
    at that scale, so what the head and a norm inside it round (Llama's norm computes in float32 in any
    model) is rounded at the magnitude the unfused backward would see; backward scales by the ratio.
    """

    @staticmethod
    def forward(ctx, hidden, labels, head_fn, chunk_rows, grad_scale, *params):
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = labels.reshape(-1)
        need_h = ctx.needs_input_grad[0]
        need_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
        wrt_params = [p for p, need in zip(params, need_p) if need]
        acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
        grad_h = torch.empty_like(flat) if need_h else None
        grad_p = [torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32,
                              device=p.device) for p in wrt_params]
        total = torch.zeros((), dtype=acc, device=flat.device)
        for i in range(0, flat.shape[0], chunk_rows):
            y = targets[i:i + chunk_rows]
            h = flat[i:i + chunk_rows].detach().requires_grad_(need_h)
            with torch.enable_grad():
                logits = head_fn(h)
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            wide = logits.detach().to(acc)
            lse = torch.logsumexp(wide, dim=-1)
            picked = wide.gather(1, safe_y[:, None]).squeeze(1)
            total = total + ((lse - picked) * valid).sum()
            wrt = ([h] if need_h else []) + wrt_params
            if wrt and logits.requires_grad:
                dlogits = torch.exp(wide - lse[:, None])
                dlogits.scatter_add_(1, safe_y[:, None], -torch.ones_like(lse)[:, None])
                dlogits = dlogits * valid[:, None]
                if grad_scale is not None:
                    dlogits = dlogits * grad_scale.to(acc)
                dlogits = dlogits.to(logits.dtype)
                grads = torch.autograd.grad(logits, wrt, dlogits, allow_unused=True)
                if need_h:
                    grad_h[i:i + chunk_rows] = grads[0] if grads[0] is not None else 0
                for acc_p, g in zip(grad_p, grads[int(need_h):]):
                    if g is not None:
                        acc_p += g
            del logits
        ctx.save_for_backward(grad_h.view(hidden.shape) if need_h else None, grad_scale, *grad_p)
        ctx.need_p = need_p
        ctx.param_dtypes = [p.dtype for p in params]
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_scale, *grad_p = ctx.saved_tensors
        if grad_scale is not None:
            grad_total = grad_total / grad_scale.to(grad_total.dtype)
        dh = grad_h * grad_total.to(grad_h.dtype) if grad_h is not None else None
        stored = iter(grad_p)
        dparams = [(next(stored) * grad_total).to(dtype) if need else None
                   for need, dtype in zip(ctx.need_p, ctx.param_dtypes)]
        return (dh, None, None, None, None, *dparams)


def chunked_loss_sum(
    hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, vocab: int, chunk_size: int = 2048,
    norm: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Sum of token cross-entropies of ``head(hidden)`` against ``labels``, ``chunk_size`` tokens at a time.

    Works for any head module, however wrapped: the call goes through ``head.__call__`` (so FSDP2's
    and FSDP1's hooks unshard its weights, and the gradients they reduce arrive in backward), with
    the innermost module's forward replaced by the fused chunked loss (:func:`fused_head`). At most one
    chunk of full-vocabulary float32 logits is alive, logits are never recomputed, and no weight is
    read in backward. Chunks whose labels are all ignored still run: every rank's sum must be in the
    graph, or the backward all-reduce would wait forever. ``vocab`` is checked against the head's
    output width. ``norm``: a token-wise module (the decoder's final norm) applied to each chunk before
    the head, so its float32 copies and output exist for one chunk at a time.
    """
    with fused_head(head, labels, vocab, chunk_size, norm):
        return head(hidden)


def _class_forward(module: torch.nn.Module):
    """The forward of ``module``'s class, bound: what calling it would compute, without its hooks."""
    target = _innermost(module)
    return target, type(target).forward.__get__(target)


@contextlib.contextmanager
def fused_head(head: torch.nn.Module, labels: torch.Tensor, vocab: int, chunk_size: int = 2048,
               norm: torch.nn.Module | None = None, grad_scale: torch.Tensor | None = None):
    """Within the context, a call of ``head`` on hidden rows (shaped as ``labels`` plus the hidden
    width) returns the summed cross-entropy of its logits against ``labels`` (a 0-dim tensor) through
    :class:`_HeadCrossEntropySum`: the caller's own head call, hooks and wrappers included, becomes the
    fused loss. Call the head once inside it: FSDP units unshard and reshard around each call. With
    ``norm`` the head's rows are first normalized by it, one chunk at a time (its parameters' gradients
    come back as the head's do); ``grad_scale``: the gradient the loss will give the sum (see
    :class:`_HeadCrossEntropySum`)."""
    target, compute = _class_forward(head)
    targets = [target]
    if norm is not None:
        norm_target, norm_forward = _class_forward(norm)
        targets.append(norm_target)
        head_forward = compute

        def compute(h: torch.Tensor) -> torch.Tensor:
            return head_forward(norm_forward(h))
    chunk_rows = max(1, chunk_size)

    def fused_forward(h: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            with torch.enable_grad():  # one row through the head: its width, and what it reads
                probe = compute(h.reshape(-1, h.shape[-1])[:1].detach())
            params = _head_parameters(targets, probe)
            _check_vocab(probe, vocab)
            del probe
        else:
            params = []
        return _HeadCrossEntropySum.apply(h, labels, compute, chunk_rows, grad_scale, *params)

    if "forward" in target.__dict__:
        raise RuntimeError(f"the loss head {type(target).__name__} already has an instance-level forward; "
                           "lightseq_hf's chunked loss cannot wrap it.")
    target.forward = fused_forward
    try:
        yield
    finally:
        del target.forward


def _check_vocab(logits: torch.Tensor, vocab: int) -> None:
    if logits.shape[-1] != vocab:
        raise ValueError(f"the output head produces {logits.shape[-1]} logits per token but the model's "
                         f"vocab_size is {vocab}; fix config.vocab_size or the head.")
