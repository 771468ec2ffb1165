"""The reference kernel and the public function on one process (no process group)."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import rel_err

import lightseq_hf
from lightseq_hf.kernels import ReferenceKernel, get_kernel
from lightseq_hf.parallel.merge import empty_running


def naive(q, k, v, causal, scale):
    """Float64 attention with bottom-right causal alignment; rows seeing nothing give (0, -inf)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lq, lk = q.shape[1], k.shape[1]
    if causal:
        mask = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
        s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


SHAPES = [  # (lq, lk, heads, kv_heads, dim)
    (33, 33, 4, 4, 16), (70, 70, 8, 2, 24), (20, 50, 4, 1, 8), (50, 20, 4, 2, 8), (1, 1, 2, 1, 4),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_backward_match_naive(shape, causal):
    lq, lk, h, hk, d = shape
    kernel = ReferenceKernel(block_q=16, block_k=16)
    q = torch.randn(2, lq, h, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, lk, hk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, lk, hk, d, dtype=torch.float64, requires_grad=True)
    scale = d ** -0.5
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    ref_out, ref_lse = naive(q, k, v, causal, scale)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    dout = torch.randn_like(out)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-12


def test_accumulate_mode_equals_attention_over_concatenated_keys():
    kernel = ReferenceKernel(block_q=8, block_k=8)
    q = torch.randn(1, 24, 4, 8)
    k = torch.randn(1, 40, 2, 8)
    v = torch.randn(1, 40, 2, 8)
    out, lse = empty_running(q)
    kernel.forward(q, k[:, :16], v[:, :16], causal=False, scale=0.3, out=out, lse=lse)
    kernel.forward(q, k[:, 16:], v[:, 16:], causal=True, scale=0.3, out=out, lse=lse)
    ref_out, ref_lse = naive(q, k, v, True, 0.3)
    assert rel_err(out, ref_out) < 1e-6 and rel_err(lse, ref_lse) < 1e-6


def test_fp32_accumulation_for_bf16_inputs():
    q = torch.randn(1, 300, 2, 16).bfloat16()
    out, lse = ReferenceKernel().forward(q, q, q, causal=True, scale=0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, _ = naive(q, q, q, True, 0.25)
    assert rel_err(out, ref_out) < 1e-2


def test_without_process_group_it_is_plain_attention():
    q = torch.randn(2, 45, 6, 8, requires_grad=True)
    k = torch.randn(2, 45, 3, 8, requires_grad=True)
    out = lightseq_hf.dist_flash_attn(q, k, k, causal=True, softmax_scale=0.5)
    assert rel_err(out, naive(q, k, k, True, 0.5)[0]) < 1e-6
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


def test_lse_gradient_flows():
    q = torch.randn(1, 12, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 12, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 12, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = lightseq_hf.dist_flash_attn(q, k, v, return_lse=True)
    loss = (out ** 2).sum() + lse.sin().sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    r_out, r_lse = naive(q, k, v, True, 8 ** -0.5)
    ref = torch.autograd.grad((r_out ** 2).sum() + r_lse.sin().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        assert rel_err(g, r) < 1e-10


@pytest.mark.parametrize(
    "kwargs, make, message",
    [
        ({}, lambda: (torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8).double(), torch.randn(1, 8, 4, 8)),
         "dtypes disagree"),
        ({}, lambda: (torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)),
         "k and v shapes disagree"),
        ({}, lambda: (torch.randn(1, 8, 6, 8), torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 8)),
         "multiple of key/value heads"),
        ({}, lambda: (torch.ones(1, 8, 4, 8, dtype=torch.int64),) * 3, "floating dtype"),
        ({}, lambda: (torch.randn(8, 4, 8),) * 3, "must be 4-D"),
        ({}, lambda: (torch.randn(1, 8, 4, 8), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16)),
         "head dims disagree"),
        ({}, lambda: (torch.randn(1, 8, 4, 8), torch.randn(1, 9, 4, 8), torch.randn(1, 9, 4, 8)),
         "same length"),
        ({"schedule": "zigzag"}, lambda: (torch.randn(1, 8, 4, 8),) * 3, "unknown schedule"),
        ({"backend": "cuda"}, lambda: (torch.randn(1, 8, 4, 8),) * 3, "unknown backend"),
        ({"backend": "sdpa"}, lambda: (torch.randn(1, 8, 4, 8),) * 3, "needs a CUDA GPU"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(kwargs, make, message):
    with pytest.raises(ValueError, match=message):
        lightseq_hf.dist_flash_attn(*make(), **kwargs)


def test_triton_backend_without_gpu_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        get_kernel("triton", torch.device("cpu"))
