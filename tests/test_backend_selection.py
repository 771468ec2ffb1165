"""backend="auto": what the selection table picks for each device, GPU, dtype, head dim, mask and
softcap (CUDA simulated), and how an explicit backend that cannot take a call is refused."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightseq_hf import kernels
from lightseq_hf.kernels import KernelRequest, MaskKind, flash_varlen, select_backend
from lightseq_hf.kernels.triton_attn import TritonKernel

H100, H200, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize(
    "gpu, triton_ok, dtype, head_dim, expected",
    [
        (H100, True, torch.bfloat16, 128, "sdpa_cudnn"),  # measured fastest
        (H200, True, torch.float16, 64, "sdpa_cudnn"),
        (H100, True, torch.bfloat16, 200, "sdpa_cudnn"),  # no Triton build for d=200, cuDNN takes it
        (H100, True, torch.float32, 128, "triton"),  # SDPA takes half types only
        (H100, True, torch.float32, 32, "reference"),  # no Triton build for d=32
        (H100, False, torch.float32, 128, "reference"),
        (H100, True, torch.bfloat16, 264, "reference"),  # beyond both fused kernels
        (A100, True, torch.bfloat16, 128, "triton"),  # not measured: our kernels
        (A100, False, torch.bfloat16, 128, "sdpa_cudnn"),
        (A100, True, torch.bfloat16, 20, "reference"),  # neither takes d=20
    ],
)
def test_auto_on_cuda(gpu, triton_ok, dtype, head_dim, expected, monkeypatch):
    if not triton_ok:
        monkeypatch.setattr(TritonKernel, "unavailable", lambda self, device, dtype=None: "no triton")
    with mock.patch("lightseq_hf.kernels.autoselect.torch.cuda.get_device_name", return_value=gpu):
        request = KernelRequest(torch.device("cuda"), dtype, head_dim, head_dim, MaskKind.CAUSAL)
        assert select_backend("auto", request) == expected


def test_softcap_and_value_head_dim_go_to_the_backends_that_declare_them():
    cuda = torch.device("cuda")
    with mock.patch("lightseq_hf.kernels.autoselect.torch.cuda.get_device_name", return_value=H100):
        for mask in MaskKind:
            capped = KernelRequest(cuda, torch.bfloat16, 128, 128, mask, softcap=True)
            assert select_backend("auto", capped) == "reference"
        assert select_backend("auto", KernelRequest(cuda, torch.bfloat16, 128, 64)) == "reference"
        for backend in ("triton", "sdpa", "sdpa_flash"):
            with pytest.raises(ValueError, match=rf"backend '{backend}' does not take logit soft-capping"):
                select_backend(backend, KernelRequest(cuda, torch.bfloat16, 128, 128, softcap=True))
        with pytest.raises(ValueError, match="value head dims; got 128 and 64.*reference"):
            select_backend("triton", KernelRequest(cuda, torch.bfloat16, 128, 64))


def test_a_gradient_through_the_lse_skips_backends_whose_backward_takes_the_output():
    """Attention sinks back-propagate through the lse: cuDNN's backward (output rows, no delta) cannot."""
    cuda = torch.device("cuda")
    with mock.patch("lightseq_hf.kernels.autoselect.torch.cuda.get_device_name", return_value=H100):
        plain = KernelRequest(cuda, torch.bfloat16, 64, 64, MaskKind.CAUSAL)
        assert select_backend("auto", plain) == "sdpa_cudnn"
        assert select_backend("auto", KernelRequest(cuda, torch.bfloat16, 64, 64, MaskKind.CAUSAL,
                                                    lse_grad=True)) == "triton"
        # by name it serves the call; its backward raises if a gradient reaches the lse
        named = KernelRequest(cuda, torch.bfloat16, 64, 64, lse_grad=True)
        assert select_backend("sdpa", named) == "sdpa_cudnn"


def test_auto_on_cpu_is_the_reference_kernel():
    assert kernels.get_kernel("auto", torch.device("cpu"), torch.bfloat16, 64).name == "reference"
    for mask in MaskKind:
        assert select_backend("auto", KernelRequest(torch.device("cpu"), torch.float32, 64, 64, mask)) == \
            "reference"


def test_explicit_backends_are_refused_naming_what_they_lack(monkeypatch):
    monkeypatch.setattr(flash_varlen, "usable", lambda device: device.type == "cuda")
    cpu = torch.device("cpu")
    # 'triton' joins the alternatives where the Triton interpreter is on (TRITON_INTERPRET=1)
    with pytest.raises(ValueError, match="backend 'sdpa' needs a CUDA GPU; tensors are on cpu; use "
                                         "backend='reference' or ('triton' or )?'auto'"):
        select_backend("sdpa", KernelRequest(cpu, torch.float16, 64, 64))
    with pytest.raises(ValueError, match="unknown backend 'cuda'; choose one of auto, reference"):
        select_backend("cuda", KernelRequest(cpu))
    with mock.patch("lightseq_hf.kernels.autoselect.torch.cuda.get_device_name", return_value=H100):
        cuda = torch.device("cuda")
        needle = ("backend 'sdpa_cudnn' does not take packed documents and padding; use backend='reference' "
                  "or 'triton' or 'flash_varlen' or 'auto'")
        with pytest.raises(ValueError, match=needle):
            select_backend("sdpa_cudnn", KernelRequest(cuda, torch.float16, 64, 64, MaskKind.DOCUMENTS))
        with pytest.raises(ValueError, match="backend 'triton' takes head dims 64, 80, 96, 128; got 48"):
            select_backend("triton", KernelRequest(cuda, torch.float16, 48, 48))
        with pytest.raises(ValueError, match="backend 'sdpa' takes bfloat16, float16, not float32"):
            select_backend("sdpa", KernelRequest(cuda, torch.float32, 64, 64))
    assert select_backend("sdpa", KernelRequest(torch.device("cuda"), torch.float16, 64, 64)) == "sdpa_cudnn"


def test_one_call_selects_its_backend_once(monkeypatch):
    """Every module that holds ``select_backend`` is watched: one ``dist_flash_attn`` call, forward and
    backward, passes the selection once."""
    import sys

    import lightseq_hf
    from lightseq_hf.kernels import autoselect

    calls = []
    original = autoselect.select_backend

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("lightseq_hf") and m is not None]:
        if getattr(module, "select_backend", None) is original:
            monkeypatch.setattr(module, "select_backend", counted)
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    lightseq_hf.dist_flash_attn(q, k, v, causal=True).sum().backward()
    assert len(calls) == 1 and q.grad is not None
