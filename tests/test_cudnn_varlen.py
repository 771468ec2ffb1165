"""The cuDNN varlen backend on the CPU, around an emulation of torch's cuDNN varlen ops: the planned calls
of a layout (one call, or two where the op's top-left causal rule cannot express a block; calls the op
does not take go to the fallback kernel as key ranges), the lse layouts, the backward from the rows'
global statistics, and the probe that decides these once per device."""

from __future__ import annotations

import math

import pytest
import torch
from cudnn_emulation import LAYOUTS, install
from distributed import rel_err
from doc_reference import random_docs

from lightseq_hf.kernels import ReferenceKernel, cudnn_ops
from lightseq_hf.kernels.base import merge_into
from lightseq_hf.kernels.cudnn_ops import LseLayout, head_dim_ok
from lightseq_hf.kernels.cudnn_varlen import CudnnVarlenKernel, block_key_ranges, plan_calls, plan_layout
from lightseq_hf.kernels.flash_varlen import make_doc_blocks
from lightseq_hf.parallel.doc_blocks import task_doc_blocks
from lightseq_hf.parallel.schedule import SpanTask
from lightseq_hf.parallel.segment_schedule import build_segment_schedule
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

CPU = torch.device("cpu")


def layouts(world):
    """Document layouts of ``batch`` 1-2 rows of ``12 * world`` tokens."""
    n = 12 * world
    gen = torch.Generator().manual_seed(world)
    yield "random lengths", random_docs(gen, 2, n, max_len=15)
    padded = random_docs(gen, 1, n, pad_left=True, pad_right=True, max_len=9)[0]
    yield "padding + all-padding row", (padded, ())
    yield "length-1 documents", (tuple((t, t + 1) for t in range(0, n, 2)), ((0, 1), (1, n)))
    yield "one document spanning all chunks", (((0, n),), ((2, n - 1),))


def tasks_of(world, seg, chunk):
    """The schedule's tasks, every whole block, and diagonal row ranges starting inside documents."""
    tasks = [t for step in build_segment_schedule(world, seg, True).steps for t in step if t is not None]
    tasks += [SpanTask(i, j, 0, chunk, 0) for i in range(world) for j in range(world)]
    tasks += [SpanTask(i, i, a, b, 0, True) for i in range(world) for a, b in ((5, 12), (3, 9))]
    return tasks


@pytest.mark.parametrize("layout,bottom_right", [("tokens", False), ("heads", False), ("tokens", True)])
def test_kernel_matches_the_reference_kernel_with_key_ranges(monkeypatch, layout, bottom_right):
    emu = install(monkeypatch.setattr, layout=layout, bottom_right=bottom_right)
    kernel = CudnnVarlenKernel()
    ref = ReferenceKernel(block_q=8, block_k=8)
    world, chunk, h, hk, d = 2, 12, 4, 2, 8
    checked = split = fell_back = 0
    for name, docs in layouts(world):
        seg = Segments(world * chunk, docs)
        batch = len(docs)
        g = torch.Generator().manual_seed(len(name))
        q, dout = (torch.randn(batch, world * chunk, h, d, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(batch, world * chunk, hk, d, generator=g, dtype=torch.float64) for _ in "kv")
        lo, hi = key_ranges(seg, causal=True)
        for task in tasks_of(world, seg, chunk):
            rows = slice(task.q_owner * chunk + task.row_start, task.q_owner * chunk + task.row_stop)
            ka, kb = task.keys(chunk)
            keys = slice(task.kv_owner * chunk + ka, task.kv_owner * chunk + kb)
            rng = local_key_range(lo[:, rows], hi[:, rows], keys.start, kb - ka)
            blocks = task_doc_blocks(seg, task, chunk, True, "cpu")
            qt, dt, kt, vt = q[:, rows], dout[:, rows], k[:, keys], v[:, keys]
            emu.calls.clear()
            m = qt.shape[1]
            want = ref.forward(qt, kt, vt, causal=False, scale=0.3, key_range=rng)
            got = kernel.forward(qt, kt, vt, causal=False, scale=0.3, doc_blocks=blocks)
            assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12, (name, task)
            plan = plan_layout(blocks, bottom_right, batch, m, kb - ka) if blocks.num_blocks else ()
            assert len(emu.calls) == sum(key_range is None for _, key_range in plan)
            split += len(plan) == 2
            fell_back += any(key_range is not None for _, key_range in plan)
            # merging into running buffers (views with a row offset; some rows hold nothing yet)
            base_out = torch.randn(batch, m + 2, h, d, generator=g, dtype=torch.float64)
            base_lse = torch.randn(batch, h, m + 2, generator=g, dtype=torch.float64)
            base_lse[:, :, ::3] = -math.inf
            base_out[:, ::3] = 0
            run_out, run_lse = base_out.clone(), base_lse.clone()
            ref_out, ref_lse = base_out[:, 1:1 + m].clone(), base_lse[:, :, 1:1 + m].clone()
            kernel.forward(qt, kt, vt, causal=False, scale=0.3, out=run_out[:, 1:1 + m],
                           lse=run_lse[:, :, 1:1 + m], doc_blocks=blocks)
            merge_into(ref_out, ref_lse, *want)
            assert rel_err(run_out[:, 1:1 + m], ref_out) < 1e-12 and rel_err(run_lse[:, :, 1:1 + m],
                                                                               ref_lse) < 1e-12
            assert torch.equal(run_out[:, 0], base_out[:, 0]) and torch.equal(run_lse[:, :, m + 1:],
                                                                                base_lse[:, :, m + 1:])
            # backward from any global out/lse of the rows (not this call's), added into given gradients
            g_out, g_lse = (x + 0.1 for x in want)
            g_lse = torch.where(torch.isinf(want[1]), want[1], g_lse)
            want_grads = ref.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, key_range=rng)
            seeds = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in want_grads]
            dq, dk, dv = (s.clone() for s in seeds)
            kernel.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, dq=dq, dk=dk, dv=dv,
                            doc_blocks=blocks)
            for x, s, w in zip((dq, dk, dv), seeds, want_grads):
                assert rel_err(x - s, w) < 1e-12, (name, task)
            fresh = kernel.backward(dt, qt, kt, vt, g_out, g_lse, causal=False, scale=0.3, doc_blocks=blocks)
            for x, w in zip(fresh, want_grads):
                assert rel_err(x, w) < 1e-12
            checked += 1
    assert checked > 40
    assert (split > 5) if not bottom_right else split == 0  # top-left: offset causal blocks are split
    assert fell_back > 0  # one-token calls ran on the fallback kernel


def test_plan_splits_causal_blocks_with_keys_before_their_rows(monkeypatch):
    install(monkeypatch.setattr)
    # three documents: 3 rows after 2 earlier keys, 3 rows from their start, 2 rows from their start
    blocks = make_doc_blocks((3, 3, 2), (5, 3, 2), slice(0, 8), slice(0, 10), True, "cpu")
    square, prefix = plan_calls(blocks, bottom_right=False)
    assert plan_calls(blocks, bottom_right=False)[0] is square  # planned once per layout
    assert square.causal and square.q_lens == square.k_lens == (3, 3, 2)
    assert square.q_rows == slice(0, 8) and square.k_rows == slice(2, 10)
    assert not prefix.causal and (prefix.q_lens, prefix.k_lens) == ((3,), (2,))
    assert prefix.q_rows == slice(0, 3) and prefix.k_rows == slice(0, 2)
    assert square.cu_k.tolist() == [0, 3, 6, 8] and square.cu_q.dtype == torch.int32
    assert plan_calls(blocks, bottom_right=True) == (blocks,)
    full = make_doc_blocks((3, 2), (5, 2), slice(0, 5), slice(0, 7), False, "cpu")
    assert plan_calls(full, bottom_right=False) == (full,)
    # gathered rows (padding between documents): the parts pick from them
    gathered = make_doc_blocks((2, 2), (4, 2), [1, 2, 5, 6], [0, 1, 2, 3, 5, 6], True, "cpu")
    square, prefix = plan_calls(gathered, bottom_right=False)
    assert square.q_rows.tolist() == [1, 2, 5, 6] and square.k_rows.tolist() == [2, 3, 5, 6]
    assert prefix.q_rows.tolist() == [1, 2] and prefix.k_rows.tolist() == [0, 1]


def test_whole_rows_are_bottom_right_causal_attention(monkeypatch):
    emu = install(monkeypatch.setattr)
    kernel, ref = CudnnVarlenKernel(), ReferenceKernel(block_q=4, block_k=4)
    g = torch.Generator().manual_seed(0)
    for lq, lk, causal, calls in ((6, 6, True, 1), (4, 7, True, 2), (7, 4, True, 1), (5, 3, False, 1)):
        q, dout = (torch.randn(2, lq, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(2, lk, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
        emu.calls.clear()
        want = ref.forward(q, k, v, causal=causal, scale=0.5)
        got = kernel.forward(q, k, v, causal=causal, scale=0.5)
        assert [c[0] for c in emu.calls] == ["forward"] * calls
        assert rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12  # -inf rows stay -inf
        w_grads = ref.backward(dout, q, k, v, *want, causal=causal, scale=0.5)
        for x, w in zip(kernel.backward(dout, q, k, v, *got, causal=causal, scale=0.5), w_grads):
            assert rel_err(x, w) < 1e-12


def test_calls_the_op_does_not_take_run_on_the_fallback_kernel_as_key_ranges(monkeypatch):
    emu = install(monkeypatch.setattr)
    # batch 2 rows of 6: one-token documents (and padding) in row 0; row 1 one causal block of 3 rows
    # starting after 2 keys of its document
    blocks = make_doc_blocks((1, 1, 1, 3), (1, 1, 1, 5), [0, 2, 3, 9, 10, 11], [0, 2, 3, 7, 8, 9, 10, 11],
                             True, "cpu")
    lo, hi = block_key_ranges(blocks, 2, 6, 6)
    assert lo.dtype == hi.dtype == torch.int32
    assert lo.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 1, 1]]  # rows fed nothing: empty, non-decreasing
    assert hi.tolist() == [[1, 1, 3, 4, 4, 4], [0, 0, 0, 4, 5, 6]]
    square, prefix = plan_layout(blocks, False, 2, 6, 6)
    assert square[1] is None and prefix[1] is None  # longest sequences 3 / 3 and 3 / 2: the op takes them
    ones = make_doc_blocks((1, 1), (1, 1), [0, 2], [0, 2], True, "cpu")
    ((part, key_range),) = plan_layout(ones, False, 1, 4, 4)
    assert key_range is not None and plan_layout(ones, False, 1, 4, 4)[0][1] is key_range  # once
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64) for _ in "qd")
    k, v = (torch.randn(1, 4, 1, 8, generator=g, dtype=torch.float64) for _ in "kv")
    ref = ReferenceKernel(block_q=4, block_k=4)
    want = ref.forward(q, k, v, causal=False, scale=0.5, key_range=key_range)
    got = CudnnVarlenKernel().forward(q, k, v, causal=False, scale=0.5, doc_blocks=ones)
    assert emu.calls == [] and rel_err(got[0], want[0]) < 1e-12 and rel_err(got[1], want[1]) < 1e-12
    assert torch.isneginf(got[1][0, :, 1]).all() and torch.isfinite(got[1][0, :, 0]).all()


def test_lse_layout_views_map_rows_to_the_ops_memory():
    total, heads = 5, 3
    flat = torch.arange(total * heads, dtype=torch.float64)
    for ndim in (2, 3):
        for head_major in (False, True):
            for token_outer in (False, True):
                lay = LseLayout(ndim, head_major, token_outer)
                lse = lay.view(flat, total, heads)
                shape = (heads, total) if head_major else (total, heads)
                assert tuple(lse.shape) == shape + ((1,) if ndim == 3 else ())
                rows = lay.rows(lse)
                t, h = torch.meshgrid(torch.arange(total), torch.arange(heads), indexing="xy")
                want = (t * heads + h) if token_outer else (h * total + t)
                assert torch.equal(rows, want.double()), lay
                assert rows.data_ptr() == flat.data_ptr()  # views: writes reach the op's buffer


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("bottom_right", [False, True])
def test_probe_reads_the_lse_layout_and_the_causal_alignment(monkeypatch, layout, bottom_right):
    emu = install(monkeypatch.setattr, layout=layout, bottom_right=bottom_right, probe=True)
    traits = cudnn_ops.op_traits(CPU)
    assert traits.lse == LAYOUTS[layout] and traits.bottom_right == bottom_right
    assert traits.seed is emu.seed and not traits.rebuilds_graph
    assert cudnn_ops.op_traits(CPU) is traits  # once per device


def test_probe_finds_an_op_that_rebuilds_its_graph(monkeypatch):
    install(monkeypatch.setattr, slow=True, probe=True)
    assert cudnn_ops.op_traits(CPU).rebuilds_graph


def test_probe_refuses_an_op_whose_results_are_off(monkeypatch):
    emu = install(monkeypatch.setattr, probe=True)

    def log2_lse(*args):
        out, lse, seed, offset = emu.forward(*args)
        return out, lse / math.log(2), seed, offset

    monkeypatch.setattr(cudnn_ops, "op_forward", log2_lse)
    with pytest.raises(RuntimeError, match="neither causal alignment"):
        cudnn_ops.op_traits(CPU)

    def swapped_grads(*args):
        dq, dk, dv = emu.backward(*args)
        return dq, dv, dk

    monkeypatch.setattr(cudnn_ops, "op_forward", emu.forward)
    monkeypatch.setattr(cudnn_ops, "op_backward", swapped_grads)
    with pytest.raises(RuntimeError, match="backward does not match"):
        cudnn_ops.op_traits(CPU)


def test_inputs_and_head_dims_the_op_takes(monkeypatch):
    assert head_dim_ok(64) and head_dim_ok(128) and head_dim_ok(72)
    assert not head_dim_ok(256) and not head_dim_ok(100) and not head_dim_ok(None)
    assert not cudnn_ops.usable(CPU) and "CUDA GPU" in cudnn_ops.unusable_reason(CPU)
    # torch releases whose varlen backward sizes dQ by the head dim are refused before any probe
    assert "PR 186142" in cudnn_ops.version_defect("2.11.0+cu130")
    assert cudnn_ops.version_defect("2.12.0") is None and cudnn_ops.version_defect("3.0.1") is None
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cudnn_ops.check_cudnn_inputs(torch.zeros(1, 1, 8))
    x = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="backend 'cudnn_varlen' needs a CUDA GPU; tensors are on cpu"):
        CudnnVarlenKernel().forward(x, x, x, causal=True, scale=1.0)
    install(monkeypatch.setattr)
    with pytest.raises(ValueError, match="needs the attention output"):
        CudnnVarlenKernel().backward(x, x, x, x, None, torch.zeros(1, 1, 2), causal=True, scale=1.0)
