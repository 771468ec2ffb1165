"""Distributed attention on 2 GPUs (NCCL): bf16 against a float64 reference, and peak memory.

Run on a machine with at least 2 GPUs: ``python -m pytest tests/gpu/test_dist_gpu.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

from distributed import rel_err, run_distributed

BACKENDS = ["sdpa_cudnn", "sdpa_flash", "triton"]
WORLD = 2


def _backend_available(name):
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
    return True


def worker_exactness(rank, world, backends):
    import lightseq_hf
    from lightseq_hf.kernels.reference import ReferenceKernel

    dev = torch.device("cuda", rank)
    ref_kernel = ReferenceKernel(block_q=1024, block_k=1024)
    failures = []
    solo_groups = [torch.distributed.new_group([r]) for r in range(world)]  # collective: all ranks
    cases = itertools.product(backends, (True, False), ((16, 16), (16, 4)), ("balanced", "paper", "ring"))
    for i, (backend, causal, (h, hk), schedule) in enumerate(cases):
        if not causal and schedule != "balanced":
            continue
        g = torch.Generator(device=dev).manual_seed(i)
        n, d = 2048 * world, 128
        q = torch.randn(1, n, h, d, device=dev, generator=g, dtype=torch.float64)
        k = torch.randn(1, n, hk, d, device=dev, generator=g, dtype=torch.float64)
        v = torch.randn(1, n, hk, d, device=dev, generator=g, dtype=torch.float64)
        dout = torch.randn(1, n, h, d, device=dev, generator=g, dtype=torch.float64)
        scale = d ** -0.5
        ref_out, ref_lse = ref_kernel.forward(q, k, v, causal=causal, scale=scale)
        ref_grads = ref_kernel.backward(dout, q, k, v, ref_out, ref_lse, causal=causal, scale=scale)
        loc = slice(rank * n // world, (rank + 1) * n // world)
        refs = [ref_out[:, loc], ref_lse[:, :, loc]] + [x[:, loc] for x in ref_grads]

        def run(lo, hi, group):
            qs, ks, vs = (t[:, lo:hi].bfloat16().requires_grad_() for t in (q, k, v))
            out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, causal=causal, schedule=schedule,
                                                   backend=backend, return_lse=True, group=group)
            out.backward(dout[:, lo:hi].bfloat16())
            return [out, lse, qs.grad, ks.grad, vs.grad]

        try:
            got = run(loc.start, loc.stop, None)
            single = run(0, n, solo_groups[rank])  # the same attention on one process
        except Exception as err:  # noqa: BLE001 - both ranks fail alike; keep checking the rest
            failures.append(f"{backend} causal={causal} heads={h}/{hk} {schedule}: raised {err!r}")
            continue
        single = [single[0][:, loc], single[1][:, :, loc]] + [x[:, loc] for x in single[2:]]
        for name, x, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, refs):
            err, bound = rel_err(x, r), 2 * rel_err(s, r) + 1e-6
            if not err <= bound:
                failures.append(f"{backend} causal={causal} heads={h}/{hk} {schedule}: {name} "
                                f"{err:.2e} > {bound:.2e}")
    return failures


def test_bf16_distributed_matches_float64_reference():
    backends = [b for b in BACKENDS if _backend_available(b)]
    failures = [f for r in run_distributed(worker_exactness, WORLD, backends, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)


def worker_peak_memory(rank, world):
    import lightseq_hf

    dev = torch.device("cuda", rank)
    b, n, h, d = 1, 16384, 32, 128
    q = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lightseq_hf.dist_flash_attn(q, k, v, backend="sdpa_cudnn")  # warm-up: NCCL buffers, handles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = lightseq_hf.dist_flash_attn(q, k, v, backend="sdpa_cudnn")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - base
    chunk = q.numel() * q.element_size()  # one bf16 q (= k = v) chunk
    # running fp32 out (2 chunks) + a helper's fp32 partial (1) + one remote k/v pair (2)
    # + one prefetched k/v pair or query rows (2) + the bf16 output (1) + merge temporaries (2)
    bound = 10 * chunk
    del out
    return [] if peak <= bound else [f"rank {rank}: peak {peak / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"]


def test_peak_memory_holds_at_most_one_remote_chunk_and_one_prefetch():
    failures = [f for r in run_distributed(worker_peak_memory, WORLD, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)



def worker_gather_sequence(rank, world):
    from test_clients import check_gather_sequence

    return check_gather_sequence(rank, world, torch.device("cuda", rank))  # NCCL: reduce-scatter backward


def test_gather_sequence_nccl():
    failures = [f for r in run_distributed(worker_gather_sequence, WORLD, backend="nccl") for f in r]
    assert not failures, "\n".join(failures)
