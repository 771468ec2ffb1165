"""Triton attention kernels in Triton's CPU interpreter (fp32, tiny shapes) against the float64 reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch
from distributed import rel_err

triton = pytest.importorskip("triton", reason="triton is not installed")

from kernel_checks import PoisonEmpty  # noqa: E402

from lightseq_hf._testing.kernel_knobs import triton_kernels  # noqa: E402
from lightseq_hf.kernels import get_kernel, triton_attn  # noqa: E402
from lightseq_hf.kernels.reference import ReferenceKernel  # noqa: E402
from lightseq_hf.kernels.triton_common import bucket  # noqa: E402

if type(triton_kernels()["fwd"].fn).__name__ != "InterpretedFunction":
    pytest.skip(
        "triton kernels were imported outside the interpreter (TRITON_INTERPRET=0)", allow_module_level=True
    )

KERNEL = triton_attn.TritonKernel()
REF = ReferenceKernel(block_q=32, block_k=32)


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every uninitialised floating buffer (``torch.empty``) starts as NaN, so an element the kernels leave
    unwritten fails the test."""
    with PoisonEmpty() as mode:
        yield mode


def test_the_kernels_outputs_start_poisoned(poison_outputs):
    q, k, v = make(1, 8, 8, 2, 1, 64)
    before = poison_outputs.poisoned
    KERNEL.forward(q, k, v, causal=True, scale=1.0)
    assert poison_outputs.poisoned - before >= 2  # out and lse


def make(b, lq, lk, h, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g)
    k = torch.randn(b, lk, hk, d, generator=g)
    v = torch.randn(b, lk, hk, d, generator=g)
    return q, k, v


def check_lse(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "rows with no key must have lse = -inf"
    assert not torch.isnan(got).any()
    fin = torch.isfinite(ref)
    if fin.any():
        assert (got[fin].double() - ref[fin]).abs().max().item() < 1e-5


# (batch, q_len, kv_len, heads, kv_heads, head_dim, causal)
FWD_CASES = [
    (1, 1, 1, 4, 2, 64, True),
    (2, 17, 17, 4, 2, 64, True),
    (1, 100, 100, 4, 2, 80, True),
    (1, 100, 100, 4, 1, 64, False),
    (1, 37, 64, 4, 4, 80, True),  # q shorter than k (bottom-right causal)
    (2, 64, 37, 4, 2, 64, True),  # q longer than k: the first rows see no key
    (1, 64, 37, 4, 1, 80, False),
    (1, 33, 100, 4, 2, 96, False),
    (1, 50, 50, 2, 2, 128, True),
    (1, 5, 70, 4, 1, 64, True),
]


@pytest.mark.parametrize(
    "case", FWD_CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}".format(*c[:6], "causal" if c[6] else "full")
)
def test_forward(case):
    b, lq, lk, h, hk, d, causal = case
    q, k, v = make(b, lq, lk, h, hk, d)
    scale = d**-0.5
    out, lse = KERNEL.forward(q, k, v, causal=causal, scale=scale)
    ref_out, ref_lse = REF.forward(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, lq)
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("order", ["diag_first", "diag_last"])
def test_forward_accumulate_two_chunks(order):
    """Two key chunks accumulated in place equal the reference over the concatenated keys."""
    b, lq, n, h, hk, d = 1, 40, 90, 4, 2, 64
    q, k, v = make(b, lq, n, h, hk, d, seed=1)
    scale = d**-0.5
    split = n - lq  # keys [0, split) are fully visible; [split, n) is the causal diagonal chunk
    chunks = [(k[:, :split], v[:, :split], False), (k[:, split:], v[:, split:], True)]
    if order == "diag_first":
        chunks.reverse()
    out = torch.zeros(b, lq, h, d)
    lse = torch.full((b, h, lq), float("-inf"))
    for kc, vc, causal in chunks:
        got = KERNEL.forward(q, kc, vc, causal=causal, scale=scale, out=out, lse=lse)
        assert got[0] is out and got[1] is lse
    ref_out, ref_lse = REF.forward(q.double(), k.double(), v.double(), causal=True, scale=scale)
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse)


def test_forward_accumulate_unseen_rows():
    """Running rows still at lse = -inf (and rows a chunk does not reach) merge correctly."""
    b, lq, h, hk, d = 2, 40, 4, 1, 80
    q, ka, va = make(b, lq, 25, h, hk, d, seed=2)
    _, kb, vb = make(b, lq, 30, h, hk, d, seed=3)
    scale = d**-0.5
    out = torch.zeros(b, lq, h, d)
    lse = torch.full((b, h, lq), float("-inf"))
    KERNEL.forward(q, ka, va, causal=True, scale=scale, out=out, lse=lse)  # rows 0..14 see nothing
    assert torch.isneginf(lse[:, :, :15]).all() and (out[:, :15] == 0).all()
    KERNEL.forward(q, kb, vb, causal=False, scale=scale, out=out, lse=lse)
    ref_out = torch.zeros(b, lq, h, d, dtype=torch.float64)
    ref_lse = torch.full((b, h, lq), float("-inf"), dtype=torch.float64)
    REF.forward(q.double(), ka.double(), va.double(), causal=True, scale=scale, out=ref_out, lse=ref_lse)
    REF.forward(q.double(), kb.double(), vb.double(), causal=False, scale=scale, out=ref_out, lse=ref_lse)
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse)


BWD_CASES = [
    (1, 1, 1, 4, 2, 64, True),
    (2, 33, 33, 4, 2, 64, True),
    (1, 100, 100, 4, 1, 80, True),
    (1, 45, 45, 4, 2, 80, False),
    (1, 30, 70, 4, 4, 64, True),  # q shorter
    (1, 70, 30, 4, 2, 64, True),  # q longer: rows with no key
    (1, 50, 19, 4, 1, 96, False),
    (1, 40, 40, 2, 1, 128, True),
]


def _ref_backward(q, k, v, do, causal, scale):
    """Global out/lse and gradients in float64."""
    out, lse = REF.forward(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    grads = REF.backward(
        do.double(), q.double(), k.double(), v.double(), out, lse, causal=causal, scale=scale
    )
    return out, lse, grads


@pytest.mark.parametrize(
    "case", BWD_CASES, ids=lambda c: "b{}-q{}-k{}-h{}/{}-d{}-{}".format(*c[:6], "causal" if c[6] else "full")
)
def test_backward(case):
    b, lq, lk, h, hk, d, causal = case
    q, k, v = make(b, lq, lk, h, hk, d, seed=4)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    scale = d**-0.5
    out, lse, ref = _ref_backward(q, k, v, do, causal, scale)
    got = KERNEL.backward(do, q, k, v, out.float(), lse.float(), causal=causal, scale=scale)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        assert rel_err(g, r, floor=1e-2 * g.numel() ** 0.5) < 1e-4, name  # one key: dq is zero


def test_backward_chunks_accumulate_into_buffers():
    """Per-chunk gradients with the global out/lse, added into given buffers, sum to the full gradient."""
    b, lq, n, h, hk, d = 1, 40, 90, 4, 2, 64
    q, k, v = make(b, lq, n, h, hk, d, seed=6)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    scale = d**-0.5
    out, lse, (rdq, rdk, rdv) = _ref_backward(q, k, v, do, True, scale)
    split = n - lq
    base = [torch.randn(b, lq, h, d), torch.randn(b, n, hk, d), torch.randn(b, n, hk, d)]
    dq, dk, dv = (t.clone() for t in base)
    delta = (do.double() * out).sum(-1).transpose(1, 2).float().contiguous()
    for sl, causal, use_delta in ((slice(0, split), False, True), (slice(split, n), True, False)):
        got = KERNEL.backward(
            do,
            q,
            k[:, sl],
            v[:, sl],
            out.float(),
            lse.float(),
            causal=causal,
            scale=scale,
            delta=delta if use_delta else None,
            dq=dq,
            dk=dk[:, sl],
            dv=dv[:, sl],
        )
        assert got[0] is dq
    assert rel_err(dq - base[0], rdq) < 1e-4
    assert rel_err(dk - base[1], rdk) < 1e-4
    assert rel_err(dv - base[2], rdv) < 1e-4


def test_registry_and_buckets():
    assert isinstance(get_kernel("triton", torch.device("cpu")), triton_attn.TritonKernel)
    assert [bucket(n) for n in (1, 16, 17, 100, 4096, 5000)] == [16, 16, 32, 128, 4096, 8192]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d": 48}, "head dims"),
        ({"d": 256}, "head dims"),
        ({"dtype": torch.float64}, "float64"),
        ({"hk": 3}, "multiple of key/value heads"),
        ({"kd": 80}, "head dims disagree"),
    ],
)
def test_bad_inputs(kwargs, match):
    d, hk, dtype = kwargs.get("d", 64), kwargs.get("hk", 2), kwargs.get("dtype", torch.float32)
    q = torch.randn(1, 8, 4, d, dtype=dtype)
    k = torch.randn(1, 8, hk, kwargs.get("kd", d), dtype=dtype)
    with pytest.raises(ValueError, match=match):
        KERNEL.forward(q, k, k.clone(), causal=True, scale=1.0)


def test_bad_buffers_and_device(monkeypatch):
    q, k, v = make(1, 8, 8, 4, 2, 64)
    with pytest.raises(ValueError, match="running out"):
        KERNEL.forward(
            q,
            k,
            v,
            causal=True,
            scale=1.0,
            out=torch.zeros(1, 8, 4, 64, dtype=torch.float16),
            lse=torch.zeros(1, 4, 8),
        )
    with pytest.raises(ValueError, match="both"):
        KERNEL.forward(q, k, v, causal=True, scale=1.0, out=torch.zeros(1, 8, 4, 64))
    with pytest.raises(ValueError, match="dk"):
        KERNEL.backward(
            q,
            q,
            k,
            v,
            q,
            torch.zeros(1, 4, 8),
            causal=True,
            scale=1.0,
            dk=torch.zeros(1, 8, 2, 64, dtype=torch.float16),
            dv=torch.zeros(1, 8, 2, 64),
        )
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        KERNEL.forward(q, k, v, causal=True, scale=1.0)


def test_strided_views_fwd_bwd():
    """q, k, v as views into one packed qkv tensor (no copies): strides are honoured."""
    b, s, h, hk, d = 2, 29, 4, 2, 80
    packed = torch.randn(b, s, h + 2 * hk, d, generator=torch.Generator().manual_seed(8))
    q, k, v = packed[:, :, :h], packed[:, :, h : h + hk], packed[:, :, h + hk :]
    do = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(9))
    scale = d**-0.5
    out, lse = KERNEL.forward(q, k, v, causal=True, scale=scale)
    ref_out, ref_lse, ref = _ref_backward(q, k, v, do, True, scale)
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse)
    got = KERNEL.backward(do, q, k, v, out, lse, causal=True, scale=scale)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-4


# ---------------------------------------------------------------------- document / window masks (key_range)


def _ranges(docs, n, causal=True, window=None):
    from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

    lo, hi = key_ranges(Segments(n, docs), causal=causal, window=window)
    return lo, hi, local_key_range(lo, hi, 0, n)


RANGED_CASES = {  # docs per row of 70 tokens: lengths 1.., padding left/right, an all-padding row
    "packed": ((((0, 1), (1, 19), (19, 52), (52, 53), (53, 70)),), True, None),
    "padding": ((((5, 40),), ((0, 70),), ()), True, None),
    "window": ((((0, 33), (33, 70)),), True, 9),
    "non-causal docs": ((((3, 30), (30, 31), (31, 66)),), False, None),
}


@pytest.mark.parametrize("name", list(RANGED_CASES))
def test_ranged_forward_backward_match_reference(name):
    docs, causal, window = RANGED_CASES[name]
    b, n, h, hk, d = len(docs), 70, 4, 2, 64
    q, k, v = make(b, n, n, h, hk, d, seed=11)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12))
    _, _, rng = _ranges(docs, n, causal, window)
    scale = d**-0.5
    out, lse = KERNEL.forward(q, k, v, causal=False, scale=scale, key_range=rng)
    ref_out, ref_lse = REF.forward(q.double(), k.double(), v.double(), causal=False, scale=scale,
                                   key_range=rng)
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse)
    ref = REF.backward(do.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, causal=False,
                       scale=scale, key_range=rng)
    got = KERNEL.backward(do, q, k, v, ref_out.float(), ref_lse.float(), causal=False, scale=scale,
                          key_range=rng)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-4


def test_ranged_kernels_skip_tiles_nobody_sees():
    """Padding tokens [32, 64) hold NaN in q, k, v and dout: a kernel that loaded them into any step
    (even masked: 0 * NaN) would return NaN. Skipped tiles keep every result finite and exact."""
    n, h, hk, d = 96, 2, 1, 64
    docs = (((0, 32), (64, 96)),)
    q, k, v = make(1, n, n, h, hk, d, seed=13)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(14))
    clean = [t.double().clone() for t in (q, k, v, do)]
    for t in (q, k, v, do):
        t[:, 32:64] = float("nan")
    _, _, rng = _ranges(docs, n)
    out, lse = KERNEL.forward(q, k, v, causal=False, scale=0.125, key_range=rng)
    ref_out, ref_lse = REF.forward(*clean[:3], causal=False, scale=0.125, key_range=rng)
    assert rel_err(out, ref_out) < 1e-5 and (out[:, 32:64] == 0).all()
    check_lse(lse, ref_lse)
    ref = REF.backward(clean[3], *clean[:3], ref_out, ref_lse, causal=False, scale=0.125, key_range=rng)
    got = KERNEL.backward(do, q, k, v, out, lse, causal=False, scale=0.125, key_range=rng)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 1e-4 and (g[:, 32:64] == 0).all()


def test_ranged_chunks_accumulate():
    """Two key chunks with their local ranges, merged in place (forward) and added (backward)."""
    from lightseq_hf.parallel.segments import local_key_range

    n, h, hk, d = 64, 4, 2, 64
    docs = (((0, 20), (20, 45), (45, 64)), ((2, 64),))
    q, k, v = make(2, n, n, h, hk, d, seed=15)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(16))
    lo, hi, rng = _ranges(docs, n, True, 30)
    scale = d**-0.5
    ref_out, ref_lse = REF.forward(q.double(), k.double(), v.double(), causal=False, scale=scale,
                                   key_range=rng)
    ref = REF.backward(do.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, causal=False,
                       scale=scale, key_range=rng)
    out = torch.zeros(2, n, h, d)
    lse = torch.full((2, h, n), float("-inf"))
    dq, dk, dv = torch.zeros(2, n, h, d), torch.zeros(2, n, hk, d), torch.zeros(2, n, hk, d)
    for start in (32, 0):
        part = local_key_range(lo, hi, start, 32)
        sl = slice(start, start + 32)
        KERNEL.forward(q, k[:, sl], v[:, sl], causal=False, scale=scale, out=out, lse=lse, key_range=part)
        KERNEL.backward(do, q, k[:, sl], v[:, sl], ref_out.float(), ref_lse.float(), causal=False,
                        scale=scale, dq=dq, dk=dk[:, sl], dv=dv[:, sl], key_range=part)
    assert rel_err(out, ref_out) < 1e-5
    check_lse(lse, ref_lse)
    for g, r in zip((dq, dk, dv), ref):
        assert rel_err(g, r) < 1e-4


def test_query_ranges_invert_key_ranges():
    lo, hi, (klo, khi) = _ranges((((0, 5), (7, 20)), ((3, 20),)), 20, True, 4)
    q_lo, q_hi = triton_attn.query_ranges(klo, khi, 20)
    rows, cols = torch.arange(20)[:, None], torch.arange(20)[None, :]
    by_rows = (cols >= klo[:, :, None]) & (cols < khi[:, :, None])
    by_cols = (rows >= q_lo[:, None, :]) & (rows < q_hi[:, None, :])
    assert torch.equal(by_rows, by_cols)


@pytest.mark.parametrize("split", [2, 3])
def test_dkdv_split_over_query_rows_matches_reference(split):
    """The dk/dv kernel with each key block's query rows split over programs (partial dk/dv summed after;
    key-range calls only): documents with padding, a window, non-causal documents, and accumulation into
    given buffers."""
    kernel = triton_attn.TritonKernel(dkdv_split=split)
    b, n, h, hk, d = 2, 70, 4, 2, 64
    q, k, v = make(b, n, n, h, hk, d, seed=21)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(22))
    scale = d**-0.5
    docs = (((0, 33), (33, 70)), ((5, 70),))
    masks = ((True, None), (True, 9), (False, None))
    ranges = [_ranges(docs, n, causal, window)[2] for causal, window in masks]
    for causal, key_range in ((False, r) for r in ranges):
        ref_out, ref_lse = REF.forward(q.double(), k.double(), v.double(), causal=causal, scale=scale,
                                       key_range=key_range)
        ref = REF.backward(do.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, causal=causal,
                           scale=scale, key_range=key_range)
        got = kernel.backward(do, q, k, v, ref_out.float(), ref_lse.float(), causal=causal, scale=scale,
                              key_range=key_range)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            assert rel_err(g, r) < 1e-4, (split, name)
        base = [torch.randn(b, n, hk, d, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
        dk, dv = (t.clone() for t in base)
        kernel.backward(do, q, k, v, ref_out.float(), ref_lse.float(), causal=causal, scale=scale,
                        key_range=key_range, dk=dk, dv=dv)
        assert rel_err(dk - base[0], ref[1]) < 1e-4 and rel_err(dv - base[1], ref[2]) < 1e-4


def test_dkdv_split_heuristic():
    sms = 132
    # a whole chunk of keys: enough programs already
    assert triton_attn.dkdv_split(32768, 32768, 8, sms) == 1
    # a long document's 554 keys seen by 20114 rows: 5 key blocks x 8 heads = 40 programs -> 7 parts
    assert triton_attn.dkdv_split(20114, 554, 8, sms) == 7
    # few query rows: no split below 16 query blocks per part
    assert triton_attn.dkdv_split(600, 554, 8, sms) == 1
