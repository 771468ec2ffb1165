"""Backend selection, in one place: the registry of backends and the table ``backend="auto"`` reads.

Every backend is a :class:`~lightseq_hf.kernels.base.KernelBase` subclass in its own module that declares
its :class:`~lightseq_hf.kernels.base.Capabilities`. :data:`REGISTRY` names how to build each one (modules
are imported on first use, so a backend whose package is missing costs nothing until asked for);
:data:`TABLE` lists, in order, which backend won the measurements for a device, GPU model, mask kind and
dtype. ``auto`` takes the first row that matches the call and whose backend's capabilities take it (head
dims, softcap, value head dim, mask) and that can run now; the last row, the reference kernel, takes
everything. An explicit backend is checked against the same capabilities and refused with a message that
names what it lacks and which backends have it.

Adding a backend: its module, one entry in :data:`REGISTRY`, and a row in :data:`TABLE` where it measured
fastest (or :func:`register_backend` from outside the package).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .base import AttentionKernel, KernelRequest, MaskKind

ALL_MASKS = frozenset(MaskKind)
DENSE = frozenset({MaskKind.CAUSAL, MaskKind.FULL})
HALF = frozenset({torch.float16, torch.bfloat16})


def _loader(module: str, cls: str, *args) -> Callable[[], AttentionKernel]:
    def build() -> AttentionKernel:
        return getattr(importlib.import_module(module, __package__), cls)(*args)

    return build


#: backend name -> how to build it (``"sdpa"`` is an alias of ``"sdpa_cudnn"``, see :data:`ALIASES`).
REGISTRY: dict[str, Callable[[], AttentionKernel]] = {
    "reference": _loader(".reference", "ReferenceKernel"),
    "triton": _loader(".triton_attn", "TritonKernel"),
    "sdpa_cudnn": _loader(".sdpa", "SdpaKernel", "cudnn"),
    "sdpa_flash": _loader(".sdpa", "SdpaKernel", "flash"),
    "flash_varlen": _loader(".flash_varlen", "FlashVarlenKernel"),
    "cudnn_fe": _loader(".cudnn_fe", "CudnnFeKernel"),
}
ALIASES = {"sdpa": "sdpa_cudnn"}


@dataclass(frozen=True)
class Row:
    """``backend`` for calls on ``device`` (``"*"``: any) whose GPU name contains ``gpu`` (``""``: any), with
    a mask in ``masks`` and a dtype in ``dtypes`` (None: any); ``evidence`` names the measurement."""

    backend: str
    device: str = "*"
    gpu: str = ""
    masks: frozenset[MaskKind] = ALL_MASKS
    dtypes: frozenset[torch.dtype] | None = None
    evidence: str = ""

    def matches(self, request: KernelRequest) -> bool:
        if self.device != "*" and request.device.type != self.device:
            return False
        if self.gpu and (request.device.type != "cuda"
                         or self.gpu not in torch.cuda.get_device_name(request.device)):
            return False
        if request.mask not in self.masks:
            return False
        return self.dtypes is None or request.dtype is None or request.dtype in self.dtypes


#: The measured-fastest backend per (device, GPU, mask kind, dtype), first match wins; rows whose backend
#: cannot take the call (head dim, softcap, ...) or cannot run (no triton, no varlen op) are passed over.
TABLE: list[Row] = [
    Row("sdpa_cudnn", "cuda", "H100", DENSE, HALF,
        "benchmarks/results/kernels-h100-2026-11-22.json: cuDNN 1.2-1.6x our Triton kernels, causal rows"),
    Row("sdpa_cudnn", "cuda", "H200", DENSE, HALF,
        "benchmarks/results/dist-h200-x2-2026-11-22.json: single-GPU rows, cuDNN faster than Triton"),
    Row("cudnn_fe", "cuda", "H100", frozenset({MaskKind.DOCUMENTS}), HALF,
        "benchmarks/results/packed-kernels-h100-2026-11-26.json: 1.06-1.51x our Triton kernels on every row "
        "(1.28x at 64K, 1.33x at 128K); its -stream.json, 100 changing rows with graph builds: median step "
        "32.0 against 43.3 ms; packed-h100-x2-2026-11-26.json: the 64K ring 1.51x Triton's. Taken when "
        "nvidia-cudnn-frontend is installed"),
    Row("triton", "cuda", evidence="packed rows: benchmarks/results/packed-h200-x2-2026-11-22.json (faster "
        "than flash_varlen on H200); float32 and GPUs not measured: our kernels"),
    Row("sdpa_cudnn", "cuda", masks=DENSE, dtypes=HALF, evidence="no Triton for this head dim or build"),
    Row("flash_varlen", "cuda", masks=frozenset({MaskKind.DOCUMENTS}), dtypes=HALF,
        evidence="packed rows with head dims the Triton kernels do not compile"),
    Row("reference", evidence="exact on any device, dtype, head dim and mask"),
]

_instances: dict[str, AttentionKernel] = {}


def backend_names() -> tuple[str, ...]:
    """Every name ``backend=`` takes: ``"auto"``, the registered backends and their aliases."""
    return ("auto", *REGISTRY, *ALIASES)


def kernel_named(name: str) -> AttentionKernel:
    """The (cached) kernel of a registered backend or alias; ImportError when its package is missing."""
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}.")
    if name not in _instances:
        _instances[name] = REGISTRY[name]()
    return _instances[name]


def refusal(name: str, request: KernelRequest) -> str | None:
    """Why backend ``name`` cannot serve ``request`` (a phrase after "backend 'name'"), or None."""
    try:
        kernel = kernel_named(name)
    except ImportError as err:
        return f"needs the {err.name or 'missing'} package, which is not installed"
    return kernel.capabilities.refusal(request) or kernel.unavailable(request.device, request.dtype)


def select_backend(backend: str, request: KernelRequest) -> str:
    """The registered backend that serves ``request``: the table's choice for ``"auto"``, else ``backend``
    itself (aliases resolved) after checking it can; raises ValueError naming the problem and the fix."""
    if backend == "auto":
        for row in TABLE:
            if row.backend in REGISTRY and row.matches(request) and refusal(row.backend, request) is None:
                return row.backend
        raise ValueError(f"no registered backend takes this call ({_describe(request)}).")
    kernel_named(backend)  # unknown names: ValueError listing the known ones
    name = ALIASES.get(backend, backend)
    # asked for by name, a backend that cannot differentiate the lse still serves calls that return it: the
    # backward raises only if a gradient does reach the lse
    request = replace(request, lse_grad=False)
    reason = refusal(name, request)
    if reason is None:
        return name
    able = [n for n in REGISTRY if n != name and refusal(n, request) is None]
    fix = f"use backend={' or '.join(repr(n) for n in able)} or 'auto'" if able else "use backend='auto'"
    raise ValueError(f"backend {backend!r} {reason}; {fix}.")


def _describe(request: KernelRequest) -> str:
    return (f"{request.device.type}, {request.dtype}, head dim {request.head_dim}, value head dim "
            f"{request.value_head_dim}, {request.mask.value}, softcap {request.softcap}, lse gradient "
            f"{request.lse_grad}")


def register_backend(name: str, build: Callable[[], AttentionKernel], rows: tuple[Row, ...] = ()) -> None:
    """Make backend ``name`` selectable: ``build()`` makes its kernel; ``rows`` go to the top of
    :data:`TABLE` (where ``auto`` should prefer it). Replaces a backend of the same name."""
    unregister_backend(name)
    REGISTRY[name] = build
    TABLE[:0] = list(rows)


def unregister_backend(name: str) -> None:
    """Remove backend ``name``, its rows and its cached kernel (no-op when absent)."""
    REGISTRY.pop(name, None)
    _instances.pop(name, None)
    TABLE[:] = [row for row in TABLE if row.backend != name]
