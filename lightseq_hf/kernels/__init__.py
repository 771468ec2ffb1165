"""Local attention backends behind one contract (see ``base``).

``reference`` (PyTorch, any device), ``triton`` (our FlashAttention kernels), ``sdpa_cudnn`` /
``sdpa_flash`` (torch's fused kernels; ``sdpa`` is the cuDNN one), ``auto``.
"""

from __future__ import annotations

import os

import torch

from .base import TRITON_HEAD_DIMS, AttentionKernel, attention_delta, check_qkv
from .reference import ReferenceKernel

BACKENDS = ("auto", "reference", "triton", "sdpa", "sdpa_cudnn", "sdpa_flash")

_cache: dict[str, AttentionKernel] = {}


def _triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def _auto_backend(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> str:
    if device.type != "cuda":
        return "reference"
    triton_ok = _triton_usable(device) and head_dim in (None, *TRITON_HEAD_DIMS)
    if dtype not in (None, torch.float16, torch.bfloat16):  # the SDPA kernels take half types only
        return "triton" if triton_ok and dtype == torch.float32 else "reference"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):  # beyond the fused SDPA kernels
        return "triton" if triton_ok else "reference"
    from .autoselect import preferred_cuda_backend

    return preferred_cuda_backend(device, triton_ok=triton_ok)


def masked_backend(
    backend: str, device: torch.device, dtype: torch.dtype | None, head_dim: int | None
) -> str:
    """The backend for attention with document / window masks (``key_range``): ``auto`` picks one that
    takes them; an explicit backend that cannot is refused, naming those that can."""
    if backend == "auto":
        chosen = _auto_backend(device, dtype, head_dim)
        if getattr(get_kernel(chosen, device, dtype, head_dim), "supports_key_range", False):
            return chosen
        triton_ok = _triton_usable(device) and head_dim in TRITON_HEAD_DIMS and dtype in (
            torch.float16, torch.bfloat16, torch.float32)
        if triton_ok and getattr(get_kernel("triton", device), "supports_key_range", False):
            return "triton"
        return "reference"
    if not getattr(get_kernel(backend, device, dtype, head_dim), "supports_key_range", False):
        raise ValueError(
            f"backend {backend!r} does not take document or window masks (packed sequences, padding, "
            "sliding windows); use backend='triton' on a GPU, 'reference', or 'auto'."
        )
    return backend


def get_kernel(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> AttentionKernel:
    """The kernel for ``backend`` on ``device`` (``auto`` also looks at ``dtype`` and ``head_dim``);
    raises ValueError naming the fix."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if backend == "auto":
        backend = _auto_backend(device, dtype, head_dim)
    if backend == "triton" and not _triton_usable(device):
        raise ValueError(
            "backend 'triton' needs a CUDA GPU with triton installed (or TRITON_INTERPRET=1 to run "
            f"the kernels in Triton's CPU interpreter); tensors are on {device}. "
            "Use backend='reference' or 'auto' on the CPU."
        )
    if backend == "triton" and device.type != "cuda" and dtype == torch.bfloat16:
        raise ValueError(
            "backend 'triton' in Triton's CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 wrongly "
            "(an upstream interpreter limitation); use float16 or float32 there, backend='reference', or "
            "a CUDA GPU."
        )
    if backend.startswith("sdpa") and device.type != "cuda":
        raise ValueError(
            f"backend 'sdpa' runs torch's flash/cuDNN kernels and needs a CUDA GPU; tensors are on "
            f"{device}. Use backend='reference' or 'auto' on the CPU."
        )
    if backend not in _cache:
        if backend == "reference":
            _cache[backend] = ReferenceKernel()
        elif backend == "triton":
            from .triton_attn import TritonKernel

            _cache[backend] = TritonKernel()
        else:
            from .sdpa import SdpaKernel

            _cache[backend] = SdpaKernel("flash" if backend == "sdpa_flash" else "cudnn")
    return _cache[backend]


__all__ = [
    "AttentionKernel",
    "BACKENDS",
    "ReferenceKernel",
    "attention_delta",
    "check_qkv",
    "get_kernel",
    "masked_backend",
]
