"""What a device is, for choosing its attention backend: its type, compute capability, torch's cuDNN version
and the optional kernel packages installed. Never its name: an H100, an H200, a GH200 and an H20 are one
class (compute capability 9.0), and a GPU a table never heard of still has a class.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from functools import cache

import torch

__all__ = ["OPTIONAL_PACKAGES", "DeviceClass", "device_class", "version_text"]

#: the optional packages whose kernels a backend may use (distribution names)
OPTIONAL_PACKAGES = ("nvidia-cudnn-frontend", "flash-attn")


def version_text(version: int) -> str:
    """cuDNN's ``major * 10000 + minor * 100 + patch`` as ``major.minor.patch``."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


@dataclass(frozen=True)
class DeviceClass:
    """``kind``: the device type (``"cuda"``, ``"cpu"``, ...). ``capability``: the GPU's compute capability
    (None: not a GPU, or not known). ``cudnn``: the cuDNN torch loaded (``major * 10000 + minor * 100 +
    patch``; None: none). ``packages``: which of :data:`OPTIONAL_PACKAGES` are installed."""

    kind: str
    capability: tuple[int, int] | None = None
    cudnn: int | None = None
    packages: frozenset[str] = field(default_factory=frozenset)

    def __str__(self) -> str:
        cap = self.capability
        parts = [self.kind if cap is None else f"{self.kind} sm{cap[0]}{cap[1]}"]
        if self.cudnn is not None:
            parts.append(f"cuDNN {version_text(self.cudnn)}")
        parts += sorted(self.packages) or ["no optional kernel package"]
        return ", ".join(parts)


def _installed(package: str) -> bool:
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@cache
def device_class(device: torch.device) -> DeviceClass:
    """The class of ``device`` (found once per device; ``device_class.cache_clear()`` forgets)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceClass(device.type)
    capability = None
    if torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        capability = tuple(torch.cuda.get_device_capability(index))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    packages = frozenset(p for p in OPTIONAL_PACKAGES if _installed(p))
    return DeviceClass("cuda", capability, cudnn, packages)
