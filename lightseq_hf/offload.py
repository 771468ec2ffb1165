"""Offload of what gradient checkpointing keeps, to pinned host memory, prefetched one layer ahead.

A checkpointed decoder layer keeps its input (saved by ``torch.utils.checkpoint``) and, under
rematerialization-aware checkpointing, the distributed attention's (out, lse), which selective
checkpointing holds in its cache. :class:`CheckpointOffloader` moves both to host memory:

* forward: ``saved_tensors_hooks`` around each checkpoint call catch the saved inputs; after the
  call, the tensors the selective-checkpoint cache kept are taken from it. Each goes to a pinned
  host buffer, copied on a side CUDA stream once the compute stream has produced it (an event
  orders the two; ``record_stream`` keeps the allocator from reusing the device memory before the
  copy ends). Every checkpoint call is one *group*, numbered in forward order.
* backward: the first unpack of group ``k`` (the recompute of layer ``k`` starts by unpacking its
  input) waits for group ``k``'s input, starts copying its cached attention tensors and starts
  copying group ``k - 1``'s input on the side stream, so the next layer's input arrives while this
  layer recomputes and differentiates. The attention tensors go back into the selective-checkpoint
  cache at once, and the compute stream waits for their copy only where the recompute reaches the
  attention (the cache entry's first read): the norm and projections before it overlap the copy. So
  the device holds, beyond the layer in backward, one layer's input in flight.

Host buffers come from a :class:`HostBufferPool`: exact sizes, pinned once with
``cudaHostRegister`` and reused every step. (torch's pinned allocator rounds each request up to a
power of two: a 2.25 GiB layer input would hold 4 GiB of host memory.) Every host copy of a device
runs on one side stream, so a buffer released after its copy back can be reused at once: the next
copy into it is queued behind.

Which checkpointed layers offload, and which of those keep only their input (plain recompute), is an
:class:`OffloadPlan` (:func:`offload_plan` reads one from an ``offload_checkpoints`` value): the memory
planner chooses it, :func:`lightseq_hf.checkpoint.route_checkpointing` carries it out.

On a CPU device the "host copy" is a plain copy (no streams): the mechanism, and its exactness,
can be tested without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["CheckpointOffloader", "HostBufferPool", "OffloadPlan", "OffloadStats", "offload_plan"]

#: tensors smaller than this stay where they are (a copy costs more than it frees)
_MIN_OFFLOAD_BYTES = 1024


@dataclass(frozen=True)
class OffloadPlan:
    """Per decoder layer, where checkpointing keeps what it saves and what it keeps: the first
    ``layers`` checkpointed layers keep it in pinned host memory (the last ones, which backward needs
    first, on the device); the first ``recompute`` keep only their input, their attention forward
    running again in backward (plain recompute instead of remat: half the bytes per token, one more
    attention forward per step each)."""

    layers: int
    recompute: int = 0


_EVERY_LAYER = 2**31
_OFFLOAD_HELP = ("use True (every layer), False, a number of layers N >= 0 (the first N decoder layers keep "
                 "their checkpoints in host memory), or {'layers': N, 'recompute': R} (of the first R layers "
                 "only the input is kept: plain recompute).")


def offload_plan(offload: bool | int | Mapping | OffloadPlan | None) -> OffloadPlan:
    """The :class:`OffloadPlan` of an ``offload_checkpoints`` value: ``True`` every layer, ``False`` none,
    ``N`` the first N, a mapping with ``layers`` (and ``recompute``), or a plan; ValueError otherwise."""
    if isinstance(offload, OffloadPlan):
        plan = offload
    elif offload is True:
        plan = OffloadPlan(_EVERY_LAYER)
    elif offload is False or offload is None:
        plan = OffloadPlan(0)
    elif isinstance(offload, int):
        plan = OffloadPlan(offload)
    elif isinstance(offload, Mapping) and set(offload) <= {"layers", "recompute"} and "layers" in offload:
        plan = OffloadPlan(**offload)
    else:
        raise ValueError(f"offload_checkpoints={offload!r}: {_OFFLOAD_HELP}")
    for value in (plan.layers, plan.recompute):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"offload_checkpoints={offload!r}: {_OFFLOAD_HELP}")
    return plan


@dataclass
class OffloadStats:
    """What an offloader did (tests assert the mechanism with it)."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0  # too small, parameters, or not dense: kept on the device
    cache_tensors: int = 0  # of the offloaded, those taken from the selective-checkpoint cache
    prefetched_groups: int = 0  # fetched ahead, before their own unpack
    prefetched_bytes_peak: int = 0  # the most bytes on the device for groups whose backward has not begun
    # group ids in the order the last backward first used them (the list starts again with each step's
    # first forward, so it stays one step long)
    fetch_order: list = field(default_factory=list)
    host_bytes_peak: int = 0
    host_bytes_live: int = 0
    host_bytes_reserved: int = 0  # the pool's buffers, in use or free (pinned for the process)
    host_buffers_allocated: int = 0  # buffers the pool created (steady state: none after the first step)


class HostBufferPool:
    """Host buffers of exact byte sizes, reused: ``take`` a free one of that size or make one,
    ``give_back`` it when its tensor is no longer needed. With ``pin``, each new buffer is page-locked
    with ``cudaHostRegister`` (asynchronous copies, no power-of-two rounding); ``release`` unpins and
    frees the free ones."""

    def __init__(self, stats: OffloadStats, *, pin: bool) -> None:
        self.stats = stats
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        # every buffer made, by address: they live as long as the pool, so none is freed while still
        # registered (freed, its pages could come back registered in a new allocation: CUDA refuses those)
        self._buffers: dict[int, torch.Tensor] = {}
        self._pinned: set[int] = set()
        weakref.finalize(self, _unregister, self._pinned)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` backed by a pool buffer (contents undefined)."""
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._free.get(nbytes)
        buffer = free.pop() if free else self._new(nbytes)
        return buffer.view(dtype).view(shape)

    def give_back(self, tensor: torch.Tensor) -> None:
        buffer = tensor.view(-1).view(torch.uint8)
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def release(self) -> int:
        """Free the buffers not in use (unpinned first); returns the bytes freed."""
        freed = 0
        for buffers in self._free.values():
            for buffer in buffers:
                address = buffer.data_ptr()
                if address in self._pinned:
                    torch.cuda.cudart().cudaHostUnregister(address)
                    self._pinned.discard(address)
                self._buffers.pop(address, None)
                freed += buffer.numel()
        self._free.clear()
        self.stats.host_bytes_reserved -= freed
        return freed

    def _new(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            code = int(getattr(status, "value", status))
            if code != 0:
                raise RuntimeError(
                    f"lightseq_hf: cannot page-lock {nbytes / 2**30:.2f} GiB of host memory for checkpoint "
                    f"offload (cudaHostRegister error {code}); the host is out of lockable memory. Offload "
                    "fewer layers (offload_checkpoints=N) or raise the memlock limit (ulimit -l).")
            self._pinned.add(buffer.data_ptr())
        self._buffers[buffer.data_ptr()] = buffer
        self.stats.host_bytes_reserved += nbytes
        self.stats.host_buffers_allocated += 1
        return buffer


class _Slot:
    """One saved tensor: on the device (kept), or in host memory until fetched back."""

    __slots__ = ("group", "device_tensor", "host", "device", "d2h_done", "h2d_done", "cache_entry",
                 "offloader", "__weakref__")

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.device_tensor: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.device: torch.device | None = None
        self.d2h_done: Any = None
        self.h2d_done: Any = None
        self.cache_entry: Any = None  # the selective-checkpoint cache wrapper to refill
        self.offloader: CheckpointOffloader | None = None

    def __del__(self) -> None:
        if self.host is not None and self.offloader is not None:
            self.offloader.stats.host_bytes_live -= self.host.numel() * self.host.element_size()
            pool = self.offloader.pool(self.device)
            if pool is not None:
                pool.give_back(self.host)


class _Group:
    """The slots of one checkpoint call (one layer)."""

    __slots__ = ("index", "slots", "state", "__weakref__")

    STORED, PREFETCHING, FETCHED = 0, 1, 2

    def __init__(self, index: int) -> None:
        self.index = index
        self.slots: list[weakref.ref] = []
        self.state = _Group.STORED


class CheckpointOffloader:
    """Holds the tensors checkpointed layers keep in (pinned) host memory; see the module docstring.

    One offloader serves all the layers of a model (the prefetch follows its numbering).
    ``min_bytes``: smaller tensors stay on the device.
    """

    def __init__(self, *, min_bytes: int = _MIN_OFFLOAD_BYTES) -> None:
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._groups: weakref.WeakValueDictionary[int, _Group] = weakref.WeakValueDictionary()
        self._next_index = 0
        self._streams: dict[torch.device, Any] = {}
        self._pools: dict[str, HostBufferPool] = {}
        self._warned = False
        self._fetched_since_forward = False
        self._prefetched_bytes = 0

    def pool(self, device: torch.device | None) -> HostBufferPool | None:
        """The host buffer pool for tensors of ``device`` (pinned for CUDA; None for host tensors)."""
        if device is None:
            return None
        key = device.type
        if key not in self._pools:
            self._pools[key] = HostBufferPool(self.stats, pin=device.type == "cuda")
        return self._pools[key]

    def release_host_memory(self) -> int:
        """Free (and unpin) the pooled host buffers no step is using; returns the bytes freed. The
        next step allocates them again: call it when training ends, not between steps."""
        return sum(pool.release() for pool in self._pools.values())

    # ------------------------------------------------------------------ forward

    @contextlib.contextmanager
    def group(self) -> Iterator[_Group]:
        """Open a group: tensors saved inside go to host memory (and come back in backward)."""
        if self._fetched_since_forward:  # the first forward group of a new step
            self.stats.fetch_order.clear()
            self._fetched_since_forward = False
        group = _Group(self._next_index)
        self._next_index += 1
        self._groups[group.index] = group

        def pack(tensor: torch.Tensor) -> _Slot:
            return self._pack(group, tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield group

    def take_cache(self, group: _Group, storage: Any) -> list[_Slot]:
        """Offload the tensors a selective-checkpoint cache (``storage`` of its caching mode) kept.

        Returns their slots; they hold the group alive, so keep them with the cache (the caller
        does, through the cache entries). Left on the device when ``group`` has no saved input
        through which backward would bring them back, or when the cache layout is not the
        expected one (a warning says so).
        """
        if not any(ref() is not None for ref in group.slots):
            return []
        wrappers = _cache_wrappers(storage)
        if wrappers is None:
            if not self._warned:
                warnings.warn("lightseq_hf: this torch's selective-checkpoint cache has an unknown layout; "
                              "the attention outputs remat keeps stay on the device (layer inputs are "
                              "still offloaded).", RuntimeWarning, stacklevel=2)
                self._warned = True
            return []
        slots = []
        for wrapper in wrappers:
            tensor = wrapper.val
            if not self._offloadable(tensor):
                continue
            slot = self._offload(group, tensor)
            slot.cache_entry = wrapper
            wrapper.val = None  # the device memory goes when the forward lets go of the tensor
            wrapper.lightseq_slot = slot  # the cache entry keeps its slot (and group) alive
            self.stats.cache_tensors += 1
            slots.append(slot)
        return slots

    def _offloadable(self, tensor: Any) -> bool:
        return (isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter)
                and tensor.is_contiguous() and type(tensor) is torch.Tensor
                and tensor.numel() * tensor.element_size() >= self.min_bytes)

    def _pack(self, group: _Group, tensor: torch.Tensor) -> _Slot:
        if not self._offloadable(tensor):
            slot = _Slot(group)
            slot.device_tensor = tensor
            group.slots.append(weakref.ref(slot))
            self.stats.kept_tensors += 1
            return slot
        return self._offload(group, tensor)

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _offload(self, group: _Group, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(group)
        slot.offloader = self
        slot.device = tensor.device
        tensor = tensor.detach()
        if tensor.device.type == "cuda":
            side = self._stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            host = self.pool(tensor.device).take(tensor.shape, tensor.dtype)
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
                slot.d2h_done = torch.cuda.Event()
                slot.d2h_done.record(side)
            tensor.record_stream(side)  # not reused before the copy has read it
        else:
            host = self.pool(tensor.device).take(tensor.shape, tensor.dtype)
            host.copy_(tensor)
        slot.host = host
        group.slots.append(weakref.ref(slot))
        size = host.numel() * host.element_size()
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += size
        self.stats.host_bytes_live += size
        self.stats.host_bytes_peak = max(self.stats.host_bytes_peak, self.stats.host_bytes_live)
        return slot

    # ------------------------------------------------------------------ backward

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        group = slot.group
        if group.state != _Group.FETCHED:
            self._fetch(group, prefetch=False)
            previous = self._groups.get(group.index - 1)
            if previous is not None and previous.state == _Group.STORED:
                self._fetch(previous, prefetch=True)
        tensor = slot.device_tensor
        if tensor is None:  # a slot created after its group was fetched (cannot happen in checkpoint)
            tensor = self._copy_in(slot, wait=True)
        return tensor

    def _fetch(self, group: _Group, *, prefetch: bool) -> None:
        """Prefetch: start copying the group's saved inputs. Else: wait for those, start copying the
        tensors of its selective-checkpoint cache and hand them back to the cache (read once copied)."""
        slots = [s for s in (ref() for ref in group.slots) if s is not None]
        if prefetch:
            for slot in slots:
                if (slot.cache_entry is None and slot.host is not None and slot.h2d_done is None
                        and slot.device_tensor is None):
                    self._copy_in(slot, wait=False)
                    self._prefetched_bytes += slot.host.numel() * slot.host.element_size()
            self.stats.prefetched_bytes_peak = max(self.stats.prefetched_bytes_peak, self._prefetched_bytes)
            self.stats.prefetched_groups += 1
            group.state = _Group.PREFETCHING  # copies in flight; the group's own unpack completes it
            return
        if group.state == _Group.PREFETCHING:
            self._prefetched_bytes -= sum(slot.host.numel() * slot.host.element_size() for slot in slots
                                          if slot.cache_entry is None and slot.host is not None)
        group.state = _Group.FETCHED
        self.stats.fetch_order.append(group.index)
        self._fetched_since_forward = True
        for slot in slots:
            if slot.host is not None and slot.device_tensor is None:
                self._copy_in(slot, wait=False)
            if slot.cache_entry is not None:
                _refill_cache_entry(slot.cache_entry, slot.device_tensor, slot.h2d_done)
                slot.cache_entry = slot.device_tensor = slot.h2d_done = None  # the cache holds it now
            elif slot.h2d_done is not None:
                torch.cuda.current_stream(slot.device).wait_event(slot.h2d_done)
                slot.device_tensor.record_stream(torch.cuda.current_stream(slot.device))
                slot.h2d_done = None

    def _copy_in(self, slot: _Slot, *, wait: bool) -> torch.Tensor:
        host = slot.host
        if slot.device.type == "cuda":
            side = self._stream(slot.device)
            with torch.cuda.stream(side):
                side.wait_event(slot.d2h_done)  # the offload copy has finished
                tensor = torch.empty(host.shape, dtype=host.dtype, device=slot.device)
                tensor.copy_(host, non_blocking=True)
                slot.h2d_done = torch.cuda.Event()
                slot.h2d_done.record(side)
            if wait:
                current = torch.cuda.current_stream(slot.device)
                current.wait_event(slot.h2d_done)
                tensor.record_stream(current)
                slot.h2d_done = None
        else:
            tensor = host.clone()  # the "device" copy (the host buffer goes back to the pool)
        slot.device_tensor = tensor
        return tensor


def _refill_cache_entry(entry: Any, tensor: torch.Tensor, copy_done: Any) -> None:
    """Put ``tensor`` back into its selective-checkpoint cache ``entry``. While its host-to-device copy may
    still run (``copy_done``: the copy's event; None once waited for), the entry's first read makes the
    compute stream wait for it (a wrapper class without ``get_val`` gets the wait now)."""
    entry.val = tensor
    if getattr(entry, "version", None) is not None:
        entry.version = tensor._version
    if copy_done is None:
        return

    def wait_for_copy() -> None:
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(copy_done)
        tensor.record_stream(current)

    read = getattr(type(entry), "get_val", None)
    if read is None:
        wait_for_copy()
        return
    entry_ref = weakref.ref(entry)  # no cycle through the entry's own attribute

    def get_val(*args: Any, **kwargs: Any) -> Any:
        this = entry_ref()
        del this.get_val  # the class's method again
        wait_for_copy()
        return read(this, *args, **kwargs)

    entry.get_val = get_val


def _unregister(pinned: set[int]) -> None:
    """Unpin a dead pool's buffers (before their memory is freed: the pool held them until now)."""
    for address in pinned:
        torch.cuda.cudart().cudaHostUnregister(address)
    pinned.clear()


def _cache_wrappers(storage: Any) -> list | None:
    """The version-checked wrappers of a selective-checkpoint cache (torch >= 2.4: a mapping from
    op to a list or dict of pytrees of ``_VersionWrapper``); None for an unknown layout."""
    if not isinstance(storage, dict):
        return None
    found = []
    for entries in storage.values():
        if isinstance(entries, dict):
            entries = list(entries.values())
        elif not isinstance(entries, list):
            return None
        for entry in entries:
            leaves, _ = tree_flatten(entry)
            for leaf in leaves:
                if hasattr(leaf, "val") and hasattr(leaf, "version"):
                    found.append(leaf)
    return found
