"""The flash varlen path on the CPU: the per-task document blocks (exactly the key-range masks), and the
kernel's gather / merge / scatter / gradient accumulation around an emulation of torch's varlen ops,
against the reference kernel with key ranges; backend selection."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from distributed import rel_err
from doc_reference import per_document_attention, random_docs
from varlen_emulation import install

from lightseq_hf.kernels import (
    DeviceClass,
    KernelRequest,
    MaskKind,
    ReferenceKernel,
    get_kernel,
    select_backend,
)
from lightseq_hf.kernels.row_stats import merge_into
from lightseq_hf.kernels.varlen import flash as flash_varlen
from lightseq_hf.parallel.doc_blocks import doc_spans, task_doc_blocks
from lightseq_hf.parallel.schedule import SpanTask
from lightseq_hf.parallel.segment_schedule import build_segment_schedule
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range


def layouts(world):
    """Document layouts of ``batch`` 2 rows of ``12 * world`` tokens."""
    n = 12 * world
    gen = torch.Generator().manual_seed(world)
    yield "random lengths", random_docs(gen, 2, n, max_len=15)
    padded = random_docs(gen, 1, n, pad_left=True, pad_right=True, max_len=9)[0]
    yield "padding + all-padding row", (padded, ())
    yield "length-1 documents", (tuple((t, t + 1) for t in range(0, n, 2)), ((0, 1), (1, n)))
    yield "one document spanning all chunks", (((0, n),), ((2, n - 1),))


def expand(blocks, batch, q_len, kv_len, top_left=False):
    """The dense visibility ``(batch, q_len, kv_len)`` the blocks describe (each fed pair once)."""
    def indices(rows):
        return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows

    q_idx, k_idx = indices(blocks.q_rows), indices(blocks.k_rows)
    assert q_idx.numel() == blocks.total_q and k_idx.numel() == blocks.total_k
    assert q_idx.unique().numel() == q_idx.numel() and k_idx.unique().numel() == k_idx.numel()
    count = torch.zeros(batch * q_len, batch * kv_len, dtype=torch.int64)
    qa = ka = 0
    for m, n in zip(blocks.q_lens, blocks.k_lens):
        i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
        shift = 0 if top_left else n - m
        seen = (j <= i + shift) if blocks.causal else torch.ones(m, n, dtype=torch.bool)
        count[q_idx[qa:qa + m, None], k_idx[None, ka:ka + n]] += seen.long()
        qa, ka = qa + m, ka + n
    assert count.numel() == 0 or int(count.max()) <= 1
    full = count.view(batch, q_len, batch, kv_len).bool()
    rows = torch.arange(batch)
    same = full[rows, :, rows]
    assert int(full.sum()) == int(same.sum()), "a block crosses batch rows"
    return same


def test_doc_blocks_are_exactly_the_key_range_masks():
    tasks_checked = aligned_differs = slices = 0
    for world in (1, 2, 3, 4):
        for name, docs in layouts(world):
            seg = Segments(12 * world, docs)
            chunk, batch = 12, len(docs)
            for causal in (True, False):
                lo, hi = key_ranges(seg, causal=causal)
                sched = build_segment_schedule(world, seg, causal)
                tasks = [t for step in sched.steps for t in step if t is not None]
                # also every whole block (i, j), including ones that see nothing
                tasks += [SpanTask(i, j, 0, chunk, 0) for i in range(world) for j in range(world)]
                # and diagonal tasks starting inside documents (keys before their first row: the
                # bottom-right alignment matters)
                tasks += [SpanTask(i, i, a, b, 0, True) for i in range(world) for a, b in ((5, 12), (3, 9))]
                for task in tasks:
                    rows = slice(task.q_owner * chunk + task.row_start, task.q_owner * chunk + task.row_stop)
                    ka, kb = task.keys(chunk)  # schedule tasks read only the keys their rows see
                    klo, khi = local_key_range(lo[:, rows], hi[:, rows], task.kv_owner * chunk + ka, kb - ka)
                    cols = torch.arange(kb - ka)[None, None, :]
                    want = (cols >= klo[..., None].long()) & (cols < khi[..., None].long())
                    blocks = task_doc_blocks(seg, task, chunk, causal, "cpu")
                    got = expand(blocks, batch, task.row_stop - task.row_start, kb - ka)
                    assert torch.equal(got, want), f"world {world} [{name}] causal={causal} {task}"
                    if not causal or task.q_owner != task.kv_owner:
                        assert not blocks.causal  # non-causal, or keys before the queries: full blocks
                    top_left = expand(blocks, batch, task.row_stop - task.row_start, kb - ka, top_left=True)
                    if blocks.causal and not torch.equal(top_left, want):
                        aligned_differs += 1
                    slices += isinstance(blocks.q_rows, slice) and isinstance(blocks.k_rows, slice)
                    tasks_checked += 1
    assert tasks_checked > 300
    assert aligned_differs > 20  # a top-left causal alignment would have failed the check above
    assert slices > 50  # contiguous rows are fed as slices (no gathers)


def test_doc_blocks_of_a_diagonal_task_are_causal_and_cached():
    seg = Segments(16, (((0, 5), (5, 16)),))
    task = SpanTask(0, 0, 2, 8, 0, diagonal=True)
    blocks = task_doc_blocks(seg, task, 8, True, "cpu")
    assert blocks.causal and blocks.q_lens == (3, 3) and blocks.k_lens == (5, 3)
    assert blocks.q_rows == slice(0, 6) and blocks.k_rows == slice(0, 8)
    assert blocks.cu_q.tolist() == [0, 3, 6] and blocks.cu_k.tolist() == [0, 5, 8]
    assert blocks.cu_q.dtype == torch.int32 and (blocks.max_q, blocks.max_k) == (3, 5)
    assert task_doc_blocks(seg, task, 8, True, "cpu") is blocks
    # padding between documents: fed rows are gathered
    padded = task_doc_blocks(Segments(8, (((0, 3), (5, 8)),)), SpanTask(0, 0, 0, 8, 0), 8, True, "cpu")
    assert padded.q_rows.tolist() == [0, 1, 2, 5, 6, 7]


def test_mixed_causal_and_full_blocks_are_refused():
    # query rows [1, 6) against keys [0, 3) of one document: rows 1 and 2 need the causal rule, but the
    # keys end before the rows do, so FlashAttention's bottom-right alignment would be wrong (no schedule
    # makes such a task: keys are either the query chunk or a chunk before it)
    with pytest.raises(ValueError, match="cannot mix"):
        doc_spans(Segments(8, (((0, 6),),)), 1, 6, 0, 3, True)
    assert doc_spans(Segments(8, (((0, 6),),)), 4, 6, 0, 3, True)[1] is False  # all keys seen: fine


@pytest.mark.parametrize("padded_lse", [False, True])
def test_kernel_matches_the_reference_kernel_with_key_ranges(monkeypatch, padded_lse):
    emu = install(padded_lse, monkeypatch.setattr)
    kernel = flash_varlen.FlashVarlenKernel()
    ref = ReferenceKernel(block_q=8, block_k=8)
    world, chunk, h, hk, d = 3, 12, 4, 2, 8
    checked = fed_nothing = 0
    for name, docs in layouts(world):
        seg = Segments(world * chunk, docs)
        batch = len(docs)
        g = torch.Generator().manual_seed(len(name))
        q, dout = (torch.randn(batch, world * chunk, h, d, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(batch, world * chunk, hk, d, generator=g, dtype=torch.float64) for _ in "kv")
        lo, hi = key_ranges(seg, causal=True)
        sched = build_segment_schedule(world, seg, True)
        for task in (t for step in sched.steps for t in step if t is not None):
            rows = slice(task.q_owner * chunk + task.row_start, task.q_owner * chunk + task.row_stop)
            ka, kb = task.keys(chunk)
            keys = slice(task.kv_owner * chunk + ka, task.kv_owner * chunk + kb)
            rng = local_key_range(lo[:, rows], hi[:, rows], keys.start, kb - ka)
            blocks = task_doc_blocks(seg, task, chunk, True, "cpu")
            qt, dt, kt, vt = q[:, rows], dout[:, rows], k[:, keys], v[:, keys]
            fed_nothing += int((rng[1] <= rng[0]).sum())
            # plain call
            want = ref.forward(qt, kt, vt, causal=False, scale=0.3, key_range=rng)
            got = kernel.forward(qt, kt, vt, causal=False, scale=0.3, doc_blocks=blocks)
            assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12, (name, task)
            # merging into running buffers (views with a row offset, as the distributed loop passes them;
            # some rows hold nothing yet)
            base_out = torch.randn(batch, chunk + 2, h, d, generator=g, dtype=torch.float64)
            base_lse = torch.randn(batch, h, chunk + 2, generator=g, dtype=torch.float64)
            base_lse[:, :, ::3] = -math.inf
            base_out[:, ::3] = 0
            m = qt.shape[1]
            run_out, run_lse = base_out.clone(), base_lse.clone()
            ref_out, ref_lse = base_out[:, 1:1 + m].clone(), base_lse[:, :, 1:1 + m].clone()
            kernel.forward(qt, kt, vt, causal=False, scale=0.3, out=run_out[:, 1:1 + m],
                           lse=run_lse[:, :, 1:1 + m], doc_blocks=blocks)
            merge_into(ref_out, ref_lse, *want)
            assert rel_err(run_out[:, 1:1 + m], ref_out) < 1e-12
            assert rel_err(run_lse[:, :, 1:1 + m], ref_lse) < 1e-12
            assert torch.equal(run_out[:, 0], base_out[:, 0]) and torch.equal(run_lse[:, :, m + 1:],
                                                                                base_lse[:, :, m + 1:])
            # backward with the rows' global out/lse, accumulated into given float gradients
            g_out, g_lse = (x + 0.1 for x in want)  # any out/lse: the gradients follow them
            g_lse = torch.where(torch.isinf(want[1]), want[1], g_lse)
            want_grads = ref.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, key_range=rng)
            seeds = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in want_grads]
            dq_base = torch.zeros(batch, m + 3, h, d, dtype=torch.float64)
            dq_base[:, 2:2 + m] = seeds[0]
            dk, dv = seeds[1].clone(), seeds[2].clone()
            kernel.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, dq=dq_base[:, 2:2 + m],
                            dk=dk, dv=dv, doc_blocks=blocks)
            for x, s, w in zip((dq_base[:, 2:2 + m], dk, dv), seeds, want_grads):
                assert rel_err(x - s, w) < 1e-12, (name, task)
            assert not dq_base[:, :2].any() and not dq_base[:, 2 + m:].any()
            fresh = kernel.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, doc_blocks=blocks)
            for x, w in zip(fresh, want_grads):
                assert rel_err(x, w) < 1e-12
            checked += 1
    assert checked > 10 and fed_nothing > 0
    assert {c[0] for c in emu.calls} == {"forward", "backward"}
    assert any(c[1] > 1 and c[2] for c in emu.calls)  # several documents in one causal call


def test_kernel_without_blocks_is_plain_bottom_right_attention(monkeypatch):
    install(False, monkeypatch.setattr)
    kernel, ref = flash_varlen.FlashVarlenKernel(), ReferenceKernel(block_q=4, block_k=4)
    g = torch.Generator().manual_seed(0)
    for lq, lk, causal in ((6, 6, True), (4, 7, True), (7, 4, True), (5, 3, False)):
        q, dout = (torch.randn(2, lq, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, lk, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
        want = ref.forward(q, k, v, causal=causal, scale=0.5)
        got = kernel.forward(q, k, v, causal=causal, scale=0.5)
        assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12  # -inf rows stay -inf
        w_grads = ref.backward(dout, q, k, v, *want, causal=causal, scale=0.5)
        for x, w in zip(kernel.backward(dout, q, k, v, *got, causal=causal, scale=0.5), w_grads):
            assert rel_err(x, w) < 1e-12


def test_dist_flash_attn_on_one_process_takes_the_varlen_path(monkeypatch):
    emu = install(False, monkeypatch.setattr)
    n = 40
    docs = random_docs(torch.Generator().manual_seed(3), 2, n, pad_right=True, max_len=12)
    g = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = per_document_attention(qr, kr, vr, docs)
    ref_out.backward(dout)
    import lightseq_hf

    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    emu.calls.clear()
    out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=Segments(n, docs), backend="flash_varlen",
                                           return_lse=True)
    out.backward(dout)
    for x, r in ((out, ref_out), (lse, ref_lse), (qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)):
        assert rel_err(x, r) < 1e-10
    num_docs = sum(len(row) for row in docs)
    assert [c[:3] for c in emu.calls] == [("forward", num_docs, True), ("backward", num_docs, True)]
    with pytest.raises(ValueError, match="sliding windows"):
        lightseq_hf.dist_flash_attn(qs, ks, vs, segments=Segments(n, docs), window=4, backend="flash_varlen")
    with pytest.raises(ValueError, match="lse"):
        out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=Segments(n, docs), backend="flash_varlen",
                                               return_lse=True)
        lse.sum().backward()


#: compute capability 9.0 without nvidia-cudnn-frontend (H100, H200)
HOPPER = DeviceClass("cuda", (9, 0), 91900)


def _chosen(backend, device, dtype, head_dim, mask=MaskKind.DOCUMENTS):
    return select_backend(backend, KernelRequest(device, dtype, head_dim, head_dim, mask), device_class=HOPPER
                          if device.type == "cuda" else None)


def test_backend_selection_for_packed_rows(monkeypatch):
    cuda = torch.device("cuda")
    window = MaskKind.WINDOW
    assert _chosen("auto", torch.device("cpu"), torch.bfloat16, 64) == "reference"
    with pytest.raises(ValueError, match="CUDA GPU"):
        get_kernel("flash_varlen", torch.device("cpu"))
    with mock.patch.object(flash_varlen, "usable", return_value=True):
        # measured on this class: Triton for d128, flash_varlen for d64 and head dims Triton does not compile
        assert _chosen("auto", cuda, torch.bfloat16, 128) == "triton"
        assert _chosen("auto", cuda, torch.float16, 64) == "flash_varlen"
        assert _chosen("auto", cuda, torch.bfloat16, 256) == "flash_varlen"
        assert _chosen("auto", cuda, torch.bfloat16, 256, window) == "reference"
        assert _chosen("flash_varlen", cuda, torch.bfloat16, 128) == "flash_varlen"
        with pytest.raises(ValueError, match="sliding windows"):
            _chosen("flash_varlen", cuda, torch.bfloat16, 128, window)
        assert _chosen("auto", cuda, torch.bfloat16, 128, window) == "triton"  # windows: ranges
        assert _chosen("auto", cuda, torch.float32, 128) == "triton"  # half types only
        assert _chosen("auto", cuda, torch.bfloat16, 264) == "reference"  # beyond both
        assert _chosen("auto", cuda, torch.bfloat16, 128, MaskKind.CAUSAL) == "sdpa_cudnn"  # plain rows
    with mock.patch.object(flash_varlen, "usable", return_value=False):
        assert _chosen("auto", cuda, torch.bfloat16, 64) == "triton"  # op missing: Triton
        assert _chosen("auto", cuda, torch.bfloat16, 256) == "reference"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        flash_varlen.check_flash_inputs(torch.zeros(1, 1, 8))
