"""Test-only CPU emulation of torch's cuDNN varlen attention ops (float64, one block at a time), behind
``lightseq_hf.kernels.cudnn_ops``.

It follows the op's conventions: ``(total, heads, dim)`` rows, GQA by head groups, a causal diagonal
aligned top-left (torch 2.11) or bottom-right in every sequence, an lse in a given :class:`LseLayout`, a
backward that reads the lse in that layout and the dropout placeholders the forward returned.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lightseq_hf.kernels import cudnn_ops
from lightseq_hf.kernels.cudnn_ops import LseLayout, OpTraits
from lightseq_hf.kernels.cudnn_varlen import CudnnVarlenKernel

#: the op's lse layouts the tests run: torch 2.11's ``(total, heads, 1)``, and ``(heads, total)``
LAYOUTS = {"tokens": LseLayout(3, False, True), "heads": LseLayout(2, True, False)}


def _blocks(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return list(zip(cq, cq[1:], ck, ck[1:]))


class Emulation:
    """The two ops and their host time; ``calls``: (op, q_lens, k_lens, causal)."""

    def __init__(self, layout: LseLayout, bottom_right: bool, call_ms: float) -> None:
        self.layout, self.bottom_right, self.call_ms = layout, bottom_right, call_ms
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...], bool]] = []
        self.seed, self.offset = torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    def _scores(self, q, k, causal, scale):
        group = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, 1)) * scale
        m, n = q.shape[0], k.shape[0]
        if causal:
            shift = n - m if self.bottom_right else 0
            s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(m)[:, None] + shift, -math.inf)
        return s

    def _record(self, op, q, k, cu_q, cu_k, max_q, max_k, causal):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.is_contiguous() and k.is_contiguous()
        blocks = _blocks(cu_q, cu_k)
        assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
        assert max_q == max(b - a for a, b, _, _ in blocks) and max_k == max(d - c for _, _, c, d in blocks)
        self.calls.append((op, tuple(b - a for a, b, _, _ in blocks), tuple(d - c for _, _, c, d in blocks),
                           causal))
        return blocks

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        blocks = self._record("forward", q, k, cu_q, cu_k, max_q, max_k, causal)
        h, group = q.shape[1], q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=q.dtype)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = self.layout.view(torch.full((q.shape[0] * h,), math.nan, dtype=lse_dtype), q.shape[0], h)
        rows = self.layout.rows(lse)
        for a, b, c, d in blocks:
            s = self._scores(q[a:b], k[c:d], causal, scale)
            row_lse = torch.logsumexp(s, -1)
            p = torch.exp(s - row_lse[..., None])
            ve = v[c:d].double().repeat_interleave(group, 1)
            out[a:b] = torch.einsum("hqk,khd->qhd", p, ve).to(q.dtype)
            rows[:, a:b] = row_lse.to(lse_dtype)
        return out, lse, self.seed, self.offset

    def backward(self, dout, q, k, v, out, lse, seed, offset, cu_q, cu_k, max_q, max_k, causal, scale):
        blocks = self._record("backward", q, k, cu_q, cu_k, max_q, max_k, causal)
        assert seed is self.seed and offset is self.offset, "backward needs the forward's placeholders"
        h, hk = q.shape[1], k.shape[1]
        group = h // hk
        probe = self.layout.view(torch.empty(q.shape[0] * h), q.shape[0], h)
        assert lse.shape == probe.shape and lse.stride() == probe.stride(), (lse.shape, lse.stride())
        rows = self.layout.rows(lse).double()
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
        delta = (dout.double() * out.double()).sum(-1).t()  # from out, as the op does
        for a, b, c, d in blocks:
            s = self._scores(q[a:b], k[c:d], causal, scale)
            p = torch.exp(s - rows[:, a:b, None])
            ke, ve = (x[c:d].double().repeat_interleave(group, 1) for x in (k, v))
            do = dout[a:b].double()
            ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - delta[:, a:b, None]) * scale
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ke)
            dk[c:d] = torch.einsum("hqk,qhd->khd", ds, q[a:b].double()).view(d - c, hk, group, -1).sum(2)
            dv[c:d] = torch.einsum("hqk,qhd->khd", p, do).view(d - c, hk, group, -1).sum(2)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    def host_ms(self, fn, device):
        """The host time the emulated op takes per call (a graph rebuilt each call, or not)."""
        fn()
        return self.call_ms


def install(setattr_, *, layout: str = "tokens", bottom_right: bool = False, slow: bool = False,
            probe: bool = False) -> Emulation:
    """Put an :class:`Emulation` behind the cuDNN varlen kernel on the CPU (``setattr_``:
    ``monkeypatch.setattr``). ``slow``: the op takes the host time of one that rebuilds its graph every call.
    ``probe``: leave the traits to the kernel's own probe (else they are set to the emulation's)."""
    call_ms = 3 * cudnn_ops.REBUILD_MS if slow else 0.1
    emu = Emulation(LAYOUTS[layout], bottom_right, call_ms)
    setattr_(cudnn_ops, "op_forward", emu.forward)
    setattr_(cudnn_ops, "host_ms", emu.host_ms)
    setattr_(cudnn_ops, "op_backward", emu.backward)
    setattr_(cudnn_ops, "_traits", {})
    # the backend's declared capabilities widened to what the emulation takes: any device, any float dtype
    caps = CudnnVarlenKernel.capabilities
    setattr_(CudnnVarlenKernel, "capabilities",
             replace(caps, devices=None, dtypes=caps.dtypes | {torch.float32, torch.float64}))
    setattr_(CudnnVarlenKernel, "unavailable", lambda self, device, dtype=None: None)
    if not probe:
        cudnn_ops._traits["cpu"] = OpTraits(emu.layout, bottom_right, call_ms, emu.seed, emu.offset)
    return emu
