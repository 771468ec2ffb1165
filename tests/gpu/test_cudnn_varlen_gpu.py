"""The cuDNN varlen backend on a GPU: torch's real cuDNN varlen ops behind ``CudnnVarlenKernel``, in bf16,
against a float64 reference (the reference kernel with key ranges), forward, merge and backward, for every
task of 2- and 4-way segment schedules run on one GPU (documents crossing shards, one-token documents,
padding, row ranges starting inside documents), GQA and head dims 64/128; calls of one-token sequences
on the fallback kernel. One-token layouts run last (a call of one-token sequences once did not return).

Run on a machine with a CUDA GPU: ``python -m pytest tests/gpu/test_cudnn_varlen_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from distributed import rel_err

from lightseq_hf.kernels import cudnn_ops
from lightseq_hf.kernels.base import merge_into
from lightseq_hf.kernels.cudnn_varlen import CudnnVarlenKernel, plan_layout
from lightseq_hf.kernels.reference import ReferenceKernel
from lightseq_hf.parallel.doc_blocks import task_doc_blocks
from lightseq_hf.parallel.schedule import SpanTask
from lightseq_hf.parallel.segment_schedule import build_segment_schedule
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

DEV = torch.device("cuda")
if not cudnn_ops.usable(DEV):
    pytest.skip(cudnn_ops.unusable_reason(DEV), allow_module_level=True)


def random_docs(n, seed, *, pad=False, max_len=1500):
    g = torch.Generator().manual_seed(seed)
    t, docs = (37 if pad else 0), []
    end = n - (53 if pad else 0)
    while t < end:
        size = int(torch.randint(1, max_len, (1,), generator=g))
        docs.append((t, min(end, t + size)))
        t += size + (int(torch.randint(0, 3, (1,), generator=g)) if pad else 0)  # gaps: padding inside
    return tuple(d for d in docs if d[1] > d[0])


def layouts(n):
    yield "random lengths, batch 2 with padding", (random_docs(n, 1), random_docs(n, 2, pad=True))
    ones = tuple((t, t + 1) for t in range(0, n // 2))
    short = tuple((t, min(n, t + 37)) for t in range(n // 2, n, 37))
    yield "one-token documents, then 37-token ones", (ones + short,)
    yield "one document crossing every shard", (((0, n),),)


def bound(b_err, rounded_to_bf16=False):
    """At most twice the error of the reference kernel on the same bf16 inputs, plus a floor: 1e-4, or 2e-3
    where the op writes bf16 (2^-9 relative rounding) and the reference float32."""
    return 2 * b_err + (2e-3 if rounded_to_bf16 else 1e-4)


def test_probe_reads_the_op():
    traits = cudnn_ops.op_traits(DEV)
    x = torch.randn(7, 2, 64, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEV)
    _, lse, _, _ = cudnn_ops.op_forward(x, x, x, cu, cu, 4, 4, True, 0.125)
    assert tuple(traits.lse.rows(lse).shape) == (2, 7)
    align = "bottom-right" if traits.bottom_right else "top-left"
    print(f"torch {torch.__version__} cuDNN {torch.backends.cudnn.version()}: lse {tuple(lse.shape)} "
          f"strides {lse.stride()} -> {traits.lse}; causal {align}; host ms per repeated call "
          f"{traits.call_ms:.2f}")


def tasks_of(world, seg, chunk):
    tasks = [t for step in build_segment_schedule(world, seg, True).steps for t in step if t is not None]
    tasks += [SpanTask(i, i, a, chunk, 0, True) for i in range(world) for a in (chunk // 3, chunk - 5)]
    tasks.append(SpanTask(0, 0, 0, world * chunk, 0, diagonal=True))  # world 1: the whole rows (chunk n)
    return tasks


def check_tasks(kernel, world, chunk, h, hk, d, layout):
    n = world * chunk
    ref = ReferenceKernel(block_q=1024, block_k=1024)
    failures, splits, fallbacks = [], 0, 0
    docs = dict(layouts(n))[layout]
    seg = Segments(n, docs)
    b = len(docs)
    g = torch.Generator(device=DEV).manual_seed(len(layout) + hk + d)
    q, dout = (torch.randn(b, n, h, d, device=DEV, generator=g, dtype=torch.float64) for _ in "qd")
    k, v = (torch.randn(b, n, hk, d, device=DEV, generator=g, dtype=torch.float64) for _ in "kv")
    lo, hi = key_ranges(seg, causal=True, device=DEV)
    for task in tasks_of(world, seg, chunk):
        ck = n if task.row_stop == n else chunk
        rows = slice(task.q_owner * ck + task.row_start, task.q_owner * ck + task.row_stop)
        key_a, key_b = task.keys(ck)
        keys = slice(task.kv_owner * ck + key_a, task.kv_owner * ck + key_b)
        rng = local_key_range(lo[:, rows], hi[:, rows], keys.start, key_b - key_a)
        blocks = task_doc_blocks(seg, task, ck, True, DEV)
        m = rows.stop - rows.start
        if blocks.num_blocks:
            plan = plan_layout(blocks, cudnn_ops.op_traits(DEV).bottom_right, b, m, key_b - key_a)
            splits += len(plan) > 1
            fallbacks += any(key_range is not None for _, key_range in plan)
        qt, kt, vt, dt = q[:, rows], k[:, keys], v[:, keys], dout[:, rows]
        scale = d ** -0.5
        r_out, r_lse = ref.forward(qt, kt, vt, causal=False, scale=scale, key_range=rng)
        r_grads = ref.backward(dt, qt, kt, vt, r_out, r_lse, causal=False, scale=scale, key_range=rng)
        qb, kb, vb, db = (x.bfloat16().contiguous() for x in (qt, kt, vt, dt))
        b_out, b_lse = ref.forward(qb, kb, vb, causal=False, scale=scale, key_range=rng)
        b_grads = ref.backward(db, qb, kb, vb, b_out, b_lse, causal=False, scale=scale, key_range=rng)
        out, lse = kernel.forward(qb, kb, vb, causal=False, scale=scale, doc_blocks=blocks)
        run_out = torch.zeros(b, m, h, d, device=DEV)
        run_lse = torch.full((b, h, m), float("-inf"), device=DEV)
        half = m // 2
        run_out[:, :half], run_lse[:, :, :half] = r_out[:, :half].float(), r_lse[:, :, :half].float()
        want_out, want_lse = run_out.double().clone(), run_lse.double().clone()
        merge_into(want_out, want_lse, r_out, r_lse)
        kernel.forward(qb, kb, vb, causal=False, scale=scale, out=run_out, lse=run_lse, doc_blocks=blocks)
        dq = torch.ones(b, m, h, d, device=DEV)
        dk, dv = (torch.ones(b, key_b - key_a, hk, d, device=DEV) for _ in "kv")
        kernel.backward(db, qb, kb, vb, r_out.bfloat16(), r_lse.float(), causal=False, scale=scale,
                        dq=dq, dk=dk, dv=dv, doc_blocks=blocks)
        out_err, lse_err = rel_err(b_out, r_out), rel_err(b_lse, r_lse)
        checks = [("out", out, r_out, bound(out_err, True)), ("lse", lse, r_lse, bound(lse_err)),
                  ("merged out", run_out, want_out, bound(out_err, True)),
                  ("merged lse", run_lse, want_lse, bound(lse_err))]
        checks += [(label, x - 1, r, bound(rel_err(bb, r), rounded_to_bf16=True))
                   for label, x, r, bb in zip(("dq", "dk", "dv"), (dq, dk, dv), r_grads, b_grads)]
        for label, x, r, limit in checks:
            err = rel_err(x, r)
            if not err <= limit:
                failures.append(f"[{layout}] {task} {label}: rel err {err:.2e} > {limit:.2e}")
    return failures, splits, fallbacks


CONFIGS = [(2, 2048, 2, 128), (4, 1024, 8, 64), (2, 2048, 8, 128)]
LAYOUT_NAMES = [name for name, _ in layouts(64)]
ONE_TOKEN = "one-token documents, then 37-token ones"


@pytest.mark.parametrize("world,chunk,hk,d,layout",
                         [(*c, name) for name in LAYOUT_NAMES if name != ONE_TOKEN for c in CONFIGS]
                         + [(*c, ONE_TOKEN) for c in CONFIGS])
def test_every_task_bf16_matches_float64_reference(world, chunk, hk, d, layout):
    failures, splits, fallbacks = check_tasks(CudnnVarlenKernel(), world, chunk, 8, hk, d, layout)
    assert not failures, "\n".join(failures[:20])
    if not cudnn_ops.op_traits(DEV).bottom_right and layout != ONE_TOKEN:
        assert splits > 0  # row ranges inside documents ran as square + prefix calls
    if layout == ONE_TOKEN:
        assert fallbacks > 0  # tasks of one-token documents only ran on the fallback kernel
