"""The flash varlen path on a GPU: torch's real FlashAttention-2 varlen op behind ``flash_varlen``, in bf16,
against a float64 reference (the reference kernel with key ranges, or per document), forward and backward,
several document layouts, GQA; through ``dist_flash_attn`` on one GPU, and on 2 GPUs (NCCL) when present.

Run on a machine with a CUDA GPU: ``python -m pytest tests/gpu/test_varlen_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from distributed import rel_err, run_distributed

from lightseq_hf.kernels import KernelRequest, MaskKind, get_kernel, select_backend
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
    yield "short documents (1-40 tokens)", (random_docs(n, 3, max_len=40),)
    yield "one document", (((0, n),),)
    yield "one document + all-padding row", (((5, n - 7),), ())


def bound(b_err, rounded_to_bf16=False):
    """At most twice the error of the reference kernel on the same bf16 inputs, plus a floor: 1e-4, or 2e-3
    where the op writes bf16 (gradients: 2^-9 relative rounding, ~1.1e-3 rms) and the reference float32."""
    return 2 * b_err + (2e-3 if rounded_to_bf16 else 1e-4)


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


def test_dist_flash_attn_one_gpu_flash_varlen_against_float64_reference():
    import lightseq_hf

    dev = torch.device("cuda")
    n, h, hk, d = 4096, 8, 2, 128
    assert select_backend("flash_varlen", KernelRequest(dev, torch.bfloat16, d, d, MaskKind.DOCUMENTS)) == \
        "flash_varlen"
    ref = ReferenceKernel(block_q=1024, block_k=1024)
    for name, docs in layouts(n):
        g = torch.Generator(device=dev).manual_seed(7)
        b = len(docs)
        q, dout = (torch.randn(b, n, h, d, device=dev, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.float64) for _ in "kv")
        rng = local_key_range(*key_ranges(Segments(n, docs), causal=True, device=dev), 0, n)
        r_out, r_lse = ref.forward(q, k, v, causal=False, scale=d ** -0.5, key_range=rng)
        refs = (r_out, r_lse, *ref.backward(dout, q, k, v, r_out, r_lse, causal=False, scale=d ** -0.5,
                                            key_range=rng))
        results = {}
        for backend in ("flash_varlen", "reference"):  # the reference kernel in bf16 sets the bound
            qs, ks, vs = (t.bfloat16().requires_grad_() for t in (q, k, v))
            out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=Segments(n, docs), backend=backend,
                                                   return_lse=True)
            out.backward(dout.bfloat16())
            results[backend] = (out, lse, qs.grad, ks.grad, vs.grad)
        for label, x, bb, r in zip(("out", "lse", "dq", "dk", "dv"), results["flash_varlen"],
                                   results["reference"], refs):
            err, limit = rel_err(x, r), bound(rel_err(bb, r), rounded_to_bf16=label != "lse")
            assert err <= limit, f"[{name}] {label}: rel err {err:.2e} > {limit:.2e}"


def worker_varlen(rank, world):
    import lightseq_hf

    dev = torch.device("cuda", rank)
    failures = []
    n, h, hk, d = 4096 * world, 8, 2, 128
    solo = [torch.distributed.new_group([r]) for r in range(world)][rank]
    for i, (name, docs) in enumerate(layouts(n)):
        seg = Segments(n, docs)
        b = len(docs)
        g = torch.Generator(device=dev).manual_seed(20 + i)
        q, dout = (torch.randn(b, n, h, d, device=dev, generator=g, dtype=torch.float64) for _ in "qd")
        k, v = (torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.float64) for _ in "kv")
        lo, hi = key_ranges(seg, causal=True, device=dev)
        rng = local_key_range(lo, hi, 0, n)
        ref = ReferenceKernel(block_q=1024, block_k=1024)
        r_out, r_lse = ref.forward(q, k, v, causal=False, scale=d ** -0.5, key_range=rng)
        r_grads = ref.backward(dout, q, k, v, r_out, r_lse, causal=False, scale=d ** -0.5, key_range=rng)
        loc = slice(rank * n // world, (rank + 1) * n // world)
        refs = [r_out[:, loc], r_lse[:, :, loc]] + [x[:, loc] for x in r_grads]

        def run(a, z, group, seg=seg, q=q, k=k, v=v, dout=dout):
            qs, ks, vs = (t[:, a:z].bfloat16().requires_grad_() for t in (q, k, v))
            out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=seg, backend="flash_varlen",
                                                   return_lse=True, group=group)
            out.backward(dout[:, a:z].bfloat16())
            return [out, lse, qs.grad, ks.grad, vs.grad]

        got = run(loc.start, loc.stop, None)
        single = [x[:, loc] if x.dim() == 4 else x[:, :, loc] for x in run(0, n, solo)]
        for label, x, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, refs):
            err, limit = rel_err(x, r), 2 * rel_err(s, r) + 1e-4
            if not err <= limit:
                failures.append(f"[{name}] rank {rank}: {label} rel err {err:.2e} > {limit:.2e}")
    return failures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_packed_distributed_flash_varlen_bf16_matches_float64_reference():
    failures = [f for r in run_distributed(worker_varlen, 2, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)
