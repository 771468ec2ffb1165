"""Distributed attention on 1-4 gloo processes against a float64 single-process reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from distributed import rel_err, run_distributed

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def naive_attention(q, k, v, causal):
    """Materialized float64 attention of full sequences; returns (out, lse). Test-only."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
    return out, lse


def make_inputs(seed, batch, seq, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    return q, k, v, dout


def run_attention(q, k, v, dout, *, rank, world, dtype, **kwargs):
    """Shard the full float64 tensors, run dist_flash_attn in ``dtype``; return this rank's results."""
    import lightseq_hf

    n = q.shape[1] // world
    sl = slice(rank * n, (rank + 1) * n)
    qs, ks, vs = (t[:, sl].to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, return_lse=True, **kwargs)
    out.backward(dout[:, sl].to(dtype))
    return out, lse, qs.grad, ks.grad, vs.grad


def cases(lean=False):
    """Every combination; ``lean``: GQA, fp32 and bf16, one odd length (for large worlds)."""
    heads_set, lengths = (("gqa",), (37,)) if lean else (tuple(HEADS), (37, 64))
    for causal, heads, dtype, local in itertools.product(
        (True, False), heads_set, (torch.float32, torch.bfloat16), lengths
    ):
        schedules = ("balanced", "paper", "ring", "pipelined") if causal else ("balanced", "pipelined")
        for schedule in schedules:
            yield dict(causal=causal, heads=heads, dtype=dtype, local=local, schedule=schedule)


def worker_exactness(rank, world, lean=False):
    failures = []
    for i, case in enumerate(cases(lean)):
        h, hk = HEADS[case["heads"]]
        batch = 2 if case["local"] == 37 else 1
        q, k, v, dout = make_inputs(100 + i, batch, case["local"] * world, h, hk, 16)
        ref_out, ref_lse = naive_attention(q, k, v, case["causal"])
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        naive_attention(qr, kr, vr, case["causal"])[0].backward(dout)
        refs = (ref_out, ref_lse, qr.grad, kr.grad, vr.grad)
        n = case["local"]
        sl = slice(rank * n, (rank + 1) * n)
        refs = (refs[0][:, sl], refs[1][:, :, sl], refs[2][:, sl], refs[3][:, sl], refs[4][:, sl])
        kw = dict(causal=case["causal"], schedule=case["schedule"], dtype=case["dtype"])
        got = run_attention(q, k, v, dout, rank=rank, world=world, **kw)
        if case["dtype"] == torch.float32:
            bounds = [1e-5] * 5
        else:  # twice the error of the same attention in bf16 on one process
            single = run_attention(q, k, v, dout, rank=0, world=1, **kw)
            single = (single[0][:, sl], single[1][:, :, sl], single[2][:, sl], single[3][:, sl],
                      single[4][:, sl])
            bounds = [2 * rel_err(s, r) + 1e-6 for s, r in zip(single, refs)]
        for name, x, ref, bound in zip(("out", "lse", "dq", "dk", "dv"), got, refs, bounds):
            err = rel_err(x, ref)
            if not err <= bound:
                failures.append(f"world {world} rank {rank} {case}: {name} rel err {err:.2e} > {bound:.2e}")
            if x.dtype != (torch.float32 if name == "lse" else case["dtype"]):
                failures.append(f"{case}: {name} has dtype {x.dtype}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exact_against_float64_reference(world):
    failures = [f for rank_failures in run_distributed(worker_exactness, world) for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_exact_on_eight_processes():
    """The paper's 8-worker setting (every schedule, causal and not) with a lean case set."""
    failures = [f for rank_failures in run_distributed(worker_exactness, 8, True) for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def worker_bad_inputs(rank, world):
    import lightseq_hf

    failures = []
    q = torch.randn(1, 8 + rank, 4, 16)  # rank 1 holds a longer shard
    try:
        lightseq_hf.dist_flash_attn(q, q, q)
        failures.append(f"rank {rank}: unequal shard lengths were accepted")
    except ValueError as e:
        if "equal-length shard" not in str(e):
            failures.append(f"rank {rank}: unhelpful message {e}")
    q = torch.randn(1, 8, 4, 16)
    out = lightseq_hf.dist_flash_attn(q, q, q)  # the group still works afterwards
    if out.shape != q.shape:
        failures.append("wrong output shape after a refused call")
    return failures


def test_unequal_shards_fail_on_every_rank_without_hanging():
    failures = [f for rank_failures in run_distributed(worker_bad_inputs, 2) for f in rank_failures]
    assert not failures, "\n".join(failures)


def worker_out_only_kernel(rank, world):
    """Kernels that need the output rows in backward (like SDPA) get them, the rows of another rank as a
    stand-in with the same row sums: exact, and the backward sends what it sends for a kernel taking
    delta (the output rows never travel)."""
    from dataclasses import replace

    import lightseq_hf
    from lightseq_hf.kernels import register_backend, unregister_backend
    from lightseq_hf.kernels.reference import ReferenceKernel
    from lightseq_hf.parallel import comm

    stand_ins = []

    class OutOnly(ReferenceKernel):
        name = "out_only"
        capabilities = replace(ReferenceKernel.capabilities, needs_out_in_backward=True)

        def _backward(self, dout, q, k, v, out, lse, mask, *, delta, **kw):
            assert out is not None and delta is None
            # a stand-in is a multiple of dout row by row: |<dout, out>| == |dout| |out|
            cos = (dout * out).sum(-1).abs() / (dout.norm(dim=-1) * out.norm(dim=-1)).clamp_min(1e-300)
            stand_ins.append(bool(torch.allclose(cos, torch.ones_like(cos))))
            return super()._backward(dout, q, k, v, out, lse, mask, delta=delta, **kw)

    register_backend("out_only", OutOnly)
    failures = []
    q, k, v, dout = make_inputs(7, 1, 24 * world, 4, 2, 8)
    refs = naive_attention(q, k, v, True)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    naive_attention(qr, kr, vr, True)[0].backward(dout)
    sl = slice(rank * 24, (rank + 1) * 24)
    sent = {}
    post = comm.PeerComm.post
    for backend in ("out_only", "reference"):
        sent[backend] = 0

        def counting_post(self, transfers, backend=backend):
            sent[backend] += sum(t.numel() * t.element_size() for _, t in transfers.sends)
            return post(self, transfers)

        with pytest.MonkeyPatch.context() as patches:
            patches.setattr(comm.PeerComm, "post", counting_post)
            got = run_attention(q, k, v, dout, rank=rank, world=world, dtype=torch.float64, backend=backend)
        for name, x, ref in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]),
                                (refs[0], qr.grad, kr.grad, vr.grad)):
            if rel_err(x, ref[:, sl]) > 1e-10:
                failures.append(f"rank {rank}: {name} off with backend {backend}")
    if sent["out_only"] != sent["reference"]:
        failures.append(f"rank {rank}: an out-only kernel's run sent {sent['out_only']} bytes, a delta "
                        f"kernel's {sent['reference']}: output rows travelled")
    try:
        qs = q[:, sl].clone().requires_grad_()
        _, lse = lightseq_hf.dist_flash_attn(qs, k[:, sl], v[:, sl], return_lse=True, backend="out_only")
        lse.sum().backward()
        failures.append("an lse gradient through an out-only kernel was accepted")
    except ValueError as e:
        if "lse" not in str(e):
            failures.append(f"unhelpful message: {e}")
    unregister_backend("out_only")
    return failures, stand_ins


def test_kernels_needing_out_in_backward_get_it():
    per_rank = run_distributed(worker_out_only_kernel, 3)
    failures = [f for rank_failures, _ in per_rank for f in rank_failures]
    assert not failures, "\n".join(failures)
    stand_ins = [s for _, rank_stand_ins in per_rank for s in rank_stand_ins]
    assert True in stand_ins, "no task computed another rank's rows: the schedule did not split the work"
    assert False in stand_ins, "no task got its own output rows"


def test_stand_in_output_has_the_row_sums_of_the_output():
    from lightseq_hf.kernels import row_stats

    g = torch.Generator().manual_seed(3)
    dout, out = (torch.randn(2, 10, 4, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout[0, 3, 1] = 0  # a row that receives no gradient
    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(row_stats, "ROW_PASS", 3)  # several passes, the last one short
        delta = row_stats.attention_delta(dout, out)
        stand_in = row_stats.stand_in_output(dout, delta)
    assert torch.allclose(delta, (dout * out).sum(-1).transpose(1, 2), rtol=1e-12, atol=0)
    assert stand_in.shape == dout.shape and stand_in.dtype == dout.dtype
    assert torch.allclose((dout * stand_in).sum(-1).transpose(1, 2), delta, rtol=1e-12, atol=1e-15)
    assert torch.count_nonzero(stand_in[0, 3, 1]) == 0
    # in bf16 the row sums hold to bf16 rounding of the stand-in, relative to delta itself
    bf = dout.bfloat16()
    delta32 = row_stats.attention_delta(bf, out.bfloat16())
    got = (bf.float() * row_stats.stand_in_output(bf, delta32).float()).sum(-1).transpose(1, 2)
    assert ((got - delta32).abs() <= 2**-8 * delta32.abs() + 1e-6).all()
    # gradients far outside the squares' float32 range keep their row sums
    for size in (1e25, 1e-25):
        big = (dout * size).float()
        delta_big = row_stats.attention_delta(big, out.float())
        stand_in = row_stats.stand_in_output(big, delta_big)
        assert torch.isfinite(stand_in).all()
        sums = (big.double() * stand_in.double()).sum(-1).transpose(1, 2)
        assert torch.allclose(sums, delta_big.double(), rtol=1e-5, atol=0), size


def worker_triton_interpreter(rank, world):
    """dist_flash_attn with the Triton kernels (CPU interpreter): accumulate mode and delta in the loop."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    failures = []
    for i, (causal, schedule) in enumerate(((True, "balanced"), (True, "ring"), (False, "balanced"))):
        q, k, v, dout = make_inputs(300 + i, 1, 24 * world, 4, 2, 64)
        ref_out, ref_lse = naive_attention(q, k, v, causal)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        naive_attention(qr, kr, vr, causal)[0].backward(dout)
        sl = slice(rank * 24, (rank + 1) * 24)
        refs = (ref_out[:, sl], ref_lse[:, :, sl], qr.grad[:, sl], kr.grad[:, sl], vr.grad[:, sl])
        got = run_attention(q, k, v, dout, rank=rank, world=world, dtype=torch.float32, causal=causal,
                            schedule=schedule, backend="triton")
        for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), got, refs):
            err = rel_err(x, ref)
            if not err <= 1e-4:
                failures.append(f"rank {rank} causal={causal} {schedule}: {name} rel err {err:.2e}")
    return failures


def test_triton_kernels_in_the_distributed_loop():
    pytest.importorskip("triton", reason="triton is not installed")
    failures = [f for rank_failures in run_distributed(worker_triton_interpreter, 2) for f in rank_failures]
    assert not failures, "\n".join(failures)


def worker_wire_dtypes(rank, world):
    """Record every tensor a rank sends during one bf16 forward+backward."""
    from lightseq_hf.parallel import comm

    sent = []
    post = comm.PeerComm.post

    def recording_post(self, transfers):
        sent.extend((t.dtype, t.dim()) for _, t in transfers.sends)
        return post(self, transfers)

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(comm.PeerComm, "post", recording_post)
        q, k, v, dout = make_inputs(7, 1, 16 * world, 4, 2, 16)
        run_attention(q, k, v, dout, rank=rank, world=world, dtype=torch.bfloat16, causal=True,
                      schedule="balanced")
    return sent


def test_partial_results_travel_in_the_input_dtype():
    """Helpers send their partial outputs and gradients in bf16 (the owner merges them in float32); only
    the lse (3-D) travels in float32 — no 4-D float32 tensor is ever sent."""
    per_rank = run_distributed(worker_wire_dtypes, 4)
    sent = [s for rank_sent in per_rank for s in rank_sent]
    assert sent, "nothing was sent: the schedule did not split the work"
    assert (torch.float32, 4) not in sent, sorted(set(sent), key=str)
    assert {(torch.bfloat16, 4), (torch.float32, 3)} <= set(sent), sorted(set(sent), key=str)
