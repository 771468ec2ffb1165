"""backend="auto": what the selection table picks for each device class (compute capability, torch's
cuDNN, the optional packages installed; emulated), dtype, head dim, mask and softcap, why (``describe``),
and how an explicit backend that cannot take a call is refused."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from cudnn_fe_emulation import install

from lightseq_hf import kernels
from lightseq_hf.kernels import DeviceClass, KernelRequest, MaskKind, describe, select_backend
from lightseq_hf.kernels.autoselect import TABLE
from lightseq_hf.kernels.triton_attn import TritonKernel
from lightseq_hf.kernels.varlen import flash as flash_varlen

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = frozenset({"nvidia-cudnn-frontend"})
#: H100, H200, GH200 and H20 are all this class; the cuDNN torch 2.11 ships
HOPPER = DeviceClass("cuda", (9, 0), 91900)
A100, L40S, B200 = (DeviceClass("cuda", cap, 91900) for cap in ((8, 0), (8, 9), (10, 0)))
OLD_CUDNN_A100 = DeviceClass("cuda", (8, 0), 8902)
CUDA = torch.device("cuda")
DENSE_MASKS = (MaskKind.CAUSAL, MaskKind.FULL)


def _with(cls: DeviceClass, packages=FRONTEND) -> DeviceClass:
    return DeviceClass(cls.kind, cls.capability, cls.cudnn, frozenset(packages))


@pytest.fixture
def gpu_ops(monkeypatch):
    """torch's FlashAttention-2 varlen op present (as on any CUDA build of torch), and the cuDNN frontend's
    ops emulated (whether a class has the package is the class's ``packages``)."""
    monkeypatch.setattr(flash_varlen, "usable", lambda device: device.type == "cuda")
    install(monkeypatch.setattr)


def _pick(cls, dtype=torch.bfloat16, head_dim=128, mask=MaskKind.CAUSAL, **extra):
    return describe("auto", KernelRequest(CUDA, dtype, head_dim, head_dim, mask, **extra), device_class=cls)


@pytest.mark.parametrize("cls, mask, head_dim, backend, evidence", [
    # measured rows of compute capability 9.0
    (HOPPER, MaskKind.CAUSAL, 128, "sdpa_cudnn", "kernels-h100-2026-11-22.json"),
    (HOPPER, MaskKind.FULL, 64, "sdpa_cudnn", "kernels-h100-2026-11-22.json"),
    (_with(HOPPER), MaskKind.DOCUMENTS, 128, "cudnn_fe", "packed-kernels-h100-2026-11-26.json"),
    (_with(HOPPER), MaskKind.DOCUMENTS, 64, "cudnn_fe", "packed-kernels-h100-2026-11-26.json"),
    (HOPPER, MaskKind.DOCUMENTS, 128, "triton", "packed-kernels-h100-2026-11-25.json"),  # no frontend
    (HOPPER, MaskKind.DOCUMENTS, 64, "flash_varlen", "packed-kernels-h100-2026-11-25.json"),
    # classes nobody measured: the vendor kernel of the mask
    (A100, MaskKind.CAUSAL, 128, "sdpa_cudnn", ""),
    (L40S, MaskKind.FULL, 64, "sdpa_cudnn", ""),
    (B200, MaskKind.CAUSAL, 128, "sdpa_cudnn", ""),
    (OLD_CUDNN_A100, MaskKind.CAUSAL, 128, "sdpa_flash", ""),  # torch's cuDNN attention needs cuDNN 9
    (_with(A100), MaskKind.DOCUMENTS, 128, "cudnn_fe", ""),
    (_with(B200), MaskKind.DOCUMENTS, 64, "cudnn_fe", ""),
    (L40S, MaskKind.DOCUMENTS, 128, "flash_varlen", ""),  # frontend not installed
    (B200, MaskKind.DOCUMENTS, 128, "flash_varlen", ""),
    # head dims a measured row does not cover: the vendor kernel, not the row's
    (HOPPER, MaskKind.CAUSAL, 96, "sdpa_cudnn", ""),
    (_with(HOPPER), MaskKind.DOCUMENTS, 96, "cudnn_fe", ""),
    (HOPPER, MaskKind.DOCUMENTS, 200, "flash_varlen", ""),
])
def test_auto_by_device_class(gpu_ops, cls, mask, head_dim, backend, evidence):
    chosen = _pick(cls, head_dim=head_dim, mask=mask)
    assert chosen.backend == backend, str(chosen)
    assert chosen.device_class == cls
    if evidence:
        assert evidence in chosen.evidence and "measured fastest on this device class" in chosen.why
    else:
        assert chosen.evidence == "" and chosen.why.startswith("the vendor kernel for"), str(chosen)
    assert f"backend {backend!r}" in str(chosen) and str(cls) in str(chosen)


@pytest.mark.parametrize("cls", [A100, L40S, B200, _with(A100), _with(B200), OLD_CUDNN_A100])
def test_a_class_without_measured_rows_never_gets_triton_where_a_vendor_kernel_serves(gpu_ops, cls):
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 80, 96, 128):
            for mask in (*DENSE_MASKS, MaskKind.DOCUMENTS):
                chosen = _pick(cls, dtype, head_dim, mask)
                assert chosen.backend != "triton" and chosen.evidence == "", str(chosen)


def test_what_no_vendor_kernel_takes_goes_to_triton_then_the_reference(gpu_ops, monkeypatch):
    for cls in (HOPPER, _with(B200)):
        assert _pick(cls, torch.float32).backend == "triton"  # vendor kernels: half types only
        assert _pick(cls, mask=MaskKind.WINDOW).backend == "triton"
        assert _pick(cls, lse_grad=True).backend == "triton"  # their backward takes the output rows
        assert _pick(cls, torch.float32, head_dim=32).backend == "reference"  # no Triton build for d32
        assert _pick(cls, head_dim=264).backend == "reference"  # beyond every fused kernel
        for mask in MaskKind:
            assert _pick(cls, mask=mask, softcap=True).backend == "reference"
    old = DeviceClass("cuda", (7, 5), 90100)  # before the vendor kernels' hardware
    chosen = _pick(old)
    assert chosen.backend == "triton" and "needs compute capability 8.0 or later" in str(chosen)
    monkeypatch.setattr(TritonKernel, "unavailable", lambda self, device, dtype=None: "no triton")
    assert _pick(HOPPER, torch.float32).backend == "reference"
    assert _pick(A100, mask=MaskKind.WINDOW).backend == "reference"


def test_describe_says_what_was_passed_over(gpu_ops, monkeypatch):
    chosen = _pick(HOPPER, mask=MaskKind.DOCUMENTS)  # the class lacks the frontend package
    missing = "needs the nvidia-cudnn-frontend package, which is not installed"
    assert ("cudnn_fe", missing) in chosen.passed_over
    from lightseq_hf.kernels.varlen import cudnn as cudnn_fe

    monkeypatch.setattr(cudnn_fe, "unavailable_reason", lambda: "runs on cuDNN 9.23.1, whose packed backward "
                                                                "can return all-zero gradients")
    chosen = _pick(_with(HOPPER), mask=MaskKind.DOCUMENTS)  # installed, but its cuDNN is refused
    assert chosen.backend == "triton"
    assert any(name == "cudnn_fe" and "9.23.1" in why for name, why in chosen.passed_over)
    named = describe("sdpa", KernelRequest(CUDA, torch.bfloat16, 64, 64), device_class=A100)
    assert named.backend == "sdpa_cudnn" and named.why == "asked for by name"


def test_device_class_reads_capability_cudnn_and_packages(monkeypatch):
    installed = {"nvidia-cudnn-frontend"}

    def distribution(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return object()

    kernels.device_class.cache_clear()
    try:
        with mock.patch.object(torch.cuda, "is_available", return_value=True), \
                mock.patch.object(torch.cuda, "current_device", return_value=0), \
                mock.patch.object(torch.cuda, "get_device_capability", return_value=(8, 9)), \
                mock.patch.object(torch.backends.cudnn, "is_available", return_value=True), \
                mock.patch.object(torch.backends.cudnn, "version", return_value=91001), \
                mock.patch.object(importlib.metadata, "distribution", side_effect=distribution):
            cls = kernels.device_class(torch.device("cuda"))
        assert cls == DeviceClass("cuda", (8, 9), 91001, frozenset({"nvidia-cudnn-frontend"}))
        assert str(cls) == "cuda sm89, cuDNN 9.10.1, nvidia-cudnn-frontend"
    finally:
        kernels.device_class.cache_clear()
    assert kernels.device_class(torch.device("cpu")) == DeviceClass("cpu")


def test_measured_rows_cite_committed_results_files():
    measured = [row for row in TABLE if row.evidence]
    assert {row.backend for row in measured} == {"sdpa_cudnn", "cudnn_fe", "triton", "flash_varlen"}
    for row in measured:
        assert row.capability is not None, row  # a measured row belongs to one device class
        names = re.findall(r"[\w.-]+\.json", row.evidence)
        assert names, row
        for name in names:
            assert (ROOT / "benchmarks" / "results" / name).is_file(), name
    vendor = [row for row in TABLE if not row.evidence]
    assert all(row.why for row in vendor) and vendor[-1].backend == "reference"


def test_auto_on_cpu_is_the_reference_kernel():
    assert kernels.get_kernel("auto", torch.device("cpu"), torch.bfloat16, 64).name == "reference"
    for mask in MaskKind:
        assert select_backend("auto", KernelRequest(torch.device("cpu"), torch.float32, 64, 64, mask)) == \
            "reference"


def test_the_device_class_comes_from_the_request_device(gpu_ops, monkeypatch):
    """Without ``device_class=`` the class is the request device's own (here: one emulated B200)."""
    from lightseq_hf.kernels import autoselect

    monkeypatch.setattr(autoselect, "device_class", lambda device: _with(B200, ()))
    assert select_backend("auto", KernelRequest(CUDA, torch.bfloat16, 128, 128, MaskKind.DOCUMENTS)) == \
        "flash_varlen"


def test_explicit_backends_are_refused_naming_what_they_lack(monkeypatch):
    monkeypatch.setattr(flash_varlen, "usable", lambda device: device.type == "cuda")
    cpu = torch.device("cpu")
    # 'triton' joins the alternatives where the Triton interpreter is on (TRITON_INTERPRET=1)
    with pytest.raises(ValueError, match="backend 'sdpa' needs a CUDA GPU; tensors are on cpu; use "
                                         "backend='reference' or ('triton' or )?'auto'"):
        select_backend("sdpa", KernelRequest(cpu, torch.float16, 64, 64))
    with pytest.raises(ValueError, match="unknown backend 'cuda'; choose one of auto, reference"):
        select_backend("cuda", KernelRequest(cpu))
    needle = ("backend 'sdpa_cudnn' does not take packed documents and padding; use backend='reference' "
              "or 'triton' or 'flash_varlen' or 'auto'")
    with pytest.raises(ValueError, match=needle):
        select_backend("sdpa_cudnn", KernelRequest(CUDA, torch.float16, 64, 64, MaskKind.DOCUMENTS))
    with pytest.raises(ValueError, match="backend 'triton' takes head dims 64, 80, 96, 128; got 48"):
        select_backend("triton", KernelRequest(CUDA, torch.float16, 48, 48))
    with pytest.raises(ValueError, match="backend 'sdpa' takes bfloat16, float16, not float32"):
        select_backend("sdpa", KernelRequest(CUDA, torch.float32, 64, 64))
    for backend in ("triton", "sdpa", "sdpa_flash"):
        with pytest.raises(ValueError, match=rf"backend '{backend}' does not take logit soft-capping"):
            select_backend(backend, KernelRequest(CUDA, torch.bfloat16, 128, 128, softcap=True))
    with pytest.raises(ValueError, match="value head dims; got 128 and 64.*reference"):
        select_backend("triton", KernelRequest(CUDA, torch.bfloat16, 128, 64))
    # by name, a backend whose backward takes the output serves calls that return the lse
    assert select_backend("sdpa", KernelRequest(CUDA, torch.bfloat16, 64, 64, lse_grad=True)) == "sdpa_cudnn"


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
