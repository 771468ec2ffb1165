"""Per-rank busy time of the packed-document schedule, replayed rank by rank on one GPU.

Each rank's real forward and backward loops (``dist_attn_forward``/``dist_attn_backward``) run in the
compute-only transfer mode (received buffers filled with random values on the communication stream, as
``bench_packed.py``'s ``packed_compute_only`` rows), one rank at a time on this process's device, so a
single GPU measures what each GPU of a P-GPU run computes (rank by rank in turn, repetition after
repetition, so that the GPU's drift hits every rank alike). Each rank's busy time and tasks are what
``lightseq_hf.parallel.segment_schedule``'s cost model is fitted to (``scripts/fit_tile_cost.py``);
``--costs`` replays the schedules of several cost models on the same rows, ``--calls`` also times every
kernel call (CUDA events on the compute stream).

    python scripts/replay_packed.py --seqs 65536,131072 --worlds 2,4 --layouts 6 --out OUT/replay.jsonl

Rows are packed from the same log-normal length mix as ``bench_packed.py`` (layout 0 of a length is that
benchmark's row). ``--device cpu --backend reference`` is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # benchlib

from benchlib.ablations import ComputeOnlyComm  # noqa: E402
from benchlib.workloads import lognormal_docs  # noqa: E402

from lightseq_hf.kernels import get_kernel  # noqa: E402
from lightseq_hf.parallel.dist_attn import TaskMasks, dist_attn_backward, dist_attn_forward  # noqa: E402
from lightseq_hf.parallel.segment_schedule import (  # noqa: E402
    DEFAULT_COST,
    HAND_SET,
    TileCost,
    build_segment_schedule,
    modeled_loads,
)
from lightseq_hf.parallel.segments import Segments, key_ranges  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="65536,131072")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--layouts", type=int, default=4, help="packed rows per (length, world)")
    p.add_argument("--first-layout", type=int, default=0, help="layout 0 is bench_packed.py's row")
    p.add_argument("--repeat", type=int, default=1, help="measure each schedule this many times (noise)")
    p.add_argument("--calls", action="store_true", help="also time every kernel call (CUDA events)")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--median", type=int, default=2048)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-doc", type=int, default=32768)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", default="triton")
    p.add_argument("--device", default="cuda")
    p.add_argument("--costs", default='{"default": "default"}',
                   help="schedules to replay, JSON: name -> 'default', 'hand_set' or TileCost fields")
    p.add_argument("--out", required=True, help="JSON lines, one per (layout, rank)")
    return p.parse_args(argv)


class TimedKernel:
    """A local kernel whose calls are timed (CUDA events; host clock on the CPU) while ``log`` is a list."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.log: list | None = None
        self.name = kernel.name
        self.capabilities = kernel.capabilities

    def _call(self, kind: str, fn, args, kwargs):
        if self.log is None:
            return fn(*args, **kwargs)
        q = args[0] if kind == "fwd" else args[1]
        k = args[1] if kind == "fwd" else args[2]
        entry = {"kind": kind, "lq": q.shape[1], "lk": k.shape[1], "accum": kwargs.get("out") is not None
                 or kwargs.get("dk") is not None}
        if q.is_cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args, **kwargs)
            stop.record()
            entry["_events"] = (start, stop)
        else:
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            entry["ms"] = (time.perf_counter() - t0) * 1e3
        self.log.append(entry)
        return result

    def forward(self, *args, **kwargs):
        return self._call("fwd", self.kernel.forward, args, kwargs)

    def backward(self, *args, **kwargs):
        return self._call("bwd", self.kernel.backward, args, kwargs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare_rank(args, seg: Segments, sched, rank: int, kernel: TimedKernel, device: torch.device,
                 dtype: torch.dtype):
    """One rank's compute-only forward+backward as a closure, on its own random tensors."""
    lo, hi = key_ranges(seg, causal=True, device=device)
    h, hk = (int(x) for x in args.heads.split("/"))
    n = seg.length // sched.world
    g = torch.Generator(device=device).manual_seed(7 + rank)
    q = torch.randn(1, n, h, args.dim, device=device, generator=g).to(dtype)
    k = torch.randn(1, n, hk, args.dim, device=device, generator=g).to(dtype)
    v = torch.randn(1, n, hk, args.dim, device=device, generator=g).to(dtype)
    dout = torch.randn_like(q)
    common = {"scale": args.dim ** -0.5, "schedule": sched, "rank": rank,
              "comm": ComputeOnlyComm(None, device), "kernel": kernel, "masks": TaskMasks(ranges=(lo, hi))}
    out, lse = dist_attn_forward(q, k, v, **common)

    def both():
        dist_attn_forward(q, k, v, **common)
        dist_attn_backward(dout, q, k, v, out, lse, **common)

    return both


def interleaved_ms(fns, reps: int, device: torch.device) -> list[float]:
    """Median ms of each closure, timed in turn (rank 0, 1, ..., 0, 1, ...) so drift hits all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            t.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def call_times(fn, kernel: TimedKernel, reps: int, device: torch.device) -> list[dict]:
    """Each kernel call of ``fn`` (in order) with its median ms over ``reps`` runs."""
    calls = []
    for _ in range(reps):
        kernel.log = []
        fn()
        sync(device)
        for e in kernel.log:
            if "_events" in e:
                start, stop = e.pop("_events")
                e["ms"] = start.elapsed_time(stop)
        calls.append(kernel.log)
    kernel.log = None
    per_call = []
    for i, first in enumerate(calls[0]):
        entry = {key: val for key, val in first.items() if key != "ms"}
        entry["ms"] = statistics.median(c[i]["ms"] for c in calls)
        per_call.append(entry)
    return per_call


def replay_layout(args, seg: Segments, world: int, cost: TileCost, kernel: TimedKernel, device: torch.device,
                  dtype: torch.dtype) -> list[dict]:
    """Every rank's busy ms under the schedule ``cost`` builds (and, with ``--calls``, its kernel calls)."""
    sched = build_segment_schedule(world, seg, True, None, cost=cost)
    fns = [prepare_rank(args, seg, sched, rank, kernel, device, dtype) for rank in range(world)]
    busy = interleaved_ms(fns, args.reps, device)
    modeled = modeled_loads(sched, seg, cost=cost)
    n = seg.length // world
    rows = []
    for rank, fn in enumerate(fns):
        tasks = [[t.q_owner, t.kv_owner, t.row_start, t.row_stop, t.work, *t.keys(n)]
                 for step in sched.steps for t in [step[rank]] if t is not None]
        row = {"ms": busy[rank], "tasks": tasks, "modeled": modeled[rank]}
        if args.calls:
            row["calls"] = call_times(fn, kernel, args.reps, device)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = TimedKernel(get_kernel(args.backend, device, dtype, args.dim))
    models = {"default": DEFAULT_COST, "hand_set": HAND_SET}
    costs = {name: models[spec] if isinstance(spec, str) else TileCost(**spec)
             for name, spec in json.loads(args.costs).items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "backend": args.backend, "heads": args.heads, "dim": args.dim}
    with open(args.out, "a") as f:
        for seq in (int(s) for s in args.seqs.split(",")):
            for world in (int(w) for w in args.worlds.split(",")):
                for layout in range(args.first_layout, args.first_layout + args.layouts):
                    seed = 1000 + seq + 7919 * layout
                    docs = lognormal_docs(seq, median=args.median, sigma=args.sigma, max_len=args.max_doc,
                                          seed=seed)
                    seg = Segments(seq, (tuple(docs),))
                    for name, cost in costs.items():
                        for repeat in range(args.repeat):
                            ranks = replay_layout(args, seg, world, cost, kernel, device, dtype)
                            busy = [r["ms"] for r in ranks]
                            print(f"seq {seq} P {world} layout {layout} docs {len(docs)} cost {name}: busy "
                                  f"{[round(b, 2) for b in busy]} spread {max(busy) / min(busy) - 1:.2%}",
                                  flush=True)
                            for rank, r in enumerate(ranks):
                                f.write(json.dumps({**meta, "seq": seq, "world": world, "layout": layout,
                                                    "seed": seed, "docs": docs, "cost_name": name,
                                                    "cost": cost.__dict__, "repeat": repeat, "rank": rank,
                                                    **r}) + "\n")
                            f.flush()


if __name__ == "__main__":
    main()
