"""Local attention backends behind one contract (see ``base``).

``reference`` (PyTorch, any device), ``triton`` (our FlashAttention kernels), ``sdpa_cudnn`` /
``sdpa_flash`` (torch's fused kernels; ``sdpa`` is the cuDNN one), ``flash_varlen`` (torch's
FlashAttention-2 varlen kernels: packed documents as one call per task), ``auto``.
"""

from __future__ import annotations

import os

import torch

from . import flash_varlen
from .base import TRITON_HEAD_DIMS, AttentionKernel, attention_delta, check_qkv
from .reference import ReferenceKernel

BACKENDS = ("auto", "reference", "triton", "sdpa", "sdpa_cudnn", "sdpa_flash", "flash_varlen")

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


def _flash_varlen_ok(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> bool:
    """Whether the flash varlen kernels take these tensors (and their op runs on ``device``)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_dim is not None and head_dim % 8 == 0 and head_dim <= 256
            and flash_varlen.usable(device))


def masked_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype | None,
    head_dim: int | None,
    window: int | None = None,
) -> str:
    """The backend for attention over packed documents / padding (and ``window``): ``auto`` picks one that
    takes them — a backend taking per-row key ranges (Triton on CUDA, measured faster than ``flash_varlen``
    on H200: ``benchmarks/results/packed-h200-x2-2026-11-22.json``), else on CUDA in half precision without
    a window ``flash_varlen`` (head dims Triton does not compile), else the reference kernel; an explicit
    backend that cannot is refused, naming those that can."""
    if backend == "auto":
        chosen = _auto_backend(device, dtype, head_dim)
        if getattr(get_kernel(chosen, device, dtype, head_dim), "supports_key_range", False):
            return chosen
        triton_ok = _triton_usable(device) and head_dim in TRITON_HEAD_DIMS and dtype in (
            torch.float16, torch.bfloat16, torch.float32)
        if triton_ok and getattr(get_kernel("triton", device), "supports_key_range", False):
            return "triton"
        if window is None and _flash_varlen_ok(device, dtype, head_dim):
            return "flash_varlen"
        return "reference"
    kernel = get_kernel(backend, device, dtype, head_dim)
    if getattr(kernel, "supports_key_range", False):
        return backend
    if getattr(kernel, "supports_doc_blocks", False):
        if window is not None:
            raise ValueError(
                f"backend {backend!r} takes packed documents but not sliding windows (a window is not one "
                "block per document); use backend='triton' on a GPU, 'reference', or 'auto'."
            )
        return backend
    raise ValueError(
        f"backend {backend!r} does not take document or window masks (packed sequences, padding, "
        "sliding windows); use backend='flash_varlen' or 'triton' on a GPU, 'reference', or 'auto'."
    )


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
    if backend == "flash_varlen" and not flash_varlen.usable(device):
        raise ValueError(
            "backend 'flash_varlen' runs torch's FlashAttention-2 varlen kernels and needs a CUDA GPU whose "
            f"torch build has them (torch.ops.aten._flash_attention_forward); tensors are on {device}. "
            "Use backend='triton' on a GPU, or 'reference' / 'auto'."
        )
    if backend not in _cache:
        if backend == "reference":
            _cache[backend] = ReferenceKernel()
        elif backend == "flash_varlen":
            _cache[backend] = flash_varlen.FlashVarlenKernel()
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
