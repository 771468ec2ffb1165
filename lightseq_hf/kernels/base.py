"""The local attention kernel contract shared by every backend.

Layout: ``q`` is ``(batch, q_len, heads, head_dim)``; ``k`` and ``v`` are
``(batch, kv_len, kv_heads, head_dim)`` with ``heads % kv_heads == 0``; query head
``h`` reads key/value head ``h // (heads // kv_heads)`` (key/value heads are never
replicated). ``lse`` is ``(batch, heads, q_len)``, float32, natural log.

Document / window masks: ``key_range=(lo, hi)``, int32 ``(batch, q_len)`` each, gives every query
row ``i`` the keys ``lo[i] <= j < hi[i]`` of this chunk (``0 <= lo, hi <= kv_len``; both
non-decreasing along the row, so tiles outside every row's range are skipped). It replaces the
causal rule (pass ``causal=False``). Backends that take it say so with ``supports_key_range = True``.

Causal masking with ``q_len != kv_len`` is aligned bottom-right (flash-attn's rule):
query row ``i`` sees key ``j`` when ``j <= i + kv_len - q_len``. A row that sees no
key has ``lse = -inf`` and an all-zero output.

forward(q, k, v, *, causal, scale, out=None, lse=None, key_range=None) -> (out, lse)
    Without ``out``/``lse``: returns ``out`` in ``q.dtype`` and ``lse`` in float32.
    With them (float32 running output ``(batch, q_len, heads, head_dim)`` and running
    lse): merges this chunk's attention into them in place (the paper's Algorithm 3)
    and returns them. A running row with ``lse = -inf`` holds nothing yet.

backward(dout, q, k, v, out, lse, *, causal, scale, delta=None,
         dq=None, dk=None, dv=None, key_range=None) -> (dq, dk, dv)
    ``out`` and ``lse`` are the *global* results of the query rows (over every key
    chunk), so gradients of all chunks add up to the full gradient. ``delta`` is
    ``rowsum(dout * out)`` as float32 ``(batch, heads, q_len)``; computed from ``out``
    when not given (``out`` may be ``None`` when ``delta`` is given). When ``dq``/``dk``/``dv``
    (float32) are given, the chunk's gradients are added into them in place; the others are
    returned in float32, or in the input dtype by backends that compute them in it (SDPA).
"""

from __future__ import annotations

from typing import Protocol

import torch

#: Head dims the Triton kernels compile for (padded to 128 inside); kept here so that backend
#: selection can consult it without importing triton.
TRITON_HEAD_DIMS = (64, 80, 96, 128)


class AttentionKernel(Protocol):
    """A local (single-device) attention backend."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        delta: torch.Tensor | None = None,
        dq: torch.Tensor | None = None,
        dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)`` as float32 ``(batch, heads, q_len)`` (float64 for float64 inputs)."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (dout.to(acc) * out.to(acc)).sum(dim=-1).transpose(1, 2).contiguous()


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError naming the problem when q, k, v do not fit the contract."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq, heads, head_dim); got shape {tuple(t.shape)}. "
                "Transpose (batch, heads, seq, head_dim) tensors with .transpose(1, 2)."
            )
        if not t.is_floating_point():
            raise ValueError(
                f"{name} has dtype {t.dtype}; attention needs a floating dtype "
                "(float32, bfloat16, float16 or float64)."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v dtypes disagree ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}).")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v shapes disagree ({tuple(k.shape)} vs {tuple(v.shape)}); they must match."
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes disagree: q has {q.shape[0]}, k/v have {k.shape[0]}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims disagree: q has {q.shape[3]}, k/v have {k.shape[3]}.")
    if q.shape[3] == 0:
        raise ValueError("head_dim is 0: q, k and v need at least one feature per head.")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}) "
            "for GQA/MQA; pick kv_heads dividing heads."
        )


def check_key_range(
    key_range: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor, k: torch.Tensor, causal: bool
) -> None:
    """Raise ValueError naming the problem when ``key_range`` does not fit the contract."""
    if key_range is None:
        return
    if causal:
        raise ValueError("key_range replaces the causal rule; pass causal=False together with key_range.")
    lo, hi = key_range
    shape = (q.shape[0], q.shape[1])
    for name, t in (("lo", lo), ("hi", hi)):
        if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(
                f"key_range {name} must be an int32 tensor of shape {shape} on {q.device}; got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}."
            )


def merge_into(
    out: torch.Tensor,
    lse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> None:
    """Merge ``(part_out, part_lse)`` into the running ``(out, lse)`` in place.

    ``out``/``part_out`` are ``(batch, seq, heads, dim)``; ``lse``/``part_lse`` are
    ``(batch, heads, seq)``. Rows whose lse is ``-inf`` (no key seen yet) contribute
    nothing; a row with ``-inf`` on both sides stays ``-inf`` with a zero output.
    """
    new_lse = torch.logaddexp(lse, part_lse.to(lse.dtype))
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(part_lse.to(lse.dtype) - safe).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(part_out, w_new)  # part_out may be in a lower precision (bf16 on the wire)
    lse.copy_(new_lse)
