"""``backend="auto"`` on CUDA: the faster local kernel per GPU, from measured results.

The table holds the backend that won the forward+backward comparison of
``scripts/bench_kernels.py`` on each GPU model (see ``benchmarks/results/``). A GPU not
in the table gets the Triton kernels when triton is importable, else SDPA.
"""

from __future__ import annotations

import torch

#: GPU name substring -> backend measured fastest for causal forward+backward.
MEASURED_FASTEST: dict[str, str] = {}


def preferred_cuda_backend(device: torch.device, *, triton_ok: bool) -> str:
    """The backend to use on ``device`` for ``backend="auto"``."""
    name = torch.cuda.get_device_name(device)
    for pattern, backend in MEASURED_FASTEST.items():
        if pattern in name and (backend != "triton" or triton_ok):
            return backend
    return "triton" if triton_ok else "sdpa"
