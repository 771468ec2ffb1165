"""The SDPA backends (torch's cuDNN and FlashAttention-2 ops) on a GPU with GQA key/value heads read in
place: bf16 against a float64 reference, and the backward's peak memory against the same kernel with the
key/value heads expanded to every query head.

Pass criterion: the kernel's error (norm(diff) / norm(ref)) is at most twice the error of torch's public
SDPA call given the expanded heads (independent of the kernel's code) plus 1e-6, its lse within 1e-5 of
the float64 lse of the bf16-rounded inputs; the native backward's allocated peak is below the expanded
one's by at least one query-sized tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch.nn.functional as F
from distributed import rel_err

from lightseq_hf.kernels.reference import ReferenceKernel
from lightseq_hf.kernels.sdpa import SdpaKernel

DEV = torch.device("cuda")
REF = ReferenceKernel(block_q=2048, block_k=2048)
# (seq, heads, kv_heads, head_dim, causal)
CASES = [(2048, 32, 8, 128, True), (4096, 16, 2, 128, True), (2048, 8, 8, 64, False),
         (8192, 8, 1, 128, False)]


def _inputs(n, h, hk, d, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(1, n, heads, d, device=DEV, generator=g, dtype=torch.float64)
            for heads in (h, hk, hk, h)]


def _expanded_peer(q, k, v, dout, causal, scale):
    """out, dq, dk, dv of ``F.scaled_dot_product_attention`` with keys/values repeated to every head."""
    group = q.shape[2] // k.shape[2]
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    qe, ke, ve = (t.transpose(1, 2) for t in (leaves[0], *(x.repeat_interleave(group, 2)
                                                            for x in leaves[1:])))
    out = F.scaled_dot_product_attention(qe, ke, ve, is_causal=causal, scale=scale).transpose(1, 2)
    out.backward(dout.bfloat16())
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("flavor", ["cudnn", "flash"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "s{}-h{}/{}-d{}-{}".format(*c[:4], "causal" if c[4]
                                                                                   else "full"))
def test_sdpa_kernel_gqa_in_place_against_float64(flavor, case):
    n, h, hk, d, causal = case
    q, k, v, dout = _inputs(n, h, hk, d, seed=n + h + hk)
    scale = d ** -0.5
    ref_out, ref_lse = REF.forward(q, k, v, causal=causal, scale=scale)
    refs = [ref_out, *REF.backward(dout, q, k, v, ref_out, ref_lse, causal=causal, scale=scale)]
    peer = _expanded_peer(q, k, v, dout, causal, scale)
    kernel = SdpaKernel(flavor)
    qb, kb, vb, db = (t.bfloat16() for t in (q, k, v, dout))
    out, lse = kernel.forward(qb, kb, vb, causal=causal, scale=scale)
    grads = kernel.backward(db, qb, kb, vb, out, lse, causal=causal, scale=scale)
    assert kernel.native_gqa, "torch's op refused unequal head counts"
    rounded_lse = REF.forward(qb.double(), kb.double(), vb.double(), causal=causal, scale=scale)[1]
    assert rel_err(lse, rounded_lse) <= 1e-5  # the lse of the bf16 inputs, computed in float32
    for name, got, want, other in zip(("out", "dq", "dk", "dv"), (out, *grads), refs, peer):
        assert got.shape == want.shape, name
        err, bound = rel_err(got, want), 2 * rel_err(other, want) + 1e-6
        assert err <= bound, f"{flavor} {name}: {err:.2e} > {bound:.2e}"


def _backward_peak(kernel, q, k, v, dout, out, lse) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=q.shape[-1] ** -0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads
    return peak


def test_gqa_backward_holds_no_expanded_keys_values():
    """Llama-3-8B's heads (32/8), 16K tokens: the native backward's peak is lower by at least a query-sized
    tensor (the expanded path holds repeated k, v and per-head dk, dv: four query-sized tensors)."""
    n, h, hk, d = 16384, 32, 8, 128
    q, k, v, dout = (t.bfloat16() for t in _inputs(n, h, hk, d, seed=7))
    native = SdpaKernel("cudnn")
    out, lse = native.forward(q, k, v, causal=True, scale=d ** -0.5)
    expanded = copy.copy(native)
    expanded.native_gqa = False
    peaks = {name: _backward_peak(kern, q, k, v, dout, out, lse) for name, kern in (("native", native),
                                                                                      ("expanded", expanded))}
    assert native.native_gqa
    assert peaks["expanded"] - peaks["native"] >= q.numel() * q.element_size(), peaks


@pytest.mark.parametrize("flavor", ["cudnn", "flash"])
def test_sdpa_backward_reads_the_output_only_through_its_row_sums(flavor):
    """The distributed loop gives the SDPA kernels, for another rank's rows, a stand-in output with the
    same row sums (``stand_in_output``): their gradients must match those of the real output."""
    from lightseq_hf.kernels.row_stats import attention_delta, stand_in_output

    n, h, hk, d = 4096, 16, 4, 128
    q, k, v, dout = (t.bfloat16() for t in _inputs(n, h, hk, d, seed=11))
    kernel = SdpaKernel(flavor)
    out, lse = kernel.forward(q, k, v, causal=True, scale=d ** -0.5)
    real = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=d ** -0.5)
    stand_in = stand_in_output(dout, attention_delta(dout, out))
    got = kernel.backward(dout, q, k, v, stand_in, lse, causal=True, scale=d ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, real):
        assert rel_err(a, b) <= 4e-3, f"{flavor} {name}: {rel_err(a, b):.2e}"
