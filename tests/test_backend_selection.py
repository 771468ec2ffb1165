"""backend="auto": what it picks for each device, dtype and head dim (CUDA simulated)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightseq_hf import kernels


@pytest.mark.parametrize(
    "gpu, triton_ok, dtype, head_dim, expected",
    [
        ("NVIDIA H100 80GB HBM3", True, torch.bfloat16, 128, "sdpa_cudnn"),  # measured fastest
        ("NVIDIA H200", True, torch.float16, 64, "sdpa_cudnn"),
        ("NVIDIA H100 80GB HBM3", True, torch.float32, 128, "triton"),  # SDPA takes half types only
        ("NVIDIA H100 80GB HBM3", True, torch.float32, 32, "reference"),  # no Triton build for d=32
        ("NVIDIA H100 80GB HBM3", False, torch.float32, 128, "reference"),
        ("NVIDIA H100 80GB HBM3", True, torch.bfloat16, 264, "reference"),  # beyond both fused kernels
        ("NVIDIA A100-SXM4-80GB", True, torch.bfloat16, 128, "triton"),  # not measured: our kernels
        ("NVIDIA A100-SXM4-80GB", False, torch.bfloat16, 128, "sdpa"),
    ],
)
def test_auto_on_cuda(gpu, triton_ok, dtype, head_dim, expected):
    with mock.patch.object(kernels, "_triton_usable", return_value=triton_ok), mock.patch(
        "lightseq_hf.kernels.autoselect.torch.cuda.get_device_name", return_value=gpu
    ):
        assert kernels._auto_backend(torch.device("cuda"), dtype, head_dim) == expected


def test_auto_on_cpu_is_the_reference_kernel():
    assert kernels.get_kernel("auto", torch.device("cpu"), torch.bfloat16, 64).name == "reference"
