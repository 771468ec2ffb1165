"""Where the time of a traced distributed-attention step goes, per rank, from torch profiler traces.

Reads the chrome traces ``bench_dist_attn.py --trace`` writes (one per rank) and splits each rank's GPU
timeline, from its first to its last kernel, into:

- ``compute_ms``: time some non-communication kernel runs (attention, merges, copies);
- ``exposed_comm_ms``: compute idle while a NCCL kernel runs, by where it falls: ``first`` (before the
  first attention kernel: the first transfers), ``last`` (after the last attention kernel: the returned
  results and gradients) and ``between`` (waits on a transfer inside the loop);
- ``idle_ms``: nothing runs on the GPU (the host is late: launch gaps, Python between kernels);
- ``contention_ms``: how much longer the attention kernels that overlapped a NCCL kernel ran than the
  same kernels (name and grid) without one, summed (SMs and memory bandwidth taken by the transfers).

Usage: ``python scripts/trace_exposure.py TRACE [TRACE ...] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

ATTENTION_NAMES = ("fmha", "flash", "attn", "sdpa", "cudnn")

Interval = tuple[float, float]


def load_kernels(path: Path) -> list[dict]:
    """The GPU kernels of a chrome trace: name, start and end (microseconds), stream, grid."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            args = e.get("args", {})
            start = float(e["ts"])
            kernels.append({"name": e["name"], "start": start, "end": start + float(e["dur"]),
                            "stream": args.get("stream"), "grid": str(args.get("grid"))})
    return sorted(kernels, key=lambda k: k["start"])


def is_comm(kernel: dict) -> bool:
    return "nccl" in kernel["name"].lower()


def is_attention(kernel: dict) -> bool:
    name = kernel["name"].lower()
    return not is_comm(kernel) and any(s in name for s in ATTENTION_NAMES)


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, merged intervals."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def gaps(busy: list[Interval], start: float, end: float) -> list[Interval]:
    """The parts of ``[start, end)`` outside the merged ``busy`` intervals."""
    out, t = [], start
    for a, b in busy:
        if a > t:
            out.append((t, min(a, end)))
        t = max(t, b)
    if t < end:
        out.append((t, end))
    return [(a, b) for a, b in out if b > a]


def overlap(a: Interval, busy: list[Interval]) -> float:
    """Length of ``a`` covered by the merged ``busy`` intervals."""
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in busy)


def contention(kernels: list[dict], comm: list[Interval]) -> float:
    """Extra microseconds of attention kernels that ran beside a transfer, against the median of the same
    (name, grid) kernels that ran alone; 0 where a kernel never ran alone."""
    alone, beside = defaultdict(list), defaultdict(list)
    for k in kernels:
        if is_attention(k):
            key = (k["name"], k["grid"])
            dur = k["end"] - k["start"]
            (beside if overlap((k["start"], k["end"]), comm) > 0 else alone)[key].append(dur)
    return sum(max(0.0, d - statistics.median(alone[key])) for key, durs in beside.items() if alone[key]
               for d in durs)


def exposure(kernels: list[dict]) -> dict:
    """The breakdown of one rank's timeline (module docstring), in milliseconds."""
    if not kernels:
        raise ValueError("the trace holds no GPU kernels (was it recorded with ProfilerActivity.CUDA?)")
    start, end = kernels[0]["start"], max(k["end"] for k in kernels)
    comm = union([(k["start"], k["end"]) for k in kernels if is_comm(k)])
    compute = union([(k["start"], k["end"]) for k in kernels if not is_comm(k)])
    attention = [k for k in kernels if is_attention(k)]
    first = attention[0]["start"] if attention else start
    last = max(k["end"] for k in attention) if attention else end
    exposed = {"first": 0.0, "between": 0.0, "last": 0.0}
    idle = 0.0
    for a, b in gaps(compute, start, end):
        with_comm = overlap((a, b), comm)
        idle += (b - a) - with_comm
        where = "first" if b <= first else "last" if a >= last else "between"
        exposed[where] += with_comm
    ms = 1e-3
    return {"window_ms": (end - start) * ms,
            "compute_ms": sum(b - a for a, b in compute) * ms,
            "exposed_comm_ms": {k: v * ms for k, v in exposed.items()},
            "exposed_comm_total_ms": sum(exposed.values()) * ms,
            "idle_ms": idle * ms,
            "comm_ms": sum(b - a for a, b in comm) * ms,
            "contention_ms": contention(kernels, comm) * ms,
            "attention_kernels": len(attention)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="write the per-trace breakdown as JSON")
    args = p.parse_args()
    try:
        report = {path.name: exposure(load_kernels(path)) for path in args.traces}
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"trace_exposure: {err}") from None
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
