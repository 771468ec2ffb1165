"""torch's cuDNN varlen attention ops for the ``cudnn_varlen`` backend: the two calls, and what the op does
on a device (lse layout, causal alignment, host cost of a call), probed once.

Measured on an H100 with torch 2.11.0+cu130 and cuDNN 9.19 (2026-11-24; ``benchmarks/results/``
``packed-kernels-h100-2026-11-24.json`` and ``gpu-tests-cudnn-varlen-h100-2026-11-24.log``): the lse is
``(total, heads, 1)`` float32; the causal diagonal is aligned top-left in every sequence; each call
rebuilds its cuDNN graph (80-100 ms of host time a call, forward or backward); capturing a call in a CUDA
graph crashes the process (segfault in ``capture_end``); a call whose longest query sequence is one token
did not return within 40 s; and the backward is wrong once a sequence is longer than the head dim (its dQ
accumulator is sized by the head dim, pytorch PR 186142), then fails with illegal memory accesses. So
torch before 2.12 is refused (:func:`unusable_reason`); later versions must pass the probe, whose backward
check has a sequence longer than the head dim.

Tests replace :func:`op_forward`, :func:`op_backward` and :func:`host_ms` with a CPU emulation; callers
reach them through this module's attributes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128
#: host time of one repeated small call above which the op is taken to rebuild its graph every call
REBUILD_MS = 2.0


def head_dim_ok(head_dim: int | None) -> bool:
    """Whether the cuDNN varlen op has forward and backward plans for ``head_dim``."""
    return head_dim is not None and head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def check_cudnn_inputs(q: torch.Tensor) -> None:
    """Raise ValueError naming the fix when the cuDNN varlen op cannot take ``q``'s kind of tensor."""
    if q.device.type != "cuda":
        raise ValueError(f"backend 'cudnn_varlen' runs torch's cuDNN attention op and needs CUDA tensors; "
                         f"got {q.device}. Use backend='reference' or 'auto' on the CPU.")
    if q.dtype not in _DTYPES:
        raise ValueError(f"backend 'cudnn_varlen' takes float16 or bfloat16, not {q.dtype}; cast the inputs "
                         "or use backend='triton' or 'reference'.")
    if not head_dim_ok(q.shape[-1]):
        raise ValueError(f"backend 'cudnn_varlen' takes head dims that are multiples of 8 up to "
                         f"{MAX_HEAD_DIM}; got {q.shape[-1]}. Use backend='triton', 'flash_varlen' or "
                         "'reference'.")


#: the shortest longest-sequence a call may have (a call of one-token sequences did not return)
MIN_MAX_LEN = 2


def takes(max_q: int, max_k: int) -> bool:
    """Whether the op takes a call whose longest query / key sequences have these lengths."""
    return max_q >= MIN_MAX_LEN and max_k >= MIN_MAX_LEN


# --- the ops (tests replace these two with a CPU emulation) -------------------------------------------

def op_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(out, lse, philox_seed, philox_offset)`` of the varlen op: ``q`` ``(total_q, heads, dim)``,
    ``k``/``v`` ``(total_k, kv_heads, dim)``, int32 cumulative lengths; lse in the op's layout."""
    check_cudnn_inputs(q)
    res = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale
    )
    return res[0], res[1], res[6], res[7]


def op_backward(dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(dq, dk, dv)`` of the varlen op (input dtype); ``lse`` in the layout the forward returns,
    ``seed``/``offset`` the placeholders a forward without dropout returned."""
    check_cudnn_inputs(q)
    res = torch.ops.aten._cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal, scale=scale
    )
    return res[0], res[1], res[2]


# --- what the op does, probed once per device ----------------------------------------------------------

@dataclass(frozen=True)
class LseLayout:
    """How the op lays out the lse of ``total`` query rows and ``heads`` heads."""

    ndim: int  # 2, or 3 with a trailing 1
    head_major: bool  # logical (heads, total) rather than (total, heads)
    token_outer: bool  # in memory, the heads of one row are adjacent

    def rows(self, lse: torch.Tensor) -> torch.Tensor:
        """A ``(heads, total)`` view of an lse in this layout."""
        x = lse.squeeze(-1) if self.ndim == 3 else lse
        return x if self.head_major else x.t()

    def view(self, flat: torch.Tensor, total: int, heads: int) -> torch.Tensor:
        """The first ``total * heads`` elements of ``flat`` as an lse in this layout."""
        mem = flat[: total * heads]
        mem = mem.view(total, heads) if self.token_outer else mem.view(heads, total)
        logical = mem if self.token_outer != self.head_major else mem.t()
        return logical.unsqueeze(-1) if self.ndim == 3 else logical


@dataclass(frozen=True, eq=False)
class OpTraits:
    """The op on one device: its lse layout, causal alignment, host cost of a repeated call, and the dropout
    placeholders its backward takes."""

    lse: LseLayout
    bottom_right: bool
    call_ms: float
    seed: torch.Tensor | None
    offset: torch.Tensor | None

    @property
    def rebuilds_graph(self) -> bool:
        return self.call_ms > REBUILD_MS


_traits: dict[str, OpTraits] = {}


def op_traits(device: torch.device) -> OpTraits:
    """The op's traits on ``device`` (probed on first use; raises what the op raises when it cannot run)."""
    key = str(device)
    if key not in _traits:
        _traits[key] = _probe(device)
    return _traits[key]


#: torch releases whose cuDNN varlen backward sizes its dQ accumulator by the head dim (see above)
BAD_BACKWARD_BEFORE = (2, 12)


def version_defect(version: str) -> str | None:
    """Why torch ``version``'s cuDNN varlen op must not be used, or None."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < BAD_BACKWARD_BEFORE:
        return (f"torch {version}'s cuDNN varlen backward is wrong for sequences longer than the head dim "
                "(dQ accumulator sized by the head dim, pytorch PR 186142) and rebuilds its cuDNN graph on "
                "every call; use torch >= 2.12, or backend='triton' / 'flash_varlen'.")
    return None


_unusable: dict[str, str | None] = {}


def unusable_reason(device: torch.device) -> str | None:
    """Why the cuDNN varlen op cannot serve ``device``, or None when it runs correctly there (probed once)."""
    if device.type != "cuda":
        return f"backend 'cudnn_varlen' needs a CUDA GPU; tensors are on {device}."
    key = str(device)
    if key not in _unusable:
        reason = version_defect(torch.__version__)
        if reason is None:
            try:
                op_traits(device)
            except (RuntimeError, NotImplementedError, AttributeError, ValueError, AssertionError) as e:
                reason = f"torch's cuDNN varlen op fails its probe on {device}: {str(e).splitlines()[0]}"
        _unusable[key] = reason
    return _unusable[key]


def usable(device: torch.device) -> bool:
    """True when the cuDNN varlen op runs correctly on ``device`` (a CUDA GPU; decided once)."""
    return unusable_reason(device) is None


def _reference(q, k, v, cu_q, cu_k, scale, bottom_right):
    """float64 ``(out (total, H, D), lse (H, total))`` of causal blocks, for the probe (differentiable)."""
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        kk, vv = (x[c:d].double().repeat_interleave(group, 1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * scale
        i = torch.arange(b - a, device=q.device)[:, None]
        j = torch.arange(d - c, device=q.device)[None, :]
        s = s.masked_fill(j > i + ((d - c) - (b - a) if bottom_right else 0), -math.inf)
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
    return torch.cat(outs), torch.cat(lses, 1)


def _close(x: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> bool:
    return bool((x.double() - ref).norm() <= tol * ref.norm())


def host_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Host milliseconds of one call of ``fn`` after the device is idle (tests replace this)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe(device: torch.device) -> OpTraits:
    """Run the op on causal blocks (GQA; a block with more keys than queries, one longer than the head dim),
    read off its lse layout, causal alignment and per-call host cost, check forward and backward against
    float64."""
    g = torch.Generator().manual_seed(0)
    heads, dim, cq, ck = 2, 64, [0, 2, 72], [0, 5, 75]  # the second sequence is longer than the head dim
    q, dout = (torch.randn(cq[-1], heads, dim, generator=g).to(device, torch.bfloat16) for _ in "qd")
    k, v = (torch.randn(ck[-1], 1, dim, generator=g).to(device, torch.bfloat16) for _ in "kv")
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in (cq, ck))
    args = (cu_q, cu_k, 70, 70, True, 0.125)
    out, lse, seed, offset = op_forward(q, k, v, *args)
    layout = _lse_layout(lse, cq[-1], heads)
    for bottom_right in (True, False):
        ref_out, ref_lse = _reference(q, k, v, cq, ck, 0.125, bottom_right)
        if _close(out, ref_out) and (layout.rows(lse).double() - ref_lse).abs().max() < 2e-2:
            break
    else:
        raise RuntimeError("cuDNN varlen op matches neither causal alignment on the probe blocks.")
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    _reference(*leaves, cq, ck, 0.125, bottom_right)[0].backward(dout.double())
    grads = op_backward(dout, q, k, v, out, lse, seed, offset, *args)
    if not all(_close(x, ref.grad) for x, ref in zip(grads, leaves)):
        raise RuntimeError("cuDNN varlen backward does not match float64 on the probe blocks.")
    call_ms = min(host_ms(lambda: op_forward(q, k, v, *args), device) for _ in range(3))
    return OpTraits(layout, bottom_right, call_ms, seed, offset)


def _lse_layout(lse: torch.Tensor, total: int, heads: int) -> LseLayout:
    dims = tuple(lse.shape)
    if dims[:2] not in ((total, heads), (heads, total)) or (lse.dim() == 3 and dims[2] != 1):
        raise RuntimeError(f"cuDNN varlen lse has shape {dims}; expected (total, heads[, 1]) or "
                           "(heads, total).")
    head_major = dims[0] == heads
    t_dim, h_dim = (1, 0) if head_major else (0, 1)
    return LseLayout(lse.dim(), head_major, lse.stride(t_dim) > lse.stride(h_dim))
