"""Local attention backends behind one contract (``base``), chosen in one place (``autoselect``).

``reference`` (PyTorch, any device), ``triton`` (our FlashAttention kernels), ``sdpa_cudnn`` /
``sdpa_flash`` (torch's fused kernels; ``sdpa`` is the cuDNN one), ``flash_varlen`` (torch's
FlashAttention-2 varlen kernels: packed documents as one call per task), ``cudnn_fe`` (cuDNN's
variable-length attention from the optional ``nvidia-cudnn-frontend`` package, also one call per task;
both in :mod:`.varlen`),
``auto`` (chosen by what the device is: :func:`describe` says which backend a call gets and why).
"""

from __future__ import annotations

import torch

from .autoselect import (
    REGISTRY,
    Row,
    Selection,
    backend_names,
    describe,
    kernel_named,
    register_backend,
    select_backend,
    unregister_backend,
)
from .base import (
    MASK_KEYWORDS,
    AttentionKernel,
    AttentionMask,
    Capabilities,
    DocBlocks,
    KernelBase,
    KernelRequest,
    MaskKind,
    check_qkv,
)
from .device_class import DeviceClass, device_class
from .reference import ReferenceKernel
from .row_stats import attention_delta
from .working_memory import BackwardMemory, Workspace

#: The built-in names ``backend=`` takes (configuration files validate against it).
BACKENDS = ("auto", "reference", "triton", "sdpa", "sdpa_cudnn", "sdpa_flash", "flash_varlen", "cudnn_fe")


def get_kernel(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> AttentionKernel:
    """The kernel for ``backend`` (``"auto"``: the table's choice for causal rows) on ``device``; ``dtype``
    and ``head_dim`` are checked when given. Raises ValueError naming the fix."""
    request = KernelRequest(device, dtype, head_dim, head_dim)
    return kernel_named(select_backend(backend, request))


def backward_memory(backend: str) -> BackwardMemory:
    """What backend ``backend``'s backward allocates, as it declares it (the memory planner's one source);
    ValueError when the backend is unknown or declares nothing."""
    memory = kernel_named(backend).capabilities.backward_memory
    if memory is None:
        raise ValueError(f"backend {backend!r} declares no backward_memory in its capabilities, so its "
                         "memory cannot be planned; declare it (lightseq_hf.kernels.BackwardMemory).")
    return memory


__all__ = [
    "AttentionKernel",
    "AttentionMask",
    "BACKENDS",
    "BackwardMemory",
    "Capabilities",
    "DeviceClass",
    "DocBlocks",
    "KernelBase",
    "KernelRequest",
    "MASK_KEYWORDS",
    "MaskKind",
    "REGISTRY",
    "ReferenceKernel",
    "Row",
    "Selection",
    "Workspace",
    "attention_delta",
    "backend_names",
    "backward_memory",
    "check_qkv",
    "describe",
    "device_class",
    "get_kernel",
    "kernel_named",
    "register_backend",
    "select_backend",
    "unregister_backend",
]
