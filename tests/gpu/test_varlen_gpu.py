"""The flash varlen path on a GPU: torch's real FlashAttention-2 varlen op behind ``flash_varlen``, in bf16,
against a float64 reference (the reference kernel with key ranges, or per document), forward and backward,
several document layouts, GQA, every task of a 2-way segment schedule (``dist_flash_attn`` over packed rows on
one and two GPUs, for every packed backend, is in test_packed_gpu.py).

Run on a machine with a CUDA GPU: ``python -m pytest tests/gpu/test_varlen_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from distributed import rel_err
from packed_cases import bound, layouts

from lightseq_hf.kernels import get_kernel
from lightseq_hf.kernels.reference import ReferenceKernel
from lightseq_hf.kernels.row_stats import merge_into
from lightseq_hf.kernels.varlen import flash as flash_varlen
from lightseq_hf.parallel.doc_blocks import task_doc_blocks
from lightseq_hf.parallel.schedule import SpanTask
from lightseq_hf.parallel.segment_schedule import build_segment_schedule
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

if not flash_varlen.usable(torch.device("cuda")):
    pytest.skip("torch.ops.aten._flash_attention_forward does not run on this GPU / torch build",
                allow_module_level=True)


def test_lse_layout_probe_matches_the_op():
    dev = torch.device("cuda")
    padded = flash_varlen.lse_is_padded(dev)
    x = torch.randn(7, 2, 64, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=dev)
    _, lse, _, _ = flash_varlen.varlen_forward(x, x, x, cu, cu, 4, 4, True, 0.125)
    assert tuple(lse.shape) == ((2, 2, 4) if padded else (2, 7)), (padded, tuple(lse.shape))
    layout = "(blocks, heads, max_q)" if padded else "(heads, total)"
    print(f"torch {torch.__version__}: varlen lse layout {layout}")


@pytest.mark.parametrize("hk", [8, 2])
def test_kernel_per_task_bf16_matches_float64_reference(hk):
    """Every task of a 2-way segment schedule (run on one GPU) and the whole rows: plain call, merge into
    running buffers, and backward accumulating into given gradients."""
    dev = torch.device("cuda")
    world, chunk, h, d = 2, 2048, 8, 128
    n = world * chunk
    kernel = get_kernel("flash_varlen", dev)
    ref = ReferenceKernel(block_q=1024, block_k=1024)
    failures = []
    for name, docs in layouts(n):
        seg = Segments(n, docs)
        b = len(docs)
        g = torch.Generator(device=dev).manual_seed(len(name) + hk)
        q, dout = (torch.randn(b, n, h, d, device=dev, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.float64) for _ in "kv")
        lo, hi = key_ranges(seg, causal=True, device=dev)
        tasks = [(t, chunk) for step in build_segment_schedule(world, seg, True).steps for t in step if t]
        tasks.append((SpanTask(0, 0, 0, n, 0, diagonal=True), n))  # world 1: the whole rows
        for task, ck in tasks:
            rows = slice(task.q_owner * ck + task.row_start, task.q_owner * ck + task.row_stop)
            key_a, key_b = task.keys(ck)  # schedule tasks read only the keys their rows see
            keys = slice(task.kv_owner * ck + key_a, task.kv_owner * ck + key_b)
            rng = local_key_range(lo[:, rows], hi[:, rows], keys.start, key_b - key_a)
            blocks = task_doc_blocks(seg, task, ck, True, dev)
            qt, kt, vt, dt = q[:, rows], k[:, keys], v[:, keys], dout[:, rows]
            scale = d ** -0.5
            r_out, r_lse = ref.forward(qt, kt, vt, causal=False, scale=scale, key_range=rng)
            r_grads = ref.backward(dt, qt, kt, vt, r_out, r_lse, causal=False, scale=scale, key_range=rng)
            qb, kb, vb, db = (x.bfloat16().contiguous() for x in (qt, kt, vt, dt))
            b_out, b_lse = ref.forward(qb, kb, vb, causal=False, scale=scale, key_range=rng)
            b_grads = ref.backward(db, qb, kb, vb, b_out, b_lse, causal=False, scale=scale, key_range=rng)
            out, lse = kernel.forward(qb, kb, vb, causal=False, scale=scale, doc_blocks=blocks)
            # running buffers: half the rows already hold a partial result, the other half nothing
            m = qt.shape[1]
            run_out = torch.zeros(b, m, h, d, device=dev)
            run_lse = torch.full((b, h, m), float("-inf"), device=dev)
            half = m // 2
            run_out[:, :half], run_lse[:, :, :half] = r_out[:, :half].float(), r_lse[:, :, :half].float()
            want_out, want_lse = run_out.double().clone(), run_lse.double().clone()
            merge_into(want_out, want_lse, r_out, r_lse)
            kernel.forward(qb, kb, vb, causal=False, scale=scale, out=run_out, lse=run_lse, doc_blocks=blocks)
            dq = torch.ones(b, m, h, d, device=dev)
            dk, dv = (torch.ones(b, key_b - key_a, hk, d, device=dev) for _ in "kv")
            kernel.backward(db, qb, kb, vb, r_out.bfloat16(), r_lse.float(), causal=False, scale=scale,
                            dq=dq, dk=dk, dv=dv, doc_blocks=blocks)
            out_err, lse_err = rel_err(b_out, r_out), rel_err(b_lse, r_lse)
            checks = [("out", out, r_out, bound(out_err)), ("lse", lse, r_lse, bound(lse_err)),
                      ("merged out", run_out, want_out, bound(out_err)),
                      ("merged lse", run_lse, want_lse, bound(lse_err))]
            checks += [(label, x - 1, r, bound(rel_err(bb, r), rounded_to_bf16=True))
                       for label, x, r, bb in zip(("dq", "dk", "dv"), (dq, dk, dv), r_grads, b_grads)]
            for label, x, r, limit in checks:
                err = rel_err(x, r)
                if not err <= limit:
                    failures.append(f"[{name}] {task} {label}: rel err {err:.2e} > {limit:.2e}")
    assert not failures, "\n".join(failures[:20])
