"""The kernel contract, checked on every registered backend on the CPU.

Each backend runs every mask kind its capabilities declare (and softcap / a value head dim of its own where
declared) against a dense float64 attention written here: forward out and lse, backward dq/dk/dv, merging
into a running result and adding into given gradients. Backends whose ops need a GPU run with those ops
emulated in float64 (torch's SDPA ops below, the varlen ops in ``varlen_emulation``, the
nvidia-cudnn-frontend ops in ``cudnn_fe_emulation``), Triton in its CPU
interpreter on tiny float32 shapes. What a backend does not declare is refused by name, by the kernel and
by the selection. A toy backend registered here shows that a new backend is one class plus one table row.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from cudnn_fe_emulation import install as install_cudnn_fe  # noqa: E402
from doc_reference import random_docs  # noqa: E402
from varlen_emulation import install as install_varlen  # noqa: E402

from lightseq_hf.kernels import (  # noqa: E402
    REGISTRY,
    Capabilities,
    KernelBase,
    KernelRequest,
    MaskKind,
    Row,
    backend_names,
    kernel_named,
    register_backend,
    select_backend,
    unregister_backend,
)
from lightseq_hf.kernels import sdpa as sdpa_module  # noqa: E402
from lightseq_hf.kernels.row_stats import attention_delta, merge_into  # noqa: E402
from lightseq_hf.kernels.varlen.rows import make_doc_blocks  # noqa: E402
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range  # noqa: E402

B, N, H, HK, D = 2, 24, 4, 2, 64
BUILT_IN = ("reference", "triton", "sdpa_cudnn", "sdpa_flash", "flash_varlen", "cudnn_fe")


# --- emulations of the GPU-only ops -------------------------------------------------------------------

def _sdpa_forward(flavor, qt, kt, vt, causal, scale):
    """torch's fused SDPA ops in float64: ``(batch, heads, seq, dim)``, causal aligned top-left (the kernel
    only asks for equal lengths), GQA key/value heads read in place, cuDNN's lse with a trailing 1."""
    group = qt.shape[1] // kt.shape[1]
    kt, vt = (t.double().repeat_interleave(group, 1) for t in (kt, vt))
    s = torch.einsum("bhqd,bhkd->bhqk", qt.double(), kt) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), vt).to(qt.dtype)
    return out, (lse.float().unsqueeze(-1) if flavor == "cudnn" else lse.float())


def _sdpa_backward(flavor, dot, qt, kt, vt, ot, lse, causal, scale):
    """The ops' backward in float64; a GQA key/value head's gradient summed over its group."""
    b, hk, lk, d = kt.shape
    group = qt.shape[1] // hk
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (kt, vt))
    s = torch.einsum("bhqd,bhkd->bhqk", qt.double(), k64) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - lse.double().reshape(s.shape[:-1])[..., None])
    do = dot.double()
    dv = torch.einsum("bhqk,bhqd->bhkd", p, do)
    delta = (do * ot.double()).sum(-1, keepdim=True)
    ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, v64) - delta) * scale
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, k64)
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, qt.double())
    dk, dv = (g.reshape(b, hk, group, lk, d).sum(2) for g in (dk, dv))
    return tuple(g.to(qt.dtype) for g in (dq, dk, dv))


def _widened(caps: Capabilities) -> Capabilities:
    return replace(caps, devices=None, dtypes=caps.dtypes | {torch.float32, torch.float64})


@pytest.fixture(autouse=True)
def emulated_gpu_ops(monkeypatch):
    """The SDPA, varlen and cuDNN frontend ops emulated on the CPU; their backends' device and dtype
    capabilities widened to what the emulations take (float32/float64 on any device)."""
    monkeypatch.setattr(sdpa_module, "sdpa_forward", _sdpa_forward)
    monkeypatch.setattr(sdpa_module, "sdpa_backward", _sdpa_backward)
    monkeypatch.setattr(sdpa_module.SdpaKernel, "capabilities", _widened(sdpa_module.SdpaKernel.capabilities))
    install_varlen(setattr_=monkeypatch.setattr)
    install_cudnn_fe(setattr_=monkeypatch.setattr)


# --- the dense float64 reference ----------------------------------------------------------------------

def _visible(call: dict, b: int, lq: int, lk: int) -> torch.Tensor:
    """``(batch, lq, lk)``: which keys each query row sees under the kernel keywords of ``call``."""
    rows, cols = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    if call.get("key_range") is not None:
        lo, hi = call["key_range"]
        return (cols[None] >= lo[..., None].long()) & (cols[None] < hi[..., None].long())
    if call.get("doc_blocks") is not None:
        blocks, seen = call["doc_blocks"], torch.zeros(b * lq, b * lk, dtype=torch.bool)
        q_idx = torch.arange(b * lq)[blocks.q_rows] if isinstance(blocks.q_rows, slice) else blocks.q_rows
        k_idx = torch.arange(b * lk)[blocks.k_rows] if isinstance(blocks.k_rows, slice) else blocks.k_rows
        qa = ka = 0
        for m, n in zip(blocks.q_lens, blocks.k_lens):
            i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
            inside = (j <= i + n - m) if blocks.causal else torch.ones(m, n, dtype=torch.bool)
            seen[q_idx[qa:qa + m, None], k_idx[None, ka:ka + n]] = inside
            qa, ka = qa + m, ka + n
        return seen.view(b, lq, b, lk)[torch.arange(b), :, torch.arange(b)]
    if call.get("causal"):
        return (cols <= rows + lk - lq).expand(b, lq, lk)
    return torch.ones(b, lq, lk, dtype=torch.bool)


def dense_attention(q, k, v, call: dict, scale: float):
    """float64 ``(out, lse)`` with autograd: rows that see no key give out 0 and lse -inf."""
    group = q.shape[2] // k.shape[2]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if call.get("softcap") is not None:
        s = call["softcap"] * torch.tanh(s / call["softcap"])
    vis = _visible(call, q.shape[0], q.shape[1], k.shape[1])[:, None]
    s = s.masked_fill(~vis, -1e30)  # finite: rows with no key stay NaN-free, and are zeroed below
    any_key = vis.any(-1)
    lse = torch.where(any_key, torch.logsumexp(s, -1), -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1) * any_key[..., None], v64)
    return out, lse


# --- the calls a backend declares ---------------------------------------------------------------------

def _docs(n: int):
    gen = torch.Generator().manual_seed(3)
    padded = random_docs(gen, 1, n, pad_left=True, pad_right=True, max_len=9)[0]
    return random_docs(gen, 1, n, max_len=10)[0], padded


def _blocks_for(docs, b: int, n: int, causal: bool):
    """Doc blocks of one local call covering whole rows (each document one block)."""
    q_lens, rows = [], []
    for r, row in enumerate(docs):
        for start, stop in row:
            q_lens.append(stop - start)
            rows.extend(range(r * n + start, r * n + stop))
    return make_doc_blocks(tuple(q_lens), tuple(q_lens), rows, rows, causal, "cpu")


def _ranges(docs, window: int | None = None):
    """int32 key ranges of one local call covering whole rows (every document causal)."""
    return local_key_range(*key_ranges(Segments(N, docs), causal=True, window=window), 0, N)


def declared_calls(caps: Capabilities) -> list[tuple[str, dict, int, int]]:
    """``(label, mask keywords, kv_len, value dim)`` for every mask kind (and representation) ``caps``
    declares, with softcap and a value head dim of its own where declared."""
    docs = _docs(N)
    calls = [("causal", {"causal": True}, N, D), ("full, more keys", {"causal": False}, N + 8, D)]
    if caps.supports_key_range:
        calls.append(("documents as key_range", {"causal": False, "key_range": _ranges(docs)}, N, D))
    if caps.supports_doc_blocks:
        blocks = _blocks_for(docs, B, N, True)
        calls.append(("documents as doc_blocks", {"causal": False, "doc_blocks": blocks}, N, D))
    if caps.supports_window:
        calls.append(("window", {"causal": False, "key_range": _ranges(docs, 4), "window": 4}, N, D))
    if caps.supports_softcap:
        calls += [(f"{label}, softcap", {**kw, "softcap": 3.0}, lk, dv) for label, kw, lk, dv in list(calls)]
    if caps.supports_value_head_dim:
        calls += [(f"{label}, value dim 32", kw, lk, 32) for label, kw, lk, dv in calls[:3]]
    return calls


def _inputs(lk: int, dv: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, lk, HK, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, lk, HK, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, N, H, dv, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "rows with no key must have lse -inf"
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all(), "non-finite values where the reference is finite"
    return ((got[fin] - want[fin]).norm() / want[fin].norm().clamp_min(1e-6)).item()


def _dtype_and_tolerance(kernel) -> tuple[torch.dtype, float]:
    if kernel.name.startswith("sdpa"):
        return torch.float64, 1e-6  # torch's SDPA ops hand back a float32 lse (the emulation too)
    if torch.float64 in kernel.capabilities.dtypes:
        return torch.float64, 1e-10
    return torch.float32, 2e-4  # the Triton kernels in the interpreter


def check_backend(kernel) -> list[str]:
    """Every declared call of ``kernel`` against :func:`dense_attention`; the failures."""
    failures = []
    dtype, tol = _dtype_and_tolerance(kernel)
    needs_out = kernel.capabilities.needs_out_in_backward
    for i, (label, call, lk, dv) in enumerate(declared_calls(kernel.capabilities)):
        q, k, v, dout = _inputs(lk, dv, dtype, seed=i)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        scale = 0.3
        ref_out, ref_lse = dense_attention(*leaves, call, scale)
        ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
        out, lse = kernel.forward(q, k, v, scale=scale, **call)
        g_out, g_lse = ref_out.detach().to(dtype), ref_lse.detach().to(lse.dtype)
        delta = None if needs_out else attention_delta(dout, g_out)
        grads = kernel.backward(dout, q, k, v, g_out, g_lse, scale=scale, delta=delta, **call)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse,
                                                                                          *ref_grads)):
            err = _err(got, want)
            if not err <= tol:
                failures.append(f"{kernel.name} [{label}]: {name} rel err {err:.2e}")
    return failures + check_accumulation(kernel, dtype, tol)


def check_accumulation(kernel, dtype: torch.dtype, tol: float) -> list[str]:
    """Two key chunks merged into a running (out, lse); gradients added into given buffers."""
    failures = []
    q, k, v, dout = _inputs(N, D, dtype, seed=99)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_attention(*leaves, {"causal": False}, 0.3)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    run_out = torch.zeros(B, N, H, D, dtype=acc)
    run_lse = torch.full((B, H, N), -math.inf, dtype=acc)
    bases = [torch.randn(t.shape, generator=torch.Generator().manual_seed(s), dtype=acc)
             for s, t in zip((1, 2, 3), (q, k, v))]
    grads = [t.clone() for t in bases]
    g_out, g_lse = ref_out.detach().to(dtype), ref_lse.detach().to(acc)
    delta = None if kernel.capabilities.needs_out_in_backward else attention_delta(dout, g_out)
    for part in (slice(0, N // 2), slice(N // 2, N)):
        kernel.forward(q, k[:, part], v[:, part], causal=False, scale=0.3, out=run_out, lse=run_lse)
        dk, dv = grads[1][:, part], grads[2][:, part]
        kernel.backward(dout, q, k[:, part], v[:, part], g_out, g_lse, causal=False, scale=0.3, delta=delta,
                        dq=grads[0], dk=dk, dv=dv)
    for name, got, want in (("merged out", run_out, ref_out), ("merged lse", run_lse, ref_lse),
                            *((f"added d{n}", g - base, r) for n, g, base, r in zip("qkv", grads, bases,
                                                                                      ref_grads))):
        err = _err(got, want)
        if not err <= tol:
            failures.append(f"{kernel.name} [accumulate]: {name} rel err {err:.2e}")
    return failures


# --- the tests ----------------------------------------------------------------------------------------

def test_every_backend_is_covered():
    """A registered backend this file does not know would go unchecked: name it here when adding it."""
    assert set(REGISTRY) == set(BUILT_IN)
    assert set(backend_names()) == {"auto", "sdpa", *BUILT_IN}


@pytest.mark.parametrize("name", BUILT_IN)
def test_backend_against_dense_float64(name):
    kernel = kernel_named(name)
    assert isinstance(kernel, KernelBase) and isinstance(kernel.capabilities, Capabilities)
    failures = check_backend(kernel)
    assert not failures, "\n".join(failures)


def refused_calls(caps: Capabilities) -> list[tuple[str, dict, int, str, MaskKind]]:
    """``(label, keywords, value dim, expected words, mask kind)`` for what ``caps`` does not declare."""
    docs = _docs(N)
    lo, hi = _ranges(docs)
    wlo, whi = _ranges(docs, 4)
    other = "packed documents and padding"
    candidates = [
        (not caps.supports_key_range, "key_range", {"causal": False, "key_range": (lo, hi)}, D,
         "key_range masks" if caps.supports_doc_blocks else other, MaskKind.DOCUMENTS),
        (not caps.supports_doc_blocks, "doc_blocks",
         {"causal": False, "doc_blocks": _blocks_for(docs, B, N, True)}, D,
         "doc_blocks" if caps.supports_key_range else other, MaskKind.DOCUMENTS),
        (not caps.supports_window, "window", {"causal": False, "key_range": (wlo, whi), "window": 4}, D,
         "sliding windows", MaskKind.WINDOW),
        (not caps.supports_softcap, "softcap", {"causal": True, "softcap": 3.0}, D, "logit soft-capping",
         MaskKind.CAUSAL),
        (not caps.supports_value_head_dim, "value head dim", {"causal": True}, 32,
         "equal query/key and value head dims", MaskKind.CAUSAL),
    ]
    return [c[1:] for c in candidates if c[0]]


@pytest.mark.parametrize("name", BUILT_IN)
def test_undeclared_masks_are_refused_by_name(name):
    """By the kernel (forward and backward) and, where the mask kind itself is undeclared, by the selection:
    explicitly asked for, it is refused; ``auto`` never picks it."""
    kernel = kernel_named(name)
    dtype, _ = _dtype_and_tolerance(kernel)
    refused = refused_calls(kernel.capabilities)
    assert refused or name == "reference"
    for label, call, dv, words, kind in refused:
        q, k, v, dout = _inputs(N, dv, dtype, seed=0)
        for run in (lambda: kernel.forward(q, k, v, scale=0.3, **call),
                    lambda: kernel.backward(dout, q, k, v, dout, torch.zeros(B, H, N), scale=0.3, **call)):
            with pytest.raises(ValueError, match=rf"backend '{name}' .*{words}.*; use backend="):
                run()
        request = KernelRequest(q.device, dtype, D, dv, kind, "softcap" in call)
        if kernel.capabilities.refusal(request) is not None:  # not just another representation
            with pytest.raises(ValueError, match=rf"backend '{name}' .*{words}"):
                select_backend(name, request)
            assert select_backend("auto", request) != name, label


class ToyKernel(KernelBase):
    """A new backend as a contributor would add it: dense attention in plain PyTorch, plain rows only."""

    name = "toy"
    capabilities = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float64}))
    calls = 0

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        ToyKernel.calls += 1
        part_out, part_lse = (x.detach() for x in dense_attention(q, k, v, mask.keywords(), scale))
        if out is None:
            return part_out, part_lse
        merge_into(out, lse, part_out, part_lse)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        """From the rows' global ``lse`` and ``delta``, as the contract asks (chunk gradients add up)."""
        group = q.shape[2] // k.shape[2]
        k64, v64 = (t.double().repeat_interleave(group, 2) for t in (k, v))
        vis = _visible(mask.keywords(), q.shape[0], q.shape[1], k.shape[1])[:, None]
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k64) * scale
        p = torch.where(vis, torch.exp(s - lse.double()[..., None]), 0.0)
        delta = attention_delta(dout, out) if delta is None else delta
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout.double(), v64) - delta.double()[..., None]) * scale
        b, lk, hk = k.shape[0], k.shape[1], k.shape[2]
        got = (torch.einsum("bhqk,bkhd->bqhd", ds, k64),
               torch.einsum("bhqk,bqhd->bkhd", ds, q.double()).view(b, lk, hk, group, -1).sum(3),
               torch.einsum("bhqk,bqhd->bkhd", p, dout.double()).view(b, lk, hk, group, -1).sum(3))
        for given, g in zip((dq, dk, dv), got):
            if given is not None:
                given += g
        return tuple(g if given is None else given for given, g in zip((dq, dk, dv), got))


def test_a_new_backend_is_one_class_and_one_table_row():
    import lightseq_hf

    cpu = torch.device("cpu")
    register_backend("toy", ToyKernel, rows=(Row("toy", "cpu", evidence="a test"),))
    try:
        assert not check_backend(kernel_named("toy"))
        plain = KernelRequest(cpu, torch.float64, 8, 8, MaskKind.CAUSAL)
        assert select_backend("auto", plain) == "toy"  # its row comes first
        for refused in (replace(plain, mask=MaskKind.DOCUMENTS), replace(plain, softcap=True),
                        replace(plain, dtype=torch.float32)):
            assert select_backend("auto", refused) == "reference"  # the row matches, the capabilities do not
        q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        before = ToyKernel.calls
        out = lightseq_hf.dist_flash_attn(q, k, v)
        out.sum().backward()
        assert ToyKernel.calls == before + 1
        want = dense_attention(q, k, v, {"causal": True}, 8 ** -0.5)[0]
        assert (out - want).abs().max() < 1e-12
        with pytest.raises(ValueError, match="backend 'toy' does not take packed documents and padding"):
            lightseq_hf.dist_flash_attn(q, k, v, backend="toy", cu_seqlens=[0, 5, 16])
    finally:
        unregister_backend("toy")
    assert select_backend("auto", KernelRequest(cpu, torch.float64, 8, 8)) == "reference"
    assert "toy" not in backend_names()


def _nan_containment_failures(kernel) -> list[str]:
    """A NaN in one document's values and in a padding token's q/k/v/dout (one call over packed documents,
    in every representation the backend takes): the other documents' outputs and gradients equal those of
    the clean inputs, the padding rows stay out 0 / gradient 0, and the rows that see the NaN value output
    NaN (never a finite wrong value)."""
    dtype, _ = _dtype_and_tolerance(kernel)
    docs = (((0, 7), (7, 18)), ((1, 20),))  # right padding in both rows, left padding in row 1
    calls = []
    if kernel.capabilities.supports_key_range:
        calls.append(("key_range", {"causal": False, "key_range": _ranges(docs)}))
    if kernel.capabilities.supports_doc_blocks:
        calls.append(("doc_blocks", {"causal": False, "doc_blocks": _blocks_for(docs, B, N, True)}))
    q, k, v, dout = _inputs(N, D, dtype, seed=5)
    dirty = [t.clone() for t in (q, k, v, dout)]
    dirty[2][0, 9] = math.nan  # a value of document (7, 18)
    for t in dirty:
        t[0, 21] = math.nan  # a padding token
    other = torch.ones(B, N, dtype=torch.bool)
    other[0, 7:18] = False
    failures = []
    for label, call in calls:
        results = []
        for q_, k_, v_, d_ in ((q, k, v, dout), dirty):
            out, lse = kernel.forward(q_, k_, v_, scale=0.3, **call)
            grads = kernel.backward(d_, q_, k_, v_, out, lse, scale=0.3, **call)
            results.append((out, lse.transpose(1, 2), *grads))
        for name, clean, got in zip(("out", "lse", "dq", "dk", "dv"), *results):
            if not torch.equal(clean[other], got[other]):
                failures.append(f"{kernel.name} [{label}]: {name} of other documents or padding changed")
        if not torch.isnan(results[1][0][0, 9:18]).all():  # the rows that see the NaN value (causal docs)
            failures.append(f"{kernel.name} [{label}]: a row that sees the NaN value has a finite output")
    return failures


@pytest.mark.parametrize("name", [n for n in BUILT_IN if not n.startswith("sdpa")])  # SDPA: no documents
def test_a_nan_stays_in_its_document(name):
    failures = _nan_containment_failures(kernel_named(name))
    assert not failures, "\n".join(failures)


# --- GQA through the SDPA ops -------------------------------------------------------------------------

def _recording(record: list, refuse_gqa: bool = False, error: type[Exception] = RuntimeError):
    """The emulated ops, recording the key/value head count each call was given; with ``refuse_gqa``
    raising ``error`` for unequal head counts, as a torch whose op takes none would."""
    def forward(flavor, qt, kt, vt, causal, scale):
        record.append(("forward", kt.shape[1]))
        if refuse_gqa and kt.shape[1] != qt.shape[1]:
            raise error("number of heads in key/value must equal the query's")
        return _sdpa_forward(flavor, qt, kt, vt, causal, scale)

    def backward(flavor, dot, qt, kt, vt, ot, lse, causal, scale):
        record.append(("backward", kt.shape[1]))
        if refuse_gqa and kt.shape[1] != qt.shape[1]:
            raise error("number of heads in key/value must equal the query's")
        return _sdpa_backward(flavor, dot, qt, kt, vt, ot, lse, causal, scale)

    return forward, backward


def _gqa_errors(kernel) -> dict[str, float]:
    q, k, v, dout = _inputs(N, D, torch.float64, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense_attention(*leaves, {"causal": True}, 0.3)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    return {n: _err(got, want) for n, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                                       (ref_out, ref_lse, *ref_grads))}


@pytest.mark.parametrize("flavor", sdpa_module.FLAVORS)
def test_sdpa_ops_read_gqa_key_value_heads_in_place(monkeypatch, flavor):
    """Keys and values reach the op with their own head count (no copy repeated to every query head)."""
    record: list = []
    monkeypatch.setattr(sdpa_module, "sdpa_forward", _recording(record)[0])
    monkeypatch.setattr(sdpa_module, "sdpa_backward", _recording(record)[1])
    errors = _gqa_errors(sdpa_module.SdpaKernel(flavor))
    assert record == [("forward", HK), ("backward", HK)]
    assert max(errors.values()) <= 1e-6, errors


def test_sdpa_ops_that_refuse_gqa_get_expanded_heads_with_one_warning(monkeypatch):
    record: list = []
    forward, backward = _recording(record, refuse_gqa=True)
    monkeypatch.setattr(sdpa_module, "sdpa_forward", forward)
    monkeypatch.setattr(sdpa_module, "sdpa_backward", backward)
    kernel = sdpa_module.SdpaKernel("cudnn")
    with pytest.warns(UserWarning, match="refused unequal query and key/value head counts") as caught:
        errors = _gqa_errors(kernel)
        errors_again = _gqa_errors(kernel)
    assert len([w for w in caught if "refused" in str(w.message)]) == 1
    assert max(errors.values()) <= 1e-6 and max(errors_again.values()) <= 1e-6, (errors, errors_again)
    assert record == [("forward", HK), ("forward", H), ("backward", H), ("forward", H), ("backward", H)]
    assert not kernel.native_gqa


def test_an_out_of_memory_in_the_sdpa_op_is_not_taken_for_a_gqa_refusal(monkeypatch):
    forward, backward = _recording([], refuse_gqa=True, error=torch.OutOfMemoryError)
    monkeypatch.setattr(sdpa_module, "sdpa_forward", forward)
    kernel = sdpa_module.SdpaKernel("cudnn")
    q, k, v, _ = _inputs(N, D, torch.float64, seed=3)
    with pytest.raises(torch.OutOfMemoryError):
        kernel.forward(q, k, v, causal=True, scale=0.3)
    assert kernel.native_gqa
