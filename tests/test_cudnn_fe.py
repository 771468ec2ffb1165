"""The cudnn_fe backend on the CPU, around an emulation of the nvidia-cudnn-frontend ops (float64): the call
layout the op receives, the lse layouts, rows without keys, the backward parts that avoid key lengths 64 mod
128, graph-shape bucketing on a changing packed stream, the global-statistics backward against the
reference kernel with key ranges, and every refusal. The distributed loops run it in
``tests/test_dist_segments.py``; the contract in ``tests/test_kernel_contract.py``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from cudnn_fe_emulation import install
from distributed import rel_err
from doc_reference import random_docs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightseq_hf._testing import kernel_knobs
from lightseq_hf.kernels import (
    AttentionMask,
    DeviceClass,
    KernelRequest,
    MaskKind,
    ReferenceKernel,
    select_backend,
)
from lightseq_hf.kernels.varlen import cudnn as cudnn_fe
from lightseq_hf.kernels.varlen import flash as flash_varlen
from lightseq_hf.kernels.varlen.cudnn import (
    GraphShape,
    GraphShapes,
    backward_tokens,
    bucket,
    key_length_hazard,
)
from lightseq_hf.kernels.varlen.rows import aligned_calls, backward_plan, fed_blocks, make_doc_blocks
from lightseq_hf.parallel.doc_blocks import task_doc_blocks
from lightseq_hf.parallel.schedule import SpanTask
from lightseq_hf.parallel.segment_schedule import build_segment_schedule
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

ROOT = Path(__file__).resolve().parents[1]


def pair_counts(calls, batch, q_len, kv_len):
    """How many times each (query row, key) pair of ``(batch, q_len, kv_len)`` is computed by ``calls``
    (blocks aligned bottom-right when causal; rows may be fed to several blocks)."""
    def indices(rows, total):
        return torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows.cpu()

    count = torch.zeros(batch * q_len, batch * kv_len, dtype=torch.int64)
    for blocks in calls:
        q_idx, k_idx = indices(blocks.q_rows, blocks.total_q), indices(blocks.k_rows, blocks.total_k)
        assert q_idx.numel() == blocks.total_q and k_idx.numel() == blocks.total_k
        qa = ka = 0
        for m, n in zip(blocks.q_lens, blocks.k_lens):
            i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
            seen = (j <= i + n - m) if blocks.causal else torch.ones(m, n, dtype=torch.bool)
            count.index_put_((q_idx[qa:qa + m, None].expand(m, n), k_idx[None, ka:ka + n].expand(m, n)),
                             seen.long(), accumulate=True)
            qa, ka = qa + m, ka + n
    return count


def test_rows_that_see_no_key_are_not_fed():
    # causal blocks 5 x 3 (the first 2 rows see nothing), 2 x 2, 3 x 6; rows gathered out of order
    rows = [9, 1, 2, 3, 4, 0, 5, 6, 7, 8]
    blocks = make_doc_blocks((5, 2, 3), (3, 2, 6), rows, list(range(11)), True, "cpu")
    fed = fed_blocks(blocks)
    assert fed.q_lens == (3, 2, 3) and fed.k_lens == (3, 2, 6) and fed.causal
    assert fed.q_rows.tolist() == [2, 3, 4, 0, 5, 6, 7, 8]
    assert torch.equal(pair_counts([fed], 1, 10, 11), pair_counts([blocks], 1, 10, 11))
    assert fed_blocks(blocks) is fed  # planned once per layout
    square = make_doc_blocks((4, 4), (4, 6), slice(0, 8), slice(0, 10), True, "cpu")
    assert fed_blocks(square) is square


@pytest.mark.parametrize("causal", [True, False])
def test_backward_plan_avoids_key_lengths_64_mod_128_and_covers_each_pair_once(causal):
    """Blocks with such key lengths go to the op without their first key (one call, as many blocks as the
    forward's); the first key's pairs with every row of the block come back to be computed directly."""
    sizes = [(64, 64), (1, 64), (63, 64), (128, 192), (64, 192), (65, 192), (130, 320), (3, 5), (200, 200),
             (192, 192), (256, 320)]
    if not causal:
        sizes += [(300, 64), (7, 192)]
    q_lens, k_lens = zip(*sizes)
    tq, tk = sum(q_lens), sum(k_lens)
    gen = torch.Generator().manual_seed(1)
    q_rows = torch.randperm(tq + 5, generator=gen)[:tq].tolist()  # gathered rows, out of order
    blocks = make_doc_blocks(q_lens, k_lens, q_rows, slice(2, 2 + tk), causal, "cpu")
    assert backward_plan(blocks, avoid_hazard=False) == (blocks, None)
    call, pairs = backward_plan(blocks, avoid_hazard=True)
    assert call.causal == causal and call.num_blocks == blocks.num_blocks
    assert not any(n % 128 == 64 for n in call.k_lens)
    counts = pair_counts([call], 1, tq + 5, tk + 2)
    counts.index_put_((pairs.q_rows, pairs.k_rows), torch.ones_like(pairs.q_rows), accumulate=True)
    assert torch.equal(counts, pair_counts([blocks], 1, tq + 5, tk + 2))
    assert pairs.q_rows.numel() == sum(m for m, n in sizes if n % 128 == 64)
    assert backward_plan(blocks, avoid_hazard=True)[0] is call  # planned once per layout
    clean = make_doc_blocks((3, 200), (5, 200), slice(0, 203), slice(0, 205), causal, "cpu")
    assert backward_plan(clean, avoid_hazard=True) == (clean, None)
    assert key_length_hazard(91900) and key_length_hazard(92500) and not key_length_hazard(92600)


def test_graph_shapes_bucket_and_reuse():
    assert [bucket(n) for n in (0, 1, 3, 4, 5)] == [1, 1, 4, 4, 8]
    assert bucket(100, 128) == 128 and bucket(129, 128) == 256
    blocks = make_doc_blocks((3, 200, 1), (5, 300, 1), slice(0, 204), slice(0, 306), True, "cpu")
    assert GraphShape.bucketed(blocks) == GraphShape(4, 512)
    assert GraphShape.bucketed(blocks, (256, 512)) == GraphShape(4, 512, 256, 512)
    # a side's backward rows: the bucket where the tensor's storage reaches it from the first fed row, the
    # tensor's own rows when all are fed and they are a run's local length, else the bucket (copied); with
    # the counts a built graph may have
    assert backward_tokens(slice(0, 204), 204, 204, 300) == (256, (204, 300))
    assert backward_tokens(slice(50, 254), 204, 254, 306) == (256, (204, 256))
    assert backward_tokens(slice(0, 3072), 3072, 3072, 3072) == (3072, (3072, 3072))
    assert backward_tokens(slice(0, 204), 204, 204, 204) == (256, (256, 512))
    assert backward_tokens(slice(100, 304), 204, 304, 304) == (256, (256, 512))
    assert backward_tokens(torch.arange(5), 5, 100, 100) == (128, (128, 256))
    shapes = GraphShapes()
    big = GraphShape(8, 1024, 2048, 2048)
    assert shapes.choose("k", big) == big
    spans = ((1000, 4096), (1024, 2048))
    assert shapes.choose("k", GraphShape(4, 512, 1024, 1024), spans) == big  # grid 4x, rows in the spans
    assert shapes.choose("k", GraphShape(4, 256, 1024, 1024), spans) == GraphShape(4, 256, 1024, 1024)  # 8x
    small = GraphShape(8, 1024, 512, 512)
    assert shapes.choose("k", small, ((512, 1024), (512, 4096))) == small  # 2048 query rows: outside
    assert shapes.choose("k", small) == small  # no spans: the rows as asked
    assert shapes.choose("other", GraphShape(4, 512, 1024, 1024), spans) == GraphShape(4, 512, 1024, 1024)
    assert len(shapes) == 4
    for i in range(40):
        shapes.choose("k", GraphShape(1, 128 * (i + 1)))
    assert len(shapes) == 24 + 1  # the least recently chosen shapes are forgotten


def _stream_layouts(steps: int, seq: int):
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib.workloads import lognormal_docs

    for step in range(steps):
        yield Segments(seq, (lognormal_docs(seq, median=2048, sigma=1.0, max_len=32768, seed=7000 + step),))


def test_graph_shapes_stay_few_on_a_changing_packed_stream():
    """40 steps of 32K-token rows of log-normal documents on a 2-rank ring: every task's calls (forward,
    backward parts) through the backend's planning, its tensors as the ring holds them (a rank's own rows
    and keys views of its chunk, another rank's received as they are). Each rank asks for few shapes,
    almost none after the first steps, where the exact shapes the op would otherwise key on are new at
    every step."""
    world, seq, steps = 2, 32768, 40
    chunk = seq // world
    shapes = [GraphShapes() for _ in range(world)]
    exact: list[set] = [set() for _ in range(world)]
    late_new, late_exact = [0] * world, [0] * world
    for step, seg in enumerate(_stream_layouts(steps, seq)):
        sched = build_segment_schedule(world, seg, True)
        for tasks in sched.steps:
            for rank, task in enumerate(tasks):
                if task is None:
                    continue
                key_a, key_b = task.keys(chunk)
                rows, keys = task.row_stop - task.row_start, key_b - key_a
                room_q = chunk - task.row_start if task.q_owner == rank else rows
                room_k = chunk - key_a if task.kv_owner == rank else keys
                for aligned in aligned_calls(fed_blocks(task_doc_blocks(seg, task, chunk, True, "cpu"))):
                    for kind, call in (("f", aligned), ("b", backward_plan(aligned, True)[0])):
                        before = len(shapes[rank])
                        need, spans = GraphShape.bucketed(call), None
                        if kind == "b":
                            (tq, sq), (tk, sk) = (backward_tokens(call.q_rows, call.total_q, rows, room_q),
                                                  backward_tokens(call.k_rows, call.total_k, keys, room_k))
                            need, spans = GraphShape.bucketed(call, (tq, tk)), (sq, sk)
                        shapes[rank].choose((kind, call.causal), need, spans)
                        key = (kind, call.causal, call.num_blocks, call.max_q, call.max_k, call.total_q,
                               call.total_k)
                        if step >= steps // 2:
                            late_new[rank] += len(shapes[rank]) > before
                            late_exact[rank] += key not in exact[rank]
                        exact[rank].add(key)
    for rank in range(world):
        assert len(shapes[rank]) <= 48  # well inside the op's 128 cached graphs
        assert late_new[rank] <= steps // 4, late_new  # at most one build every other step, late on
        assert late_exact[rank] >= steps, late_exact  # unbucketed, every step would build


def doc_layouts(world: int, chunk: int):
    n = world * chunk
    gen = torch.Generator().manual_seed(world)
    yield "random lengths", random_docs(gen, 2, n, max_len=40)
    padded = random_docs(gen, 1, n, pad_left=True, pad_right=True, max_len=30)[0]
    yield "padding + all-padding row", (padded, ())
    yield "length-1 documents", (tuple((t, t + 1) for t in range(0, n, 2)), ((0, 1), (1, n)))
    yield "key lengths 64 mod 128", (((0, 64), (64, 70), (70, 262), (262, n)),)


@pytest.mark.parametrize("version", [91900, 92700])
def test_kernel_matches_the_reference_kernel_with_key_ranges(monkeypatch, version):
    """Every task of the segment schedule: plain calls, merging into running buffers, and the backward from
    the rows' global out/lse added into given gradients; with the emulated NaN-dQ defect on the cuDNN that
    has it (the backward parts avoid it) and scores low enough that every lse is below -88.7."""
    emu = install(monkeypatch.setattr, cudnn_version=version, nan_dq_hazard=version < 92600)
    kernel, ref = cudnn_fe.CudnnFeKernel(), ReferenceKernel(block_q=16, block_k=16)
    world, chunk, h, hk, d = 3, 96, 4, 2, 8
    checked = 0
    for name, docs in doc_layouts(world, chunk):
        if version >= 92600 and "64 mod 128" not in name:
            continue
        seg, batch = Segments(world * chunk, docs), len(docs)
        g = torch.Generator().manual_seed(len(name))
        q, dout = (torch.randn(batch, world * chunk, h, d, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(batch, world * chunk, hk, d, generator=g, dtype=torch.float64) for _ in "kv")
        if "64 mod 128" in name:
            q[..., 0], k[..., 0] = -40.0, 40.0
        lo, hi = key_ranges(seg, causal=True)
        for task in (t for step in build_segment_schedule(world, seg, True).steps for t in step if t):
            rows = slice(task.q_owner * chunk + task.row_start, task.q_owner * chunk + task.row_stop)
            ka, kb = task.keys(chunk)
            keys = slice(task.kv_owner * chunk + ka, task.kv_owner * chunk + kb)
            rng = local_key_range(lo[:, rows], hi[:, rows], keys.start, kb - ka)
            blocks = task_doc_blocks(seg, task, chunk, True, "cpu")
            qt, dt, kt, vt = q[:, rows], dout[:, rows], k[:, keys], v[:, keys]
            want = ref.forward(qt, kt, vt, causal=False, scale=0.3, key_range=rng)
            got = kernel.forward(qt, kt, vt, causal=False, scale=0.3, doc_blocks=blocks)
            assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12, (name, task)
            m = qt.shape[1]
            base_out = torch.randn(batch, m + 2, h, d, generator=g, dtype=torch.float64)
            base_lse = torch.randn(batch, h, m + 2, generator=g, dtype=torch.float64)
            base_lse[:, :, ::3], base_out[:, ::3] = -math.inf, 0
            run_out, run_lse = base_out.clone(), base_lse.clone()
            ref_out, ref_lse = base_out[:, 1:1 + m].clone(), base_lse[:, :, 1:1 + m].clone()
            kernel.forward(qt, kt, vt, causal=False, scale=0.3, out=run_out[:, 1:1 + m],
                           lse=run_lse[:, :, 1:1 + m], doc_blocks=blocks)
            from lightseq_hf.kernels.row_stats import merge_into

            merge_into(ref_out, ref_lse, *want)
            assert rel_err(run_out[:, 1:1 + m], ref_out) < 1e-12 and rel_err(run_lse[:, :, 1:1 + m],
                                                                                ref_lse) < 1e-12
            assert torch.equal(run_out[:, 0], base_out[:, 0])
            g_out, g_lse = want[0] + 0.1, torch.where(torch.isinf(want[1]), want[1], want[1] + 0.1)
            want_grads = ref.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, key_range=rng)
            seeds = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in want_grads]
            given = [s.clone() for s in seeds]
            kernel.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, dq=given[0], dk=given[1],
                            dv=given[2], doc_blocks=blocks)
            for x, s, w in zip(given, seeds, want_grads):
                assert rel_err(x - s, w) < 1e-10, (name, task)
            checked += 1
    assert checked > (20 if version < 92600 else 3)
    backward_keys = [n for c in emu.calls if c["op"] == "backward" for n in c["k_lens"]]
    assert any(n % 128 == 64 for n in backward_keys) == (version >= 92600)


def test_the_emulated_defect_is_real_without_the_parts(monkeypatch):
    """The check above can fail: on the emulated defect, a backward asked for a key length of 64 gives NaN."""
    install(monkeypatch.setattr, nan_dq_hazard=True)
    q, k, v, dout = (torch.randn(1, 64, 2, 8, dtype=torch.float64) for _ in range(4))
    q[..., 0], k[..., 0] = -40.0, 40.0
    kernel = cudnn_fe.CudnnFeKernel()
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    assert (lse < -88.7).all()
    assert torch.isfinite(kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)[0]).all()
    monkeypatch.setattr(cudnn_fe, "key_length_hazard", lambda version: False)
    assert torch.isnan(kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)[0]).any()


def test_the_call_layout_the_op_receives(monkeypatch):
    """A diagonal task whose rows start inside their documents, GQA 4/2: per-task cu_seqlens on the query and
    key sides, causal blocks square with the op's default (top-left) alignment and the keys before the first
    row in an unmasked second call, key/value heads as they are, sequences padded to a bucket with empty
    ones, one longest length for both sides; the backward's tensors padded to a token bucket."""
    emu = install(monkeypatch.setattr)
    seg = Segments(64, (((0, 10), (10, 40), (40, 44), (44, 64)),))
    task = SpanTask(0, 0, 20, 50, 0, diagonal=True)  # rows 20..49 of a 64-token chunk
    blocks = task_doc_blocks(seg, task, 64, True, "cpu")
    assert blocks.q_lens == (20, 4, 6) and blocks.k_lens == (30, 4, 6)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 30, 4, 16, generator=g, dtype=torch.float64) for _ in "qd")
    k, v = (torch.randn(1, 50, 2, 16, generator=g, dtype=torch.float64) for _ in "kv")
    kernel = cudnn_fe.CudnnFeKernel()
    out, lse = kernel.forward(q, k[:, :50], v[:, :50], causal=False, scale=0.25, doc_blocks=blocks)
    kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.25, doc_blocks=blocks)
    fwd, fwd_prefix, bwd, bwd_prefix = emu.calls
    assert fwd["q_lens"] == (20, 4, 6, 0) and fwd["k_lens"] == (20, 4, 6, 0)  # 3 documents padded to 4
    assert fwd["causal"] and not fwd["bottom_right"] and fwd["max_q"] == fwd["max_k"] == 128
    assert (fwd["heads"], fwd["kv_heads"]) == (4, 2) and (fwd["rows"], fwd["keys"]) == (30, 30)
    assert fwd_prefix["q_lens"] == (20,) and fwd_prefix["k_lens"] == (10,) and not fwd_prefix["causal"]
    assert bwd["q_lens"] == fwd["q_lens"] and bwd["k_lens"] == fwd["k_lens"] and not bwd["bottom_right"]
    assert (bwd["rows"], bwd["keys"]) == (128, 128)  # the token bucket, query and key sides alike
    assert bwd_prefix["q_lens"] == (20,) and bwd_prefix["k_lens"] == (10,)
    assert cudnn_fe.graph_stats() == {"graphs": 4, "shapes": 4}
    # the same layout again, and another one with the same buckets: no new graph
    other = task_doc_blocks(seg, SpanTask(0, 0, 0, 40, 0, diagonal=True), 64, True, "cpu")
    for b in (blocks, other):
        qq = q if b is blocks else torch.randn(1, 40, 4, 16, dtype=torch.float64)
        o, s = kernel.forward(qq, k, v, causal=False, scale=0.25, doc_blocks=b)
        kernel.backward(torch.ones_like(qq), qq, k, v, o, s, causal=False, scale=0.25, doc_blocks=b)
    assert emu.builds == 4 and cudnn_fe.graph_stats()["graphs"] == 4


def test_plain_rows_and_more_queries_than_keys(monkeypatch):
    emu = install(monkeypatch.setattr)
    kernel, ref = cudnn_fe.CudnnFeKernel(), ReferenceKernel(block_q=4, block_k=4)
    g = torch.Generator().manual_seed(0)
    for lq, lk, causal in ((6, 6, True), (4, 7, True), (7, 4, True), (5, 3, False)):
        q, dout = (torch.randn(2, lq, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, lk, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
        want = ref.forward(q, k, v, causal=causal, scale=0.5)
        emu.calls.clear()
        got = kernel.forward(q, k, v, causal=causal, scale=0.5)
        assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12  # -inf rows stay -inf
        for x, w in zip(kernel.backward(dout, q, k, v, *got, causal=causal, scale=0.5),
                        ref.backward(dout, q, k, v, *want, causal=causal, scale=0.5)):
            assert rel_err(x, w) < 1e-12
        fed = [(c["q_lens"][:2], c["k_lens"][:2], c["causal"]) for c in emu.calls]
        if not causal:
            assert fed == [((lq, lq), (lk, lk), False)] * 2
        elif lq >= lk:  # rows without keys not fed: square blocks
            assert fed == [((lk, lk), (lk, lk), True)] * 2
        else:  # rows starting inside the row's keys: the square causal part, then the keys before it
            assert fed == [((lq, lq), (lq, lq), True), ((lq, lq), (lk - lq,) * 2, False)] * 2
        assert not any(c["bottom_right"] for c in emu.calls)


def test_refusals_name_the_problem_in_one_line(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    docs = KernelRequest(cuda, torch.bfloat16, 128, 128, MaskKind.DOCUMENTS)
    monkeypatch.setattr(flash_varlen, "usable", lambda device: False)  # no probe on this CPU build
    with kernel_knobs.cudnn_fe_unloaded(), \
            mock.patch.object(cudnn_fe, "load_ops", side_effect=ModuleNotFoundError("no", name="cudnn")):
        with pytest.raises(ValueError, match=r"^backend 'cudnn_fe' needs the nvidia-cudnn-frontend package "
                                             r"\(pip install 'lightseq_hf\[cudnn\]'\), which is not "
                                             r"installed; use backend="):
            select_backend("cudnn_fe", docs)
        with pytest.raises(ValueError, match=r"^backend 'cudnn_fe' needs a CUDA GPU; tensors are on cpu"):
            select_backend("cudnn_fe", KernelRequest(cpu, torch.bfloat16, 64, 64, MaskKind.DOCUMENTS))
    monkeypatch.setattr(cudnn_fe, "unavailable_reason", lambda: None)
    half = torch.bfloat16
    for request, words in ((KernelRequest(cuda, torch.float32, 128, 128), "takes bfloat16, float16"),
                           (KernelRequest(cuda, half, 256, 256), "head dims multiples of 8 up to 128"),
                           (KernelRequest(cuda, half, 128, 128, MaskKind.WINDOW), "sliding windows"),
                           (KernelRequest(cuda, half, 128, 128, softcap=True), "soft-capping")):
        with pytest.raises(ValueError, match=rf"^backend 'cudnn_fe' .*{words}"):
            select_backend("cudnn_fe", request)
    assert select_backend("cudnn_fe", docs) == "cudnn_fe"
    hopper = DeviceClass("cuda", (9, 0), 91900, frozenset({"nvidia-cudnn-frontend"}))
    for kind in MaskKind:  # auto takes it for packed documents only
        got = select_backend("auto", KernelRequest(cuda, torch.bfloat16, 128, 128, kind), device_class=hopper)
        assert (got == "cudnn_fe") == (kind == MaskKind.DOCUMENTS), (kind, got)
    without = DeviceClass("cuda", (9, 0), 91900)
    assert select_backend("auto", docs, device_class=without) != "cudnn_fe"
    monkeypatch.setattr(cudnn_fe, "unavailable_reason", lambda: "needs the package")  # installed, cannot load
    assert select_backend("auto", docs, device_class=hopper) != "cudnn_fe"


def test_cudnn_versions_with_zero_gradients_are_refused(monkeypatch):
    install(monkeypatch.setattr, cudnn_version=92301)
    reason = cudnn_fe.unavailable_reason()
    assert reason == ("runs on cuDNN 9.23.1, whose packed backward can return all-zero gradients (cuDNN 9.22 "
                      "to 9.26); use another cuDNN")
    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="^backend 'cudnn_fe' runs on cuDNN 9.23.1"):
        cudnn_fe.CudnnFeKernel().forward(q, q, q, causal=True, scale=0.3)
    for version in (91900, 92100, 92700):
        install(monkeypatch.setattr, cudnn_version=version)
        assert cudnn_fe.unavailable_reason() is None


def test_the_package_is_imported_only_when_the_backend_is_asked_for(tmp_path):
    """A ``cudnn`` package that fails to load: the library and the backend's module import without touching
    it, and asking for the backend gives one line naming the problem."""
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text("raise OSError('libcudnn.so.9: cannot open it')\n")
    code = (
        "import sys\nimport lightseq_hf, lightseq_hf.kernels\n"
        "from lightseq_hf.kernels import kernel_named\n"
        "from lightseq_hf.kernels.varlen import cudnn as cudnn_fe\n"
        "kernel_named('cudnn_fe')\nassert 'cudnn' not in sys.modules\n"
        "print(cudnn_fe.unavailable_reason())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("could not load the nvidia-cudnn-frontend package (OSError: "
                                   "libcudnn.so.9: cannot open it)")


def test_training_config_takes_the_backend():
    pytest.importorskip("pydantic")
    from lightseq_hf.training.build import check_backend_device
    from lightseq_hf.training.config import ConfigError, load_config

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ["training.backend=cudnn_fe"])
    assert cfg.training.backend == "cudnn_fe"
    with pytest.raises(ConfigError, match=r"^training.backend: 'cudnn_fe' needs a CUDA GPU; tensors are on"):
        check_backend_device("cudnn_fe", torch.nn.Linear(2, 2))


def test_the_op_call_recorder_of_the_internal_surface(monkeypatch):
    """``lightseq_hf._testing.kernel_knobs.cudnn_fe_op_calls`` (the GPU tests read the op calls through it)
    records the calls made inside it and puts the ops back."""
    emu = install(monkeypatch.setattr)
    q = torch.randn(1, 70, 2, 8, dtype=torch.float64)
    blocks = make_doc_blocks((6, 64), (6, 64), slice(0, 70), slice(0, 70), True, "cpu")
    kernel = cudnn_fe.CudnnFeKernel()
    ops = cudnn_fe.ops()
    with kernel_knobs.cudnn_fe_op_calls() as calls:
        out, lse = kernel.forward(q, q, q, causal=False, scale=0.3, doc_blocks=blocks)
        kernel.backward(q, q, q, q, out, lse, causal=False, scale=0.3, doc_blocks=blocks)
    assert [c["op"] for c in calls] == ["forward", "backward"] and calls[0]["k_lens"] == (6, 64)
    assert calls[1]["k_lens"] == (6, 63)  # the key length 64 goes without its first key
    assert cudnn_fe.ops() is ops and len(emu.calls) == 2


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class NewTensors(TorchDispatchMode):
    """Every tensor an op returns in a storage none of its arguments share (an allocation the caller can
    see), as ``(op, shape, dtype)``; the cuDNN ops' own results are kept apart (``op_results``)."""

    def __init__(self) -> None:
        super().__init__()
        self.new: list[tuple[str, tuple, torch.dtype]] = []
        self.op_results = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        fresh = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel()
                 and _storage(t) not in given]
        if "cudnn" in str(func):
            self.op_results += len(fresh)
        else:
            self.new += [(str(func), tuple(t.shape), t.dtype) for t in fresh]
        return out

    def rows(self, dims: tuple[int, int, int], dtype=None) -> list:
        """The new tensors of query or key rows ``(..., heads or kv_heads, head dim)`` (``dims``: heads,
        kv heads, head dim), of ``dtype`` (None: any)."""
        h, hk, d = dims
        return [n for n in self.new if len(n[1]) >= 3 and n[1][-1] == d and n[1][-2] in (h, hk)
                and (dtype is None or n[2] == dtype)]


def _doc_attention(q, k, v, docs, scale):
    """float64 causal attention inside each document of one row (key/value heads repeated)."""
    out = torch.zeros(q.shape[1:], dtype=torch.float64)
    group = q.shape[2] // k.shape[2]
    for a, b in docs:
        s = torch.einsum("qhd,khd->hqk", q[0, a:b].double(),
                         k[0, a:b].double().repeat_interleave(group, 1)) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), -math.inf)
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[0, a:b].double().repeat_interleave(group, 1))
    return out[None]


def test_a_packed_row_on_one_rank_is_one_op_call_each_way_on_the_callers_tensors(monkeypatch):
    """``dist_flash_attn`` on one rank, bf16, a 3072-token row of 7 documents: one forward and one backward
    op call; the op reads the caller's q, k, v, the output it returned and the caller's output gradient
    (no gather, no copy), and its results are what the caller gets (the output, and q.grad, k.grad, v.grad:
    no merge, no float32 copy); against float64 attention inside each document."""
    import lightseq_hf

    emu = install(monkeypatch.setattr)
    n, h, hk, d = 3072, 4, 2, 16
    docs = ((0, 300), (300, 700), (700, 1200), (1200, 1800), (1800, 2300), (2300, 2900), (2900, 3072))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, n, h, d, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, n, hk, d, generator=g).bfloat16().requires_grad_() for _ in "kv")
    out = lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, *(b for _, b in docs)], backend="cudnn_fe")
    grad = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(grad)
    forward, backward = emu.calls
    assert (forward["op"], backward["op"]) == ("forward", "backward")
    assert forward["storages"] == tuple(map(_storage, (q, k, v))) and _storage(out) == forward["results"][0]
    assert backward["storages"] == tuple(map(_storage, (grad, q, k, v, out)))
    assert tuple(map(_storage, (q.grad, k.grad, v.grad))) == backward["results"]
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = _doc_attention(*leaves, docs, d ** -0.5)
    want.backward(grad.double())
    assert rel_err(out, want) < 1e-2
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        assert rel_err(got, leaf.grad) < 2e-2


def _ring_tensors(world, chunk, dims, gen):
    """Per rank: its q, dout, out (bf16), k, v (bf16), lse and the float32 accumulators (running out, lse,
    dq, dk, dv), each in its own storage as a rank holds them."""
    h, hk, d = dims

    def randn(*shape):
        return torch.randn(*shape, generator=gen).bfloat16()

    ranks = []
    for _ in range(world):
        t = {"q": randn(1, chunk, h, d), "dout": randn(1, chunk, h, d), "out": randn(1, chunk, h, d),
             "k": randn(1, chunk, hk, d), "v": randn(1, chunk, hk, d),
             "lse": torch.randn(1, h, chunk, generator=gen).float() + 3.0}
        t.update(run_out=torch.zeros(1, chunk, h, d), run_lse=torch.full((1, h, chunk), -math.inf),
                 dq=torch.zeros(1, chunk, h, d), dk=torch.zeros(1, chunk, hk, d),
                 dv=torch.zeros(1, chunk, hk, d))
        ranks.append(t)
    return ranks


def test_ring_tasks_copy_only_rows_the_op_cannot_view(monkeypatch):
    """Every task of a 2-rank ring over a packed row, run with its tensors as the ring holds them (a rank's
    own rows and keys views of its chunk, another rank's rows and keys received as they are, a stand-in
    output for them): the forward never copies the rows it feeds; the backward copies a side's rows only
    where the storage holding them ends before the op's bucketed row count (never a rank's own chunk
    against its own keys), and allocates no float32 rows unless a task takes several op calls."""
    emu = install(monkeypatch.setattr)
    kernel = cudnn_fe.CudnnFeKernel()
    world, chunk, dims = 3, 3072, (4, 2, 16)  # a rank's chunk: a multiple of 1024, not a power of two
    gen = torch.Generator().manual_seed(11)
    docs = random_docs(gen, 1, world * chunk, min_len=100, max_len=1500)
    seg = Segments(world * chunk, docs)
    ranks = _ring_tensors(world, chunk, dims, gen)
    copies, avoidable, tasks, whole_chunks = 0, [], 0, 0
    for step in build_segment_schedule(world, seg, True).steps:
        for rank, task in enumerate(step):
            if task is None:
                continue
            own_q, own_kv = task.q_owner == rank, task.kv_owner == rank
            mine, theirs = ranks[task.q_owner], ranks[task.kv_owner]
            rows = slice(task.row_start, task.row_stop)
            keys = slice(*task.keys(chunk))

            def held(t, own):  # a view of the owner's chunk, or a received copy
                return t if own else t.clone()

            q_in, dout_in, out_in = (held(mine[x][:, rows], own_q) for x in ("q", "dout", "out"))
            lse_in = held(mine["lse"][:, :, rows], own_q)
            k_in, v_in = (held(theirs[x][:, keys], own_kv) for x in ("k", "v"))
            blocks = task_doc_blocks(seg, task, chunk, True, "cpu")
            emu.calls.clear()
            with NewTensors() as recorder:
                kernel.forward(q_in, k_in, v_in, scale=0.25, mask=AttentionMask(doc_blocks=blocks),
                               out=mine["run_out"][:, rows] if own_q else None,
                               lse=mine["run_lse"][:, :, rows] if own_q else None)
                forward_rows = recorder.rows(dims)
                kernel.backward(dout_in, q_in, k_in, v_in, out_in, lse_in, scale=0.25,
                                mask=AttentionMask(doc_blocks=blocks),
                                dq=mine["dq"][:, rows] if own_q else None,
                                dk=theirs["dk"][:, keys] if own_kv else None,
                                dv=theirs["dv"][:, keys] if own_kv else None)
            tasks += 1
            calls = aligned_calls(fed_blocks(blocks))
            assert not [n for n in forward_rows if n[2] == torch.float32]  # nothing float32 in forward
            for call, record in zip(calls, [c for c in emu.calls if c["op"] == "forward"]):
                assert isinstance(call.q_rows, slice) and isinstance(call.k_rows, slice)
                assert record["storages"] == tuple(map(_storage, (q_in, k_in, v_in)))  # views, not copies
            parts = [backward_plan(c, True) for c in calls]
            records = [c for c in emu.calls if c["op"] == "backward"]
            assert len(records) == len(parts)
            for (call, _), record in zip(parts, records):
                for side_rows, count, tensors in ((call.q_rows, record["rows"], (dout_in, q_in, out_in)),
                                                  (call.k_rows, record["keys"], (k_in, v_in))):
                    for t in tensors:
                        room = (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()) \
                            // t[0, 0].numel()
                        viewable = isinstance(side_rows, slice) and side_rows.start + count <= room
                        viewed = _storage(t) in record["storages"]
                        copies += not viewed
                        if viewable and not viewed:
                            avoidable.append((task, count, room))
                        if own_q and own_kv and rows == slice(0, chunk) and keys == slice(0, chunk):
                            whole_chunks += 1
                            assert viewed, (task, count)  # a rank's own chunk against its own keys
            in_parts = len(parts) > 1 or any(pairs is not None for _, pairs in parts)
            float32_rows = recorder.rows(dims, torch.float32)
            assert in_parts or not float32_rows, (task, float32_rows)
    assert tasks > world and whole_chunks >= 5 * world and not avoidable, (tasks, whole_chunks, avoidable)
    assert 0 < copies <= 5 * (tasks - world)  # only the tasks across chunks copy (keys ending a chunk)


def test_one_rank_refuses_a_gradient_through_the_lse_by_name(monkeypatch):
    """Asked for by name, a backend whose backward takes the output rows serves a call returning the lse;
    a gradient that reaches that lse is refused in one line naming the backends that take it."""
    import lightseq_hf

    install(monkeypatch.setattr)
    q, k, v = (torch.randn(1, 64, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 20, 64], backend="cudnn_fe",
                                           return_lse=True)
    out.sum().backward(retain_graph=True)  # the output alone: served
    assert q.grad is not None
    with pytest.raises(ValueError, match=r"^backend 'cudnn_fe' cannot back-propagate through the returned "
                                         r"lse; use backend='triton' or 'reference'"):
        (out.sum() + lse.sum()).backward()
