"""Test-only float64 attention computed one document at a time (no masks shared with the code)."""

from __future__ import annotations

import math

import torch


def attend(q, k, v, causal, window, scale, softcap=None):
    """Materialized float64 attention of one document ``(len, heads, dim)``; returns (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    hidden = torch.zeros(n, n, dtype=torch.bool)
    if causal:
        hidden |= j > i
    if window is not None:
        hidden |= i - j >= window
        if not causal:
            hidden |= j - i >= window
    s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v), lse


def per_document_attention(q, k, v, docs, *, causal=True, window=None, scale=None, softcap=None):
    """Attention of each document of ``docs`` (per batch row, ``[start, stop)`` lists) on its own.

    Padding tokens (in no document) get out 0 and lse -inf. Differentiable (float64).
    """
    q, k, v = q.double(), k.double(), v.double()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    b, n, h, d = *q.shape[:3], v.shape[-1]
    rows_out, rows_lse = [], []
    for r in range(b):
        outs, lses, t = [], [], 0
        for start, stop in (*docs[r], (n, n)):
            if start > t:  # padding
                outs.append(torch.zeros(start - t, h, d, dtype=torch.float64))
                lses.append(torch.full((h, start - t), -math.inf, dtype=torch.float64))
            if stop > start:
                o, s = attend(q[r, start:stop], k[r, start:stop], v[r, start:stop], causal, window, scale,
                              softcap)
                outs.append(o)
                lses.append(s)
            t = stop
        rows_out.append(torch.cat(outs, 0))
        rows_lse.append(torch.cat(lses, 1))
    return torch.stack(rows_out), torch.stack(rows_lse)


def random_docs(gen, batch, length, *, pad_left=False, pad_right=False, min_len=1, max_len=None):
    """Random documents per row (lengths 1..max_len, some length 1), optionally with padding."""
    rows = []
    for _ in range(batch):
        left = int(torch.randint(0, length // 4 + 1, (1,), generator=gen)) if pad_left else 0
        right = int(torch.randint(0, length // 4 + 1, (1,), generator=gen)) if pad_right else 0
        t, docs = left, []
        cap = max_len or length
        while t < length - right:
            size = int(torch.randint(min_len, cap + 1, (1,), generator=gen))
            if torch.rand(1, generator=gen).item() < 0.2:
                size = 1
            stop = min(t + size, length - right)
            docs.append((t, stop))
            t = stop
        rows.append(tuple(docs))
    return tuple(rows)


def packed_distributed_runs(rank, world, n_local, cases, *, backend, seed, before_run=None, adjust=None):
    """In a spawned worker: for each ``(name, docs, causal)`` of ``cases``, ``dist_flash_attn`` over this
    rank's packed rows (float64, 4/2 heads of dim 8) against :func:`per_document_attention`. Yields ``(name,
    causal, segments, errors)``, ``errors`` the relative error of out, lse, dq, dk and dv, after the run
    (``before_run()`` comes before it; ``adjust(name, q, k)`` may change the inputs first)."""
    from distributed import rel_err

    import lightseq_hf
    from lightseq_hf.parallel.segments import Segments

    n = n_local * world
    sl = slice(rank * n_local, (rank + 1) * n_local)
    for i, (name, docs, causal) in enumerate(cases):
        g = torch.Generator().manual_seed(seed + i)
        batch = len(docs)
        q, dout = (torch.randn(batch, n, 4, 8, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(batch, n, 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
        if adjust is not None:
            adjust(name, q, k)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = per_document_attention(qr, kr, vr, docs, causal=causal)
        ref_out.backward(dout)
        refs = (ref_out[:, sl], ref_lse[:, :, sl], qr.grad[:, sl], kr.grad[:, sl], vr.grad[:, sl])
        qs, ks, vs = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
        seg = Segments(n, docs)
        if before_run is not None:
            before_run()
        out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=seg, causal=causal, backend=backend,
                                               return_lse=True)
        out.backward(dout[:, sl])
        got = (out, lse, qs.grad, ks.grad, vs.grad)
        yield name, causal, seg, {label: rel_err(x, ref) for label, x, ref in
                                  zip(("out", "lse", "dq", "dk", "dv"), got, refs)}
