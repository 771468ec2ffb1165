"""Which tensors hold a phase's peak: the caching allocator's recorded history (CUDA), replayed.

:func:`recording` records every allocation with its Python stack over a block (torch's memory history,
``torch.cuda.memory._record_memory_history``) and gives the events; :func:`peak_sites` replays them to the
largest total allocated within the block and groups what is alive there by allocation site (the innermost
frames of ``lightseq_hf`` or ``transformers``), with each site's bytes per token. Tensors allocated before
the block are not in the events, so the peak is the block's growth above its start.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch

#: the source trees whose frames name a site
SITE_TREES = ("/lightseq_hf/", "/transformers/")


def site(frames: list[dict], depth: int = 3) -> str:
    """``file:line:function`` of the ``depth`` innermost frames inside :data:`SITE_TREES`, innermost
    first (else the innermost frame of any file)."""
    ours = [f for f in frames if any(tree in f["filename"] for tree in SITE_TREES)] or frames[:1]
    if not ours:
        return "unknown"
    return " <- ".join(f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']}:{f['name']}"
                       for f in ours[:depth])


def live_at_peak(events: list[dict]) -> tuple[int, dict[int, tuple[int, list]]]:
    """``(peak, live)``: the largest total of the events' allocations alive at once (frees of blocks
    allocated before the events are ignored) and ``{address: (bytes, frames)}`` alive at that point."""
    now = peak = 0
    at = -1
    sizes: dict[int, int] = {}
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            now += event["size"]
            if now > peak:
                peak, at = now, i
        elif event["action"] == "free_requested" and event["addr"] in sizes:
            now -= sizes.pop(event["addr"])
    live: dict[int, tuple[int, list]] = {}
    for event in events[:at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return peak, live


def peak_sites(events: list[dict], tokens: int, top: int = 20, min_bytes: int = 2**20) -> dict:
    """The peak above the block's start and the sites alive there, largest first: ``{"peak_bytes",
    "bytes_per_token", "sites": [{"site", "bytes", "tensors", "bytes_per_token"}]}`` (sites under
    ``min_bytes`` left out, at most ``top``)."""
    peak, live = live_at_peak(events)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in live.values():
        group = groups[site(frames)]
        group[0] += size
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    sites = [{"site": name, "bytes": size, "tensors": count, "bytes_per_token": size / tokens}
             for name, (size, count) in ranked if size >= min_bytes][:top]
    return {"peak_bytes": peak, "bytes_per_token": peak / tokens, "sites": sites}


@contextlib.contextmanager
def recording(device: torch.device, max_entries: int = 1_000_000) -> Iterator[list[dict]]:
    """Record the allocator's history of ``device`` (CUDA) over the block; the list it yields is filled
    with the block's events when the block ends."""
    if device.type != "cuda":
        raise RuntimeError("tracing allocation sites needs a CUDA device (the caching allocator's history)")
    events: list[dict] = []
    torch.cuda.synchronize(device)
    try:  # only this block's events
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", clear_history=True)
    except TypeError:  # a torch without clear_history starts each recording afresh
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield events
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
        events.extend(snapshot["device_traces"][device.index or 0])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
