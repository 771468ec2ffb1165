"""Test-only CPU emulation of torch's FlashAttention-2 varlen ops (float64, one block at a time).

It follows the ops' conventions: ``(total, heads, dim)`` layout, GQA by head groups, bottom-right causal
masks, ``+inf`` lse for rows that see no key, and an lse either ``(heads, total_q)`` or (older builds)
``(blocks, heads, max_q)``. :func:`install` puts it behind ``lightseq_hf.kernels.varlen.flash``.
"""

from __future__ import annotations

import math

import torch


def _blocks(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return list(zip(cq, cq[1:], ck, ck[1:]))


def _scores(q, k, causal, scale):
    """float64 scores ``(heads, m, n)`` of one block, masked bottom-right when causal."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, 1)) * scale
    m, n = q.shape[0], k.shape[0]
    if causal:
        hidden = torch.arange(n)[None, :] > torch.arange(m)[:, None] + n - m
        s = s.masked_fill(hidden, -math.inf)
    return s


class Emulation:
    """The two ops, recording every call (``calls``: (op, number of blocks, causal, total_q, total_k))."""

    def __init__(self, padded_lse: bool = False) -> None:
        self.padded_lse = padded_lse
        self.calls: list[tuple[str, int, bool, int, int]] = []

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.is_contiguous() and k.is_contiguous()
        blocks = _blocks(cu_q, cu_k)
        assert max_q == max(b - a for a, b, _, _ in blocks) and max_k == max(d - c for _, _, c, d in blocks)
        self.calls.append(("forward", len(blocks), causal, q.shape[0], k.shape[0]))
        h = q.shape[1]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(q.shape, dtype=q.dtype)
        lse = torch.full((h, q.shape[0]), math.inf, dtype=lse_dtype)
        for a, b, c, d in blocks:
            s = _scores(q[a:b], k[c:d], causal, scale)
            row_lse = torch.logsumexp(s, -1)  # (h, m); -inf where no key is seen
            p = torch.exp(s - row_lse.nan_to_num(neginf=math.inf)[..., None])
            group = h // k.shape[1]
            ve = v[c:d].double().repeat_interleave(group, 1)
            out[a:b] = torch.einsum("hqk,khd->qhd", p, ve).to(q.dtype)
            lse[:, a:b] = torch.where(torch.isneginf(row_lse), math.inf, row_lse).to(lse_dtype)
        if self.padded_lse:
            padded = torch.zeros(len(blocks), h, max_q, dtype=lse_dtype)
            for i, (a, b, _, _) in enumerate(blocks):
                padded[i, :, :b - a] = lse[:, a:b]
            lse = padded
        return out, lse, None, None

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, rng, unused):
        blocks = _blocks(cu_q, cu_k)
        self.calls.append(("backward", len(blocks), causal, q.shape[0], k.shape[0]))
        h, hk = q.shape[1], k.shape[1]
        group = h // hk
        if self.padded_lse:
            assert lse.dim() == 3 and lse.shape == (len(blocks), h, max_q), lse.shape
            lse = torch.cat([lse[i, :, :b - a] for i, (a, b, _, _) in enumerate(blocks)], 1)
        assert lse.shape == (h, q.shape[0]) and lse.dtype in (torch.float32, torch.float64)
        dq = torch.zeros(q.shape, dtype=torch.float64)
        dk = torch.zeros(k.shape, dtype=torch.float64)
        dv = torch.zeros(v.shape, dtype=torch.float64)
        delta = (dout.double() * out.double()).sum(-1).t()  # (h, total_q), from out: as the op does
        for a, b, c, d in blocks:
            s = _scores(q[a:b], k[c:d], causal, scale)
            p = torch.exp(s - lse[:, a:b].double()[..., None])
            ke = k[c:d].double().repeat_interleave(group, 1)
            ve = v[c:d].double().repeat_interleave(group, 1)
            do = dout[a:b].double()
            dp = torch.einsum("qhd,khd->hqk", do, ve)
            ds = p * (dp - delta[:, a:b, None]) * scale
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ke)
            dk[c:d] = torch.einsum("hqk,qhd->khd", ds, q[a:b].double()).view(d - c, hk, group, -1).sum(2)
            dv[c:d] = torch.einsum("hqk,qhd->khd", p, do).view(d - c, hk, group, -1).sum(2)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def install(padded_lse: bool = False, setattr_=setattr) -> Emulation:
    """Put an :class:`Emulation` behind the flash varlen kernel (``setattr_``: ``monkeypatch.setattr`` in
    pytest, plain ``setattr`` in spawned workers) and make the backend selectable off CUDA, in every
    floating dtype (its declared capabilities widened to what the emulation takes)."""
    from dataclasses import replace

    from lightseq_hf.kernels.varlen import flash as flash_varlen

    emu = Emulation(padded_lse)
    caps = flash_varlen.FlashVarlenKernel.capabilities
    setattr_(flash_varlen.FlashVarlenKernel, "capabilities",
             replace(caps, devices=None, dtypes=caps.dtypes | {torch.float32, torch.float64}))
    setattr_(flash_varlen, "varlen_forward", emu.forward)
    setattr_(flash_varlen, "varlen_backward", emu.backward)
    setattr_(flash_varlen, "usable", lambda device: True)
    setattr_(flash_varlen, "_probed", {})
    flash_varlen.lse_is_padded(torch.device("cpu"))  # probe the layout now: later calls are the tests'
    emu.calls.clear()
    return emu


def distributed_check(rank: int, world: int) -> list[str]:
    """In a spawned gloo worker: ``dist_flash_attn(backend="flash_varlen")`` over packed rows (emulated op,
    float64) against the per-document reference, and one varlen call per scheduled task of this rank."""
    from doc_reference import packed_distributed_runs, random_docs

    from lightseq_hf.parallel.segment_schedule import build_segment_schedule

    emu = install()
    n_local = 16
    n = n_local * world
    gen = torch.Generator().manual_seed(90 + world)
    mixed = random_docs(gen, 2, n, max_len=20)
    padded = random_docs(gen, 1, n, pad_left=True, pad_right=True, max_len=11)[0]
    cases = [("random lengths", mixed, True), ("non-causal", mixed, False),
             ("padding + all-padding row", (padded, ()), True),
             ("one document", (((0, n),), ((1, n),)), True)]
    failures = []
    runs = packed_distributed_runs(rank, world, n_local, cases, backend="flash_varlen", seed=300,
                                   before_run=emu.calls.clear)
    for name, causal, seg, errors in runs:
        failures += [f"flash_varlen world {world} rank {rank} [{name}]: {label} err {err:.2e}"
                     for label, err in errors.items() if not err < 1e-10]
        mine = sum(step[rank] is not None for step in build_segment_schedule(world, seg, causal).steps)
        ops = [c[0] for c in emu.calls]
        if ops.count("forward") != mine or ops.count("backward") != mine:
            failures.append(f"flash_varlen world {world} rank {rank} [{name}]: {ops} for {mine} tasks")
    return failures
