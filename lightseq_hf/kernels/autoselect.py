"""``backend="auto"`` on CUDA: the faster local kernel per GPU, from measured results.

The table holds the backend that won the forward+backward comparison of
``scripts/bench_kernels.py`` on each GPU model (see ``benchmarks/results/``). A GPU not
in the table gets the Triton kernels when triton is importable, else SDPA.
"""

from __future__ import annotations

import torch

#: GPU name substring -> backend measured fastest for causal forward+backward.
#: H100: benchmarks/results/kernels-h100-2026-11-22.json (cuDNN 1.2-1.6x our Triton kernels on every
#: causal row); H200: benchmarks/results/dist-h200-x2-2026-11-22.json (single-GPU rows, cuDNN faster).
MEASURED_FASTEST: dict[str, str] = {"H100": "sdpa_cudnn", "H200": "sdpa_cudnn"}


def preferred_cuda_backend(device: torch.device, *, triton_ok: bool) -> str:
    """The backend to use on ``device`` for ``backend="auto"``."""
    name = torch.cuda.get_device_name(device)
    for pattern, backend in MEASURED_FASTEST.items():
        if pattern in name and (backend != "triton" or triton_ok):
            return backend
    return "triton" if triton_ok else "sdpa"
