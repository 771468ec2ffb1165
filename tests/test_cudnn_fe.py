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

from lightseq_hf.kernels import (
    DeviceClass,
    KernelRequest,
    MaskKind,
    ReferenceKernel,
    cudnn_fe,
    flash_varlen,
    select_backend,
)
from lightseq_hf.kernels.base import make_doc_blocks
from lightseq_hf.kernels.cudnn_fe_layout import (
    GraphShape,
    GraphShapes,
    backward_plan,
    bucket,
    fed_blocks,
    key_length_hazard,
)
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
    assert GraphShape.bucketed(blocks, False) == GraphShape(4, 512, 0)
    assert GraphShape.bucketed(blocks, True) == GraphShape(4, 512, 512)
    shapes = GraphShapes()
    big = GraphShape(8, 1024, 2048)
    assert shapes.choose("k", big) == big
    assert shapes.choose("k", GraphShape(4, 512, 1024)) == big  # grid 4x, tokens 2x: reused
    assert shapes.choose("k", GraphShape(4, 256, 1024)) == GraphShape(4, 256, 1024)  # grid 8x: its own
    assert shapes.choose("k", GraphShape(8, 1024, 512)) == GraphShape(8, 1024, 512)  # tokens 4x: its own
    assert shapes.choose("other", GraphShape(4, 512, 1024)) == GraphShape(4, 512, 1024)  # another key
    assert len(shapes) == 4
    for i in range(40):
        shapes.choose("k", GraphShape(1, 128 * (i + 1), 0))
    assert len(shapes) == 24 + 1  # the least recently chosen shapes are forgotten


def _stream_layouts(steps: int, seq: int):
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib.workloads import lognormal_docs

    for step in range(steps):
        yield Segments(seq, (lognormal_docs(seq, median=2048, sigma=1.0, max_len=32768, seed=7000 + step),))


def test_graph_shapes_stay_few_on_a_changing_packed_stream():
    """40 steps of 32K-token rows of log-normal documents on a 2-rank ring: every task's calls (forward,
    backward parts) through the backend's planning. Each rank asks for few shapes, almost none after the
    first steps, where the exact shapes the op would otherwise key on are new at nearly every step."""
    world, seq, steps = 2, 32768, 40
    shapes = [GraphShapes() for _ in range(world)]
    exact: list[set] = [set() for _ in range(world)]
    late_new, late_exact = [0] * world, [0] * world
    for step, seg in enumerate(_stream_layouts(steps, seq)):
        sched = build_segment_schedule(world, seg, True)
        for tasks in sched.steps:
            for rank, task in enumerate(tasks):
                if task is None:
                    continue
                fed = fed_blocks(task_doc_blocks(seg, task, seq // world, True, "cpu"))
                for kind, call in (("f", fed), ("b", backward_plan(fed, True)[0])):
                    before = len(shapes[rank])
                    shapes[rank].choose((kind, call.causal), GraphShape.bucketed(call, kind == "b"))
                    key = (kind, call.causal, call.num_blocks, call.max_q, call.max_k, call.total_q,
                           call.total_k)
                    if step >= steps // 2:
                        late_new[rank] += len(shapes[rank]) > before
                        late_exact[rank] += key not in exact[rank]
                    exact[rank].add(key)
    for rank in range(world):
        assert len(shapes[rank]) <= 48  # well inside the op's 128 cached graphs
        assert late_new[rank] <= steps // 4, late_new  # at most one build every other step, late on
        assert late_exact[rank] >= steps // 2  # unbucketed, every step would build


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
            from lightseq_hf.kernels.base import merge_into

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
    monkeypatch.setattr(cudnn_fe, "_loaded", {})
    with mock.patch.object(cudnn_fe, "load_ops", side_effect=ModuleNotFoundError("no", name="cudnn")):
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
        "from lightseq_hf.kernels import cudnn_fe, kernel_named\n"
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
    from lightseq_hf._testing import kernel_knobs

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
