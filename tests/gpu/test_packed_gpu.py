"""Packed documents on GPUs: the Triton document-mask kernels (bf16) and the distributed attention on 2
GPUs (NCCL) against a float64 per-document reference; attention memory independent of the document count.

Run on a machine with CUDA GPUs: ``python -m pytest tests/gpu/test_packed_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from distributed import rel_err, run_distributed

from lightseq_hf.kernels import get_kernel
from lightseq_hf.kernels.reference import ReferenceKernel
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range


def random_docs(n, seed, *, pad=False):
    g = torch.Generator().manual_seed(seed)
    t, docs = (37 if pad else 0), []
    end = n - (53 if pad else 0)
    while t < end:
        size = int(torch.randint(1, 1500, (1,), generator=g))
        docs.append((t, min(end, t + size)))
        t += size
    return tuple(docs)


@pytest.mark.parametrize("window", [None, 700])
def test_triton_ranged_kernel_bf16_error_at_most_twice_the_reference_kernel_in_bf16(window):
    dev = torch.device("cuda")
    n, h, hk, d = 4096, 8, 2, 128
    seg = Segments(n, (random_docs(n, 1), random_docs(n, 2, pad=True)))
    lo, hi = key_ranges(seg, causal=True, window=window, device=dev)
    rng = local_key_range(lo, hi, 0, n)
    g = torch.Generator(device=dev).manual_seed(3)
    q, dout = (torch.randn(2, n, h, d, device=dev, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, n, hk, d, device=dev, generator=g, dtype=torch.float64) for _ in range(2))
    ref = ReferenceKernel(block_q=1024, block_k=1024)
    r_out, r_lse = ref.forward(q, k, v, causal=False, scale=d ** -0.5, key_range=rng)
    r_grads = ref.backward(dout, q, k, v, r_out, r_lse, causal=False, scale=d ** -0.5, key_range=rng)
    qb, kb, vb, db = (t.bfloat16() for t in (q, k, v, dout))
    tri = get_kernel("triton", dev)
    out, lse = tri.forward(qb, kb, vb, causal=False, scale=d ** -0.5, key_range=rng)
    grads = tri.backward(db, qb, kb, vb, out, lse, causal=False, scale=d ** -0.5, key_range=rng)
    b_out, b_lse = ref.forward(qb, kb, vb, causal=False, scale=d ** -0.5, key_range=rng)
    b_grads = ref.backward(db, qb, kb, vb, b_out, b_lse, causal=False, scale=d ** -0.5, key_range=rng)
    assert rel_err(out, r_out) <= 2 * rel_err(b_out, r_out) + 1e-4
    assert rel_err(lse, r_lse) <= 2 * rel_err(b_lse, r_lse) + 1e-5
    for g_, r, b in zip(grads, r_grads, b_grads):
        assert rel_err(g_, r) <= 2 * rel_err(b, r) + 1e-4


def worker_packed(rank, world):
    import lightseq_hf

    dev = torch.device("cuda", rank)
    failures = []
    n, h, hk, d = 4096 * world, 8, 2, 128
    solo = [torch.distributed.new_group([r]) for r in range(world)][rank]
    for i, (docs, window) in enumerate((((random_docs(n, 5),), None), ((random_docs(n, 6, pad=True),), 900),
                                        ((((0, n),),), None))):
        seg = Segments(n, docs)
        g = torch.Generator(device=dev).manual_seed(10 + i)
        q, dout = (torch.randn(1, n, h, d, device=dev, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(1, n, hk, d, device=dev, generator=g, dtype=torch.float64) for _ in range(2))
        lo, hi = key_ranges(seg, causal=True, window=window, device=dev)
        rng = local_key_range(lo, hi, 0, n)
        ref = ReferenceKernel(block_q=1024, block_k=1024)
        r_out, r_lse = ref.forward(q, k, v, causal=False, scale=d ** -0.5, key_range=rng)
        r_grads = ref.backward(dout, q, k, v, r_out, r_lse, causal=False, scale=d ** -0.5, key_range=rng)
        loc = slice(rank * n // world, (rank + 1) * n // world)
        refs = [r_out[:, loc], r_lse[:, :, loc]] + [x[:, loc] for x in r_grads]

        def run(a, b, group, seg=seg, window=window, q=q, k=k, v=v, dout=dout):
            qs, ks, vs = (t[:, a:b].bfloat16().requires_grad_() for t in (q, k, v))
            out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=seg, window=window, backend="triton",
                                                   return_lse=True, group=group)
            out.backward(dout[:, a:b].bfloat16())
            return [out, lse, qs.grad, ks.grad, vs.grad]

        got = run(loc.start, loc.stop, None)
        single = [x[:, loc] if x.dim() == 4 else x[:, :, loc] for x in run(0, n, solo)]
        for name, x, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, refs):
            err, bound = rel_err(x, r), 2 * rel_err(s, r) + 1e-4
            if not err <= bound:
                failures.append(f"case {i} rank {rank}: {name} rel err {err:.2e} > {bound:.2e}")
    return failures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_packed_distributed_bf16_matches_float64_reference():
    failures = [f for r in run_distributed(worker_packed, 2, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)


def worker_memory(rank, world):
    """Peak memory of the packed attention does not grow with the number of documents: never above the
    one-document case (which holds one remote key/value shard and one prefetch buffer)."""
    import lightseq_hf

    dev = torch.device("cuda", rank)
    n, h, hk, d = 32768 * world, 16, 4, 128
    peaks = []
    for doc_len in (n, 8192, 512, 64):
        seg = Segments(n, (tuple((t, min(n, t + doc_len)) for t in range(0, n, doc_len)),))
        g = torch.Generator(device=dev).manual_seed(1)
        opts = dict(device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
        q = torch.randn(1, n // world, h, d, **opts)
        k, v = (torch.randn(1, n // world, hk, d, **opts) for _ in range(2))
        lightseq_hf.dist_flash_attn(q, k, v, segments=seg, backend="triton").sum().backward()  # warm-up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lightseq_hf.dist_flash_attn(q, k, v, segments=seg, backend="triton").sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    if max(peaks[1:]) > 1.1 * peaks[0]:
        return [f"rank {rank}: attention peak memory grows with the document count: {peaks}"]
    return []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_packed_attention_memory_independent_of_document_count():
    failures = [f for r in run_distributed(worker_memory, 2, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)


def test_triton_nan_stays_in_its_document_bf16():
    """A NaN in one document's value and in a padding token's q/k/v/dout: the other documents' outputs,
    lse and gradients are bit-identical to those of the clean inputs, padding rows stay 0, and the rows
    that see the NaN value output NaN."""
    dev = torch.device("cuda")
    n, h, hk, d = 4096, 8, 2, 128
    docs = (random_docs(n, 1), random_docs(n, 2, pad=True))
    lo, hi = key_ranges(Segments(n, docs), causal=True, device=dev)
    rng = local_key_range(lo, hi, 0, n)
    g = torch.Generator(device=dev).manual_seed(4)
    q, dout = (torch.randn(2, n, h, d, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, n, hk, d, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    start, end = docs[0][3]
    assert end - start > 2
    dirty = [t.clone() for t in (q, k, v, dout)]
    dirty[2][0, start + 1] = float("nan")  # a value of document 3 of row 0
    for t in dirty:
        t[1, 10] = float("nan")  # a padding token of row 1
    tri = get_kernel("triton", dev)
    results = []
    for q_, k_, v_, d_ in ((q, k, v, dout), dirty):
        out, lse = tri.forward(q_, k_, v_, causal=False, scale=d ** -0.5, key_range=rng)
        grads = tri.backward(d_, q_, k_, v_, out, lse, causal=False, scale=d ** -0.5, key_range=rng)
        results.append((out, lse.transpose(1, 2), *grads))
    other = torch.ones(2, n, dtype=torch.bool, device=dev)
    other[0, start:end] = False
    for name, clean, got in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(clean[other], got[other]), f"{name} of other documents or padding changed"
    assert torch.isnan(results[1][0][0, start + 1:end]).all()
    assert (results[1][0][1, :37] == 0).all() and all((t[1, :37] == 0).all() for t in results[1][2:])
