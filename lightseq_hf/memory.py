"""Measuring memory: a per-component breakdown of a training step from the allocator, and host peaks.

* :func:`_static_breakdown` — bytes of this rank's parameters, gradients and optimizer state (the
  local shards of FSDP2's DTensors), by device, counting each storage once.
* :class:`StepMemory` — marks a step's phases (``forward``, ``backward``, ``optimizer``) and records,
  from the CUDA caching allocator, what is allocated at each mark and the peak inside each phase;
  :meth:`StepMemory.breakdown` joins both into one dict of GiB (activations = the phase peak minus
  what the static components held then).
* :class:`HostPeak` — the process's peak resident memory over a block (Linux ``VmHWM``, reset
  through ``/proc/self/clear_refs``): host memory is finite too (offload, CPU optimizer state).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["HostPeak", "StepMemory", "memory_budget"]

_GIB = 2**30


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _unique_bytes(tensors: Any) -> dict[str, int]:
    seen: set = set()
    out: dict[str, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key in seen or storage.data_ptr() == 0:
            continue
        seen.add(key)
        out[t.device.type] = out.get(t.device.type, 0) + storage.nbytes()
    return out


def _static_breakdown(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"parameters": {device_type: bytes}, "gradients": ..., "optimizer_state": ...}`` of this rank."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameters": _unique_bytes(params), "gradients": _unique_bytes(grads),
            "optimizer_state": _unique_bytes(state)}


class StepMemory:
    """Allocator marks around a training step on a CUDA device (no-ops elsewhere).

    ``mark(name)`` ends the current phase: it records the bytes allocated now and the phase's peak
    (``max_memory_allocated`` since the previous mark), then resets the peak counter.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.marks: list[dict] = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._last = torch.cuda.memory_allocated(self.device)

    def mark(self, name: str, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        entry = {"phase": name, "allocated": torch.cuda.memory_allocated(self.device),
                 "peak": torch.cuda.max_memory_allocated(self.device),
                 "reserved": torch.cuda.memory_reserved(self.device), "start": self._last}
        if model is not None:
            entry["static"] = {k: v.get(self.device.type, 0)
                               for k, v in _static_breakdown(model, optimizer).items()}
        self.marks.append(entry)
        self._last = entry["allocated"]
        torch.cuda.reset_peak_memory_stats(self.device)

    def breakdown(self) -> dict:
        """GiB per phase: allocated at its start and end, its peak, and the peak minus the static
        components."""
        out = {}
        for m in self.marks:
            row = {"start_gib": m["start"] / _GIB, "allocated_gib": m["allocated"] / _GIB,
                   "peak_gib": m["peak"] / _GIB, "reserved_gib": m["reserved"] / _GIB}
            static = m.get("static")
            if static:
                row.update({f"{k}_gib": v / _GIB for k, v in static.items()})
                row["peak_minus_static_gib"] = (m["peak"] - sum(static.values())) / _GIB
            out[m["phase"]] = row
        return out


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


class HostPeak:
    """``with HostPeak() as peak: ...`` then ``peak.start_bytes``, ``peak.peak_bytes`` and
    ``peak.increase_bytes`` (the block's peak resident memory over its start). Linux only
    (``available`` is False elsewhere). Freed heap memory only leaves the process when the C
    allocator returns it; run with ``MALLOC_MMAP_THRESHOLD_=65536`` for allocations that do."""

    def __init__(self) -> None:
        self.available = _status_kib("VmHWM") is not None
        self.start_bytes = self.peak_bytes = 0

    def __enter__(self) -> HostPeak:
        if self.available:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            except OSError:
                self.available = False
            self.start_bytes = (_status_kib("VmRSS") or 0) * 1024
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.available:
            self.peak_bytes = (_status_kib("VmHWM") or 0) * 1024

    @property
    def increase_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)


def memory_budget(device: torch.device, processes_per_host: int, *, gpu_share: float = 0.95,
                  host_share: float = 0.9) -> tuple[float, float]:
    """``(device bytes, host bytes)`` one rank may plan for: ``gpu_share`` of the device's total memory
    (the planner's error and the allocator's fragmentation need the rest) and ``host_share`` of the
    host memory available now, split over the processes of this host."""
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device).total_memory * gpu_share
    else:
        gpu = float("inf")  # a CPU run: device memory is host memory, counted there
    available = (_meminfo_kib("MemAvailable") or 0) * 1024
    return gpu, available * host_share / max(1, processes_per_host)


def _meminfo_kib(field: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None
