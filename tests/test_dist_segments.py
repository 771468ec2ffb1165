"""dist_flash_attn over packed documents, padding and sliding windows on 1-4 (and 8) gloo processes,
against a per-document float64 reference; plus the mechanism (what is sent, what is computed)."""

from __future__ import annotations

import pytest
import torch
from distributed import rel_err, run_distributed
from doc_reference import per_document_attention, random_docs


def doc_cases(world):
    """(name, docs per row, causal, window, dtype, api) for a full length of ``24 * world``."""
    n = 24 * world
    gen = torch.Generator().manual_seed(10 + world)
    mixed = random_docs(gen, 2, n, max_len=30)  # lengths 1..30: many cross shard boundaries
    padded = random_docs(gen, 2, n, pad_left=True, pad_right=True, max_len=20)
    yield "random lengths", mixed, True, None, torch.float32, "segments"
    yield "random lengths, non-causal", mixed, False, None, torch.float32, "segments"
    with_empty_row = (padded[0], (), padded[1])
    yield "left/right padding + all-padding row", with_empty_row, True, None, torch.float32, "segments"
    yield "one document spanning all ranks", (((0, n),), ((3, n - 2),)), True, None, torch.float32, "segments"
    yield "window", mixed, True, 5, torch.float32, "segments"
    yield "window on plain rows", (((0, n),),), True, 30, torch.float32, "window-only"
    yield "cu_seqlens", (mixed[0],), True, None, torch.float32, "cu_seqlens"
    yield "bf16 packed", mixed, True, None, torch.bfloat16, "segments"


def single_process(q, k, v, dout, docs, dtype, sl):
    """The reference kernel on the full rows in ``dtype`` (one process); this rank's rows."""
    from lightseq_hf.kernels import ReferenceKernel
    from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

    n = q.shape[1]
    rng = local_key_range(*key_ranges(Segments(n, docs), causal=True), 0, n)
    kernel = ReferenceKernel()
    qd, kd, vd, dd = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = kernel.forward(qd, kd, vd, causal=False, scale=16 ** -0.5, key_range=rng)
    dq, dk, dv = kernel.backward(dd, qd, kd, vd, out, lse, causal=False, scale=16 ** -0.5, key_range=rng)
    return out[:, sl], lse[:, :, sl], dq.to(dtype)[:, sl], dk.to(dtype)[:, sl], dv.to(dtype)[:, sl]


def worker_packed(rank, world):
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (the Triton case below)
    import lightseq_hf
    from lightseq_hf.parallel.segments import Segments

    failures = []
    n_local = 24
    for i, (name, docs, causal, window, dtype, api) in enumerate(doc_cases(world)):
        batch, n = len(docs), n_local * world
        g = torch.Generator().manual_seed(200 + i)
        q = torch.randn(batch, n, 4, 16, generator=g, dtype=torch.float64)
        k = torch.randn(batch, n, 2, 16, generator=g, dtype=torch.float64)
        v = torch.randn(batch, n, 2, 16, generator=g, dtype=torch.float64)
        dout = torch.randn(batch, n, 4, 16, generator=g, dtype=torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = per_document_attention(qr, kr, vr, docs, causal=causal, window=window)
        ref_out.backward(dout)
        sl = slice(rank * n_local, (rank + 1) * n_local)
        refs = (ref_out[:, sl], ref_lse[:, :, sl], qr.grad[:, sl], kr.grad[:, sl], vr.grad[:, sl])
        kwargs = dict(causal=causal, window=window, backend="reference")
        if api == "segments":
            kwargs["segments"] = Segments(n, docs)
        elif api == "cu_seqlens":
            cu = [0] + [stop for _, stop in docs[0]]
            kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)

        def run(dtype=dtype, kwargs=kwargs, sl=sl):
            qs, ks, vs = (t[:, sl].to(dtype).requires_grad_() for t in (q, k, v))
            out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, return_lse=True, **kwargs)
            out.backward(dout[:, sl].to(dtype))
            return out, lse, qs.grad, ks.grad, vs.grad

        got = run()
        if dtype == torch.float32:
            bounds = [2e-6] * 5
        else:  # at most twice the error of the local kernel on one process in bf16, same documents
            bounds = [2 * rel_err(x, r) + 1e-6 for x, r in zip(single_process(q, k, v, dout, docs, dtype, sl),
                                                                refs)]
        for label, x, ref, bound in zip(("out", "lse", "dq", "dk", "dv"), got, refs, bounds):
            err = rel_err(x, ref)
            if not err <= bound:
                failures.append(f"world {world} rank {rank} [{name}]: {label} err {err:.2e} > {bound:.1e}")
        padding = torch.ones(batch, n, dtype=torch.bool)
        for r, row in enumerate(docs):
            for start, stop in row:
                padding[r, start:stop] = False
        pad = padding[:, sl]
        if bool(pad.any()):
            if not (bool((got[0][pad] == 0).all()) and bool(torch.isneginf(got[1].transpose(1, 2)[pad]).all())
                    and bool((got[2][pad] == 0).all()) and bool((got[3][pad] == 0).all())):
                failures.append(f"[{name}] padding rows are not out 0 / lse -inf / zero gradients")
    failures += documents_send_only_what_they_see(rank, world)
    if world <= 4:
        from varlen_emulation import distributed_check

        failures += distributed_check(rank, world)  # the flash_varlen path (emulated op) in the loops
    if 2 <= world <= 3:
        from cudnn_fe_emulation import distributed_check as cudnn_fe_check

        failures += cudnn_fe_check(rank, world)  # the cudnn_fe path (emulated op) in the loops
    if world == 2:
        failures += disagreeing_segments(rank)
        failures += triton_interpreter_packed(rank, world)
    if world <= 2:
        failures += softcap_and_value_dim(rank, world)
        failures += nan_stays_in_its_document(rank, world)
    return failures


def documents_send_only_what_they_see(rank, world):
    """Mechanism: documents inside shards send nothing, one document across shards does, and a task moves
    only the keys its rows see."""
    import pytest

    import lightseq_hf
    from lightseq_hf.parallel import comm
    from lightseq_hf.parallel.segments import Segments

    failures, sent, shapes = [], [], []
    original_post = comm.PeerComm.post

    def counting_post(self, transfers):
        sent.extend(t.numel() for _, t in transfers.sends)
        shapes.extend(tuple(t.shape) for _, t in transfers.sends)
        return original_post(self, transfers)

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(comm.PeerComm, "post", counting_post)
        # documents inside shards (equal work per shard) send nothing, forward or backward
        docs = [(r * 24 + a, r * 24 + b) for r in range(world) for a, b in ((0, 10), (10, 24))]
        seg = Segments(24 * world, (tuple(docs),))
        x = torch.randn(1, 24, 2, 16, requires_grad=True)
        lightseq_hf.dist_flash_attn(x, x, x, segments=seg, backend="reference").sum().backward()
        if sent:
            failures.append(f"rank {rank}: documents inside shards still sent {len(sent)} tensors")
        # ... and one long document does send (the check above can fail)
        sent.clear()
        lightseq_hf.dist_flash_attn(x, x, x, segments=Segments.full(1, 24 * world), window=40,
                                    backend="reference").sum().backward()
        if world > 1 and not sent:
            failures.append(f"rank {rank}: a document across shards sent nothing")
        # ... and a task moves only the keys its rows see: with a window of 8, a few keys of a neighbour's
        # chunk (and their gradients), never the whole chunk (key/value tensors have 2 heads, queries 4)
        shapes.clear()
        qw = torch.randn(1, 24, 4, 16, requires_grad=True)
        kw, vw = (torch.randn(1, 24, 2, 16, requires_grad=True) for _ in "kv")
        lightseq_hf.dist_flash_attn(qw, kw, vw, segments=Segments.full(1, 24 * world), window=8,
                                    backend="reference").sum().backward()
    kv_sent = [s[1] for s in shapes if len(s) == 4 and s[2] == 2]
    if world > 1 and not (kv_sent and max(kv_sent) < 24):
        failures.append(f"rank {rank}: key/value rows sent {kv_sent}, expected parts of a chunk of 24")
    return failures


def _compare(tag, got, refs, tol=1e-10):
    failures = []
    for label, x, ref in zip(("out", "lse", "dq", "dk", "dv"), got, refs):
        err = rel_err(x, ref)
        if not err <= tol:
            failures.append(f"{tag}: {label} rel err {err:.2e}")
    return failures


def softcap_and_value_dim(rank, world):
    """Logit soft-capping (packed rows, plain rows, a window) and a value head dim of its own, on the
    reference backend ``auto`` picks for them, against per-document float64 attention; a backend without
    softcap is refused by name on every rank before any transfer."""
    import lightseq_hf
    from lightseq_hf.parallel.segments import Segments

    n_local = 24
    n = n_local * world
    docs = random_docs(torch.Generator().manual_seed(5), 2, n, pad_right=True, max_len=15)
    cases = [("softcap, packed", docs, None, 2.5, 16), ("softcap, plain rows", None, None, 1.5, 16),
             ("softcap, window", docs, 6, 2.5, 16), ("value dim 8, packed", docs, None, None, 8),
             ("value dim 8, plain rows", None, None, None, 8)]
    failures = []
    sl = slice(rank * n_local, (rank + 1) * n_local)
    for i, (tag, rows, window, softcap, dv) in enumerate(cases):
        g = torch.Generator().manual_seed(400 + i)
        q, k, v, dout = (torch.randn(*shape, generator=g, dtype=torch.float64)
                         for shape in ((2, n, 4, 16), (2, n, 2, 16), (2, n, 2, dv), (2, n, 4, dv)))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        whole = rows if rows is not None else (((0, n),), ((0, n),))
        ref_out, ref_lse = per_document_attention(*leaves, whole, window=window, scale=0.5, softcap=softcap)
        ref_out.backward(dout)
        mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
        out, lse = lightseq_hf.dist_flash_attn(*mine, segments=None if rows is None else Segments(n, rows),
                                               window=window, softcap=softcap, softmax_scale=0.5,
                                               return_lse=True)
        out.backward(dout[:, sl])
        refs = (ref_out[:, sl], ref_lse[:, :, sl], *(t.grad[:, sl] for t in leaves))
        failures += _compare(f"{tag} rank {rank}", (out, lse, *(t.grad for t in mine)), refs)
    try:
        x = torch.randn(1, n_local, 2, 64)
        lightseq_hf.dist_flash_attn(x, x, x, softcap=3.0, backend="triton")
        failures.append(f"rank {rank}: softcap on the triton backend was accepted")
    except ValueError as e:
        if "does not take logit soft-capping" not in str(e):
            failures.append(f"rank {rank}: unhelpful softcap refusal: {e}")
    return failures


def nan_stays_in_its_document(rank, world):
    """A NaN in one document's values, and in a padding token's q/k/v/dout, reaches no other document: their
    outputs and gradients equal those of the clean inputs, padding stays out 0 / lse -inf / gradient 0, and
    the poisoned document's rows that see the NaN are NaN (the reference kernel, ``auto`` on the CPU)."""
    import math

    import lightseq_hf
    from lightseq_hf.parallel.segments import Segments

    n_local = 24
    n = n_local * world
    docs = (((0, 10), (10, n - 8), (n - 8, n - 4)), ((2, n - 6),))  # (10, n - 8) crosses every shard
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(2, n, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    poisoned = [t.clone() for t in (q, k, v, dout)]
    poisoned[2][0, 12] = math.nan  # a value of document (10, n - 8)
    for t in poisoned:
        t[0, n - 2] = math.nan  # a right-padding token: q, k, v and dout
    poisoned[0][1, 0] = math.nan  # a left-padding query of row 1
    sl = slice(rank * n_local, (rank + 1) * n_local)

    def run(q, k, v, dout):
        mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
        out, lse = lightseq_hf.dist_flash_attn(*mine, segments=Segments(n, docs), return_lse=True)
        out.backward(dout[:, sl])
        return [out.detach(), lse.detach().transpose(1, 2), *(t.grad for t in mine)]

    clean, dirty = run(q, k, v, dout), run(*poisoned)
    inside = torch.zeros(2, n, dtype=torch.bool)
    inside[0, 10:n - 8] = True
    inside = inside[:, sl]
    failures = []
    for label, c, d in zip(("out", "lse", "dq", "dk", "dv"), clean, dirty):
        if not torch.equal(c[~inside], d[~inside]):
            failures.append(f"NaN containment rank {rank}: {label} of other documents or padding changed")
    sees = torch.zeros(2, n, dtype=torch.bool)
    sees[0, 12:n - 8] = True
    if not bool(torch.isnan(dirty[0][sees[:, sl]]).all()):
        failures.append(f"NaN containment rank {rank}: rows that see the NaN value are not NaN")
    return failures


def triton_interpreter_packed(rank, world):
    """The Triton kernels (CPU interpreter, fp32) in the distributed loop with packed documents."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return []
    import lightseq_hf
    from lightseq_hf.parallel.segments import Segments

    n_local, n = 32, 32 * world
    docs = (((0, 5), (5, 6), (6, 45), (45, n - 3)), ((0, n),))
    g = torch.Generator().manual_seed(77)
    q, dout = (torch.randn(2, n, 4, 64, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = per_document_attention(qr, kr, vr, docs, window=20)
    ref_out.backward(dout)
    sl = slice(rank * n_local, (rank + 1) * n_local)
    qs, ks, vs = (t[:, sl].float().requires_grad_() for t in (q, k, v))
    out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=Segments(n, docs), window=20,
                                           backend="triton", return_lse=True)
    out.backward(dout[:, sl].float())
    failures = []
    refs = (ref_out[:, sl], ref_lse[:, :, sl], qr.grad[:, sl], kr.grad[:, sl], vr.grad[:, sl])
    for label, x, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, qs.grad, ks.grad, vs.grad), refs):
        err = rel_err(x, ref)
        if not err <= 1e-4:
            failures.append(f"triton packed rank {rank}: {label} rel err {err:.2e}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_exact_against_per_document_float64(world):
    failures = [f for fs in run_distributed(worker_packed, world) for f in fs]
    assert not failures, "\n".join(failures[:20])


def test_packed_exact_on_eight_processes():
    failures = [f for fs in run_distributed(worker_packed, 8) for f in fs]
    assert not failures, "\n".join(failures[:20])


def disagreeing_segments(rank):
    """Ranks passing different segments fail together with a clear error (no hang, no wrong answer)."""
    import lightseq_hf
    from lightseq_hf.parallel.segments import Segments

    x = torch.randn(1, 8, 2, 16)
    seg = Segments(16, (((0, 8 + rank), (8 + rank, 16)),))  # each rank has its own idea of the documents
    try:
        lightseq_hf.dist_flash_attn(x, x, x, segments=seg)
        return [f"rank {rank}: disagreeing segments accepted"]
    except ValueError as e:
        return [] if "same segments" in str(e) else [f"unhelpful: {e}"]

