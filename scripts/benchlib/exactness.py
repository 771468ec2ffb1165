"""Exactness: errors against a reference, and whether a check passed on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .timing import collective_device


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 over the finite entries of ``ref``; infinite when ``x`` and
    ``ref`` are not finite at the same places (a -inf lse must stay -inf)."""
    x64, r64 = x.detach().double(), ref.detach().double()
    finite = torch.isfinite(r64)
    if not torch.equal(finite, torch.isfinite(x64)):
        return float("inf")
    denom = r64[finite].norm().item()
    return (x64[finite] - r64[finite]).norm().item() / max(denom, 1e-30)


def all_ranks(ok: bool, device: torch.device) -> bool:
    """True when ``ok`` holds on every rank of the process group."""
    flag = torch.tensor([int(ok)], device=collective_device(device))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def any_rank(failed: bool, device: torch.device) -> bool:
    """True when ``failed`` holds on some rank of the process group."""
    return not all_ranks(not failed, device)


def per_document_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                           docs: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, ...]:
    """float32 causal attention of each document ``[start, stop)`` on its own (SDPA), with the gradients
    of ``dout``: ``(out, dq, dk, dv)`` over full rows ``(batch, tokens, heads, dim)``."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = torch.zeros_like(q)
    group = q.shape[2] // k.shape[2]
    for start, stop in docs:
        qs, ks, vs = (t[:, start:stop].transpose(1, 2) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        out[:, start:stop] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2)
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad
