"""Packed documents on GPUs: every packed backend (Triton with key ranges, FlashAttention-2 varlen, cuDNN
varlen) through ``dist_flash_attn`` on one GPU and on 2 GPUs (NCCL) against a float64 per-document reference;
the Triton document-mask kernels in bf16; attention memory independent of the document count.

Run on a machine with CUDA GPUs: ``python -m pytest tests/gpu/test_packed_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from distributed import rel_err, run_distributed
from packed_cases import (
    PACKED_BACKENDS,
    TINY_LSE,
    attend,
    bound,
    cases,
    inputs,
    random_docs,
    reference,
    unusable,
    worker_packed,
)

from lightseq_hf.kernels import get_kernel
from lightseq_hf.kernels.reference import ReferenceKernel
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range


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


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
def test_dist_flash_attn_one_gpu_packed_matches_float64_reference(backend):
    """Every packed layout through ``dist_flash_attn`` on one GPU in bf16: output, lse and gradients within
    twice the error of the reference kernel on the same bf16 inputs (plus a floor)."""
    dev = torch.device("cuda")
    why = unusable(backend, dev)
    if why:
        pytest.skip(why)
    n, h, hk, d = 4096, 8, 2, 128
    rows = slice(0, n)
    for name, docs, window in cases(backend, n):
        seg = Segments(n, docs)
        q, k, v, dout = inputs(len(docs), n, h, hk, d, 7, dev, tiny_lse=name == TINY_LSE)
        refs = reference(q, k, v, dout, seg, window)
        got = attend(backend, q, k, v, dout, seg, rows, window=window)
        in_bf16 = attend("reference", q, k, v, dout, seg, rows, window=window)
        for label, x, bb, r in zip(("out", "lse", "dq", "dk", "dv"), got, in_bf16, refs):
            err, limit = rel_err(x, r), bound(rel_err(bb, r), rounded_to_bf16=label != "lse")
            assert err <= limit, f"[{backend}, {name}] {label}: rel err {err:.2e} > {limit:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("backend", PACKED_BACKENDS)
def test_packed_distributed_bf16_matches_float64_reference(backend):
    why = unusable(backend, torch.device("cuda"))
    if why:
        pytest.skip(why)
    failures = [f for r in run_distributed(worker_packed, 2, backend, backend="nccl") for f in r]
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
