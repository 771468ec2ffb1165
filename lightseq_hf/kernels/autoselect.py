"""Backend selection, in one place: the registry of backends and the table ``backend="auto"`` reads.

Every backend is a :class:`~lightseq_hf.kernels.base.KernelBase` subclass in its own module that declares
its :class:`~lightseq_hf.kernels.base.Capabilities`. :data:`REGISTRY` names how to build each one (modules
are imported on first use, so a backend whose package is missing costs nothing until asked for).

``auto`` keys its choice on what the device is (:class:`~lightseq_hf.kernels.device_class.DeviceClass`:
compute capability, torch's cuDNN, the optional packages installed), the dtype, the head dim and the mask
kind; never on the GPU's name. :data:`TABLE` lists, in order:

1. measured rows: on a device class, the backend a results file in ``benchmarks/results`` measured fastest
   for a mask kind, dtype and head dims (the row cites the file);
2. the vendor kernels, for any class without a measured row: cuDNN attention through torch for dense masks
   (FlashAttention-2 where cuDNN's is missing), cuDNN's variable-length attention from
   ``nvidia-cudnn-frontend`` for packed documents when it is installed (else torch's FlashAttention-2
   varlen kernels);
3. our Triton kernels, only for calls no vendor kernel takes (float32, sliding windows, a gradient through
   the lse, head dims beyond them), and the reference kernel, which takes everything.

The first row that matches the call and whose backend's capabilities take it (head dims, softcap, value
head dim, mask) and that can run now wins; :func:`describe` says which and why. An explicit backend is
checked against the same capabilities and refused with a message that names what it lacks and which
backends have it.

Adding a backend: its module, one entry in :data:`REGISTRY`, and a measured row in :data:`TABLE` (or
:func:`register_backend` from outside the package).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .base import AttentionKernel, KernelRequest, MaskKind
from .device_class import DeviceClass, device_class

__all__ = ["ALIASES", "REGISTRY", "Row", "Selection", "TABLE", "backend_names", "describe", "kernel_named",
           "refusal", "register_backend", "select_backend", "unregister_backend"]

_ALL_MASKS = frozenset(MaskKind)
_DENSE = frozenset({MaskKind.CAUSAL, MaskKind.FULL})
_PACKED_MASKS = frozenset({MaskKind.DOCUMENTS})
_HALF = frozenset({torch.float16, torch.bfloat16})
_FRONTEND = "nvidia-cudnn-frontend"
_HOPPER = (9, 0)
_AMPERE = (8, 0)


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
    "flash_varlen": _loader(".varlen.flash", "FlashVarlenKernel"),
    "cudnn_fe": _loader(".varlen.cudnn", "CudnnFeKernel"),
}
ALIASES = {"sdpa": "sdpa_cudnn"}


@dataclass(frozen=True)
class Row:
    """``backend`` for calls on ``device`` (a device type; ``"*"``: any) whose class has exactly compute
    capability ``capability`` (None: any) and at least ``min_capability``, torch's cuDNN at least
    ``min_cudnn`` and ``packages`` installed, with a mask in ``masks``, a dtype in ``dtypes`` and a head dim
    in ``head_dims`` (None: any). ``evidence``: the results file that measured it fastest on that class
    (empty for the vendor and last-resort rows, which say ``why`` instead)."""

    backend: str
    device: str = "cuda"
    capability: tuple[int, int] | None = None
    masks: frozenset[MaskKind] = _ALL_MASKS
    dtypes: frozenset[torch.dtype] | None = None
    head_dims: frozenset[int] | None = None
    min_capability: tuple[int, int] | None = None
    min_cudnn: int | None = None
    packages: frozenset[str] = field(default_factory=frozenset)
    evidence: str = ""
    why: str = ""

    def mismatch(self, request: KernelRequest, cls: DeviceClass) -> str | None:
        """Why the row does not apply to ``request`` on ``cls`` (None: it does)."""
        if self.device != "*" and cls.kind != self.device:
            return f"measured on {self.device} devices"
        if self.capability is not None and cls.capability != self.capability:
            return f"measured on compute capability {self.capability[0]}.{self.capability[1]}"
        low = self.min_capability
        if low is not None and (cls.capability is None or cls.capability < low):
            return f"needs compute capability {low[0]}.{low[1]} or later"
        if self.min_cudnn is not None and (cls.cudnn is None or cls.cudnn < self.min_cudnn):
            return f"needs torch's cuDNN {self.min_cudnn // 10000}.{self.min_cudnn // 100 % 100} or later"
        missing = sorted(self.packages - cls.packages)
        if missing:
            return f"needs the {', '.join(missing)} package, which is not installed"
        if request.mask not in self.masks:
            return f"not for {request.mask.value}"
        if self.dtypes is not None and request.dtype is not None and request.dtype not in self.dtypes:
            return f"not for {_name(request.dtype)}"
        dims = self.head_dims
        if dims is not None and request.head_dim is not None and request.head_dim not in dims:
            return f"measured for head dims {', '.join(map(str, sorted(dims)))}"
        return None


_KERNELS = "benchmarks/results/kernels-h100-2026-11-22.json"
_PACKED = "benchmarks/results/packed-kernels-h100-2026-11-26.json"

#: The rows ``auto`` reads, first match wins (see the module docstring); rows whose backend cannot take the
#: call (head dim, softcap, ...) or cannot run (no package, no op in this torch build) are passed over.
TABLE: list[Row] = [
    # measured: compute capability 9.0 (H100, H200, GH200, H20)
    Row("sdpa_cudnn", capability=_HOPPER, masks=_DENSE, dtypes=_HALF, head_dims=frozenset({64, 128}),
        min_cudnn=91900,
        evidence=f"{_KERNELS}: forward+backward 1.19-2.02x faster than our Triton kernels and 1.49-2.07x "
                 "than FlashAttention-2 on every row (4K-64K tokens, heads 32/32, 32/8, 8/8, 8/2, d64 and "
                 "d128, causal and full; H100, cuDNN 9.19); kernels-h100-2026-11-26-gqa.json: the same at "
                 "16K-32K, heads 32/8"),
    Row("cudnn_fe", capability=_HOPPER, masks=_PACKED_MASKS, dtypes=_HALF, head_dims=frozenset({64, 128}),
        packages=frozenset({_FRONTEND}),
        evidence=f"{_PACKED}: fastest registered backend on every row, 1.06-1.51x our Triton kernels and "
                 "1.16-1.57x FlashAttention-2 varlen (16K-128K tokens, heads 32/32 and 32/8, d64 and d128; "
                 "H100, cuDNN 9.19, nvidia-cudnn-frontend 1.32.0); "
                 "packed-kernels-h100-2026-11-26-stream.json: 100 changing rows with graph builds, median "
                 "step 32.0 against Triton's 43.3 ms"),
    Row("triton", capability=_HOPPER, masks=_PACKED_MASKS, dtypes=_HALF, head_dims=frozenset({128}),
        evidence=f"{_PACKED} and packed-kernels-h100-2026-11-25.json, without nvidia-cudnn-frontend, "
                 "d128: our Triton kernels 1.03-1.16x faster than FlashAttention-2 varlen at 64K-128K "
                 "tokens and 1.10-1.11x at 16K-32K with heads 32/32; FlashAttention-2 varlen 1.02-1.11x "
                 "faster at 16K-32K with heads 32/8"),
    Row("flash_varlen", capability=_HOPPER, masks=_PACKED_MASKS, dtypes=_HALF, head_dims=frozenset({64}),
        evidence=f"{_PACKED} and packed-kernels-h100-2026-11-25.json, without nvidia-cudnn-frontend, "
                 "d64 at 64K tokens: FlashAttention-2 varlen 1.09-1.13x faster than our Triton kernels"),
    # the vendor kernels: any class without a measured row
    Row("sdpa_cudnn", masks=_DENSE, min_capability=_AMPERE, min_cudnn=90000,
        why="the vendor kernel for dense masks: cuDNN attention through torch"),
    Row("sdpa_flash", masks=_DENSE, min_capability=_AMPERE,
        why="the vendor kernel for dense masks where torch's cuDNN attention is not available: "
            "FlashAttention-2"),
    Row("cudnn_fe", masks=_PACKED_MASKS, min_capability=_AMPERE, packages=frozenset({_FRONTEND}),
        why="the vendor kernel for packed documents: cuDNN's variable-length attention "
            "(nvidia-cudnn-frontend)"),
    Row("flash_varlen", masks=_PACKED_MASKS, min_capability=_AMPERE,
        why="the vendor kernel for packed documents without nvidia-cudnn-frontend: torch's "
            "FlashAttention-2 varlen kernels"),
    # the last resorts
    Row("triton", why="no vendor kernel takes this call: our Triton kernels"),
    Row("reference", device="*", why="exact on any device, dtype, head dim and mask"),
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


@dataclass(frozen=True)
class Selection:
    """Which backend a call gets (``backend``), ``why``, the results file that measured it (``evidence``,
    empty when none did), the ``device_class`` it was chosen for, and the rows passed over on the way with
    their reasons (``passed_over``: ``(backend, reason)``)."""

    backend: str
    why: str
    evidence: str
    device_class: DeviceClass
    request: KernelRequest
    passed_over: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        text = f"backend {self.backend!r} for {_describe(self.request, brief=True)} on {self.device_class}: "
        text += self.why + (f" ({self.evidence})" if self.evidence else "")
        skipped = [f"{name}: {reason}" for name, reason in self.passed_over]
        return text + (f"; passed over {'; '.join(skipped)}" if skipped else "")


def _choose(request: KernelRequest, cls: DeviceClass) -> Selection:
    passed = []
    for row in TABLE:
        if row.backend not in REGISTRY:
            continue
        reason = row.mismatch(request, cls)
        if reason is not None:
            if request.mask in row.masks and row.device in ("*", cls.kind):
                passed.append((row.backend, reason))
            continue
        reason = refusal(row.backend, request)
        if reason is None:
            why = row.why or f"measured fastest on this device class for {request.mask.value}"
            return Selection(row.backend, why, row.evidence, cls, request, tuple(passed))
        passed.append((row.backend, reason))
    raise ValueError(f"no registered backend takes this call ({_describe(request)}).")


def describe(backend: str = "auto", request: KernelRequest | None = None, *,
             device_class: DeviceClass | None = None) -> Selection:
    """Which backend a call described by ``request`` gets from ``backend`` (default ``"auto"``) and why
    (:class:`Selection`; ``str()`` of it is one line). ``request`` defaults to a causal bfloat16 call with
    head dim 128 on the current CUDA device (the CPU without one); ``device_class`` replaces what the
    request's device is (to ask about another class). Raises ValueError as :func:`select_backend` does."""
    if request is None:
        where = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        request = KernelRequest(where, torch.bfloat16, 128, 128, MaskKind.CAUSAL)
    cls = device_class if device_class is not None else _device_class_of(request.device)
    if backend == "auto":
        return _choose(request, cls)
    name = select_backend(backend, request, device_class=cls)
    return Selection(name, "asked for by name", "", cls, request)


def _device_class_of(device: torch.device) -> DeviceClass:
    return device_class(device)


def select_backend(backend: str, request: KernelRequest, *, device_class: DeviceClass | None = None) -> str:
    """The registered backend that serves ``request``: the table's choice for ``"auto"`` on the request's
    device class (or ``device_class``), else ``backend`` itself (aliases resolved) after checking it can;
    raises ValueError naming the problem and the fix."""
    if backend == "auto":
        cls = device_class if device_class is not None else _device_class_of(request.device)
        return _choose(request, cls).backend
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


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(request: KernelRequest, brief: bool = False) -> str:
    if brief:
        return (f"{request.mask.value}, {_name(request.dtype)}, head dim {request.head_dim}"
                + (", softcap" if request.softcap else "") + (", lse gradient" if request.lse_grad else ""))
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
