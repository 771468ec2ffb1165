"""Triton kernels on a GPU: bf16/fp16 from 1K to 32K tokens against a float64 reference.

Pass criterion: our error (norm(diff) / norm(ref), float64 reference computed blockwise
on the GPU) is at most twice the error of torch SDPA in the same dtype. Outputs the
kernels allocate are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

import torch.nn.functional as F
from distributed import rel_err
from kernel_checks import PoisonEmpty

from lightseq_hf._testing.kernel_knobs import single_triton_config
from lightseq_hf.kernels import triton_attn
from lightseq_hf.kernels.reference import ReferenceKernel

single_triton_config()  # one config per kernel: fast compiles

KERNEL = triton_attn.TritonKernel()
REF = ReferenceKernel(block_q=2048, block_k=2048)
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def poison_outputs():
    with PoisonEmpty():
        yield


def sdpa(q, k, v, causal, scale, mask=None):
    """torch SDPA in the contract's layout; returns out in (b, s, h, d)."""
    gqa = q.shape[2] != k.shape[2]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=gqa,
    )
    return o.transpose(1, 2)


# (seq, heads, kv_heads, head_dim, causal)
CASES = [
    (1024, 8, 2, 128, True),
    (2048, 8, 8, 64, False),
    (4096, 8, 1, 80, True),
    (8192, 4, 2, 96, False),
    (16384, 4, 2, 128, True),
    (32768, 2, 1, 128, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "s{}-h{}/{}-d{}-{}".format(*c[:4], "causal" if c[4] else "full")
)
def test_fwd_bwd_vs_sdpa_error(case, dtype):
    n, h, hk, d, causal = case
    torch.manual_seed(n + d)
    q = torch.randn(1, n, h, d, device=DEV, dtype=dtype)
    k = torch.randn(1, n, hk, d, device=DEV, dtype=dtype)
    v = torch.randn(1, n, hk, d, device=DEV, dtype=dtype)
    do = torch.randn(1, n, h, d, device=DEV, dtype=dtype)
    scale = d**-0.5
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref_out, ref_lse = REF.forward(q64, k64, v64, causal=causal, scale=scale)
    ref_grads = REF.backward(do.double(), q64, k64, v64, ref_out, ref_lse, causal=causal, scale=scale)

    out, lse = KERNEL.forward(q, k, v, causal=causal, scale=scale)
    grads = KERNEL.backward(do, q, k, v, out, lse, causal=causal, scale=scale)

    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s_out = sdpa(qs, ks, vs, causal, scale)
    s_out.backward(do)
    s_grads = (qs.grad, ks.grad, vs.grad)

    assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    e_ours, e_sdpa = rel_err(out, ref_out), rel_err(s_out.detach(), ref_out)
    assert e_ours <= 2 * e_sdpa + 1e-6, f"out: ours {e_ours:.2e} vs sdpa {e_sdpa:.2e}"
    for name, g, sg, r in zip(("dq", "dk", "dv"), grads, s_grads, ref_grads):
        e_ours, e_sdpa = rel_err(g, r), rel_err(sg, r)
        assert e_ours <= 2 * e_sdpa + 1e-6, f"{name}: ours {e_ours:.2e} vs sdpa {e_sdpa:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_accumulate_chunks_and_unequal_lengths(dtype):
    """Query chunk of 2K against 6K keys in three chunks (accumulated in place), bottom-right causal."""
    lq, lk, h, d = 2048, 6144, 4, 128
    torch.manual_seed(3)
    q = torch.randn(1, lq, h, d, device=DEV, dtype=dtype)
    k = torch.randn(1, lk, h, d, device=DEV, dtype=dtype)
    v = torch.randn(1, lk, h, d, device=DEV, dtype=dtype)
    do = torch.randn(1, lq, h, d, device=DEV, dtype=dtype)
    scale = d**-0.5
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref_out, ref_lse = REF.forward(q64, k64, v64, causal=True, scale=scale)
    ref_grads = REF.backward(do.double(), q64, k64, v64, ref_out, ref_lse, causal=True, scale=scale)

    out = torch.zeros(1, lq, h, d, device=DEV)
    lse = torch.full((1, h, lq), float("-inf"), device=DEV)
    chunks = [(slice(4096, 6144), True), (slice(0, 2048), False), (slice(2048, 4096), False)]
    for sl, causal in chunks:
        KERNEL.forward(q, k[:, sl], v[:, sl], causal=causal, scale=scale, out=out, lse=lse)
    dq = torch.zeros(1, lq, h, d, device=DEV)
    dk = torch.zeros(1, lk, h, d, device=DEV)
    dv = torch.zeros(1, lk, h, d, device=DEV)
    out_lp = out.to(dtype)
    for sl, causal in chunks:
        KERNEL.backward(
            do,
            q,
            k[:, sl],
            v[:, sl],
            out_lp,
            lse,
            causal=causal,
            scale=scale,
            dq=dq,
            dk=dk[:, sl],
            dv=dv[:, sl],
        )

    from torch.nn.attention.bias import causal_lower_right

    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s_out = sdpa(qs, ks, vs, True, scale, mask=causal_lower_right(lq, lk))
    s_out.backward(do)
    e_ours, e_sdpa = rel_err(out_lp, ref_out), rel_err(s_out.detach(), ref_out)
    assert e_ours <= 2 * e_sdpa + 1e-6, f"out: ours {e_ours:.2e} vs sdpa {e_sdpa:.2e}"
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    for name, g, sg, r in zip(("dq", "dk", "dv"), (dq, dk, dv), (qs.grad, ks.grad, vs.grad), ref_grads):
        e_ours, e_sdpa = rel_err(g, r), rel_err(sg, r)
        assert e_ours <= 2 * e_sdpa + 1e-6, f"{name}: ours {e_ours:.2e} vs sdpa {e_sdpa:.2e}"
