"""Timing: median milliseconds after a warm-up, the slowest rank's, and peak memory per rank."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightseq_hf import metrics


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def collective_device(device: torch.device | str) -> torch.device:
    """Where the process group's collectives take their tensors: the GPU under NCCL, else the CPU."""
    return torch.device(device) if dist.get_backend() == "nccl" else torch.device("cpu")


def _one_run_ms(fn: Callable[[], object], device: torch.device | str, clock: str) -> float:
    if clock == "cuda_events":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start_s) * 1e3


def timed(fn: Callable[[], object], reps: int, device: torch.device | str, *, warmup: int = 1,
          collective: bool = True, reduce_max: bool = True, clock: str = "wall") -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after ``warmup`` untimed ones.

    ``collective``: every rank runs it in lock-step (a barrier before each run) and, with ``reduce_max``,
    each run counts as the slowest rank's time. ``clock``: ``"wall"`` (host clock around the call and a
    device synchronize) or ``"cuda_events"`` (events on the current stream around the call).
    """
    if clock not in ("wall", "cuda_events"):
        raise ValueError(f"unknown clock {clock!r}; use 'wall' or 'cuda_events'.")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        if collective:
            dist.barrier()
        times.append(_one_run_ms(fn, device, clock))
    if collective and reduce_max:
        times = slowest(times, device)
    return statistics.median(times)


def slowest(values: list[float], device: torch.device | str) -> list[float]:
    """Elementwise maximum of ``values`` over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def per_rank(value: float, device: torch.device | str) -> list[float]:
    """Every rank's ``value``, indexed by rank, on every rank."""
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=collective_device(device))
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


def peak_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak allocated memory (GiB, the largest of the ranks) during one call of ``fn``; None on the CPU."""
    if device.type != "cuda":
        fn()
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return max(slowest([torch.cuda.max_memory_allocated(device) / 2**30], device))


def pair_flops(heads: int, dim: int, pairs: float, *, with_bwd: bool) -> float:
    """FLOPs of attention over ``pairs`` visible query-key pairs: ``4*H*D`` per pair forward (scores and
    values), forward+backward 3.5x the forward (``lightseq_hf.metrics``' count)."""
    fwd = 4.0 * heads * dim * pairs
    return fwd * 3.5 if with_bwd else fwd


def attention_flops(batch: int, heads: int, n: int, dim: int, *, causal: bool, with_bwd: bool) -> float:
    """FLOPs of attention over ``batch`` sequences of ``n`` tokens: forward ``4*B*H*N^2*D``, causal half
    of it (``N^2 / 2`` pairs), forward+backward 3.5x the forward."""
    pairs = metrics.causal_attention_pairs(batch, n) if causal else batch * n * n
    return pair_flops(heads, dim, pairs, with_bwd=with_bwd)


def matmul_peak_flops(size: int = 8192, reps: int = 20) -> float:
    """Measured bf16 matmul rate (FLOP/s) of the current GPU: ``reps`` products of two ``size``-square
    matrices between CUDA events, after three warm-up products."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * reps / (start.elapsed_time(end) / 1e3)


def adaptive_event_ms(fn: Callable[[], object], target_ms: float = 600.0) -> float:
    """Median of CUDA-event timings of ``fn`` after two warm-up calls; repetitions fill ``target_ms``."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    reps = max(3, min(20, int(target_ms / max(start.elapsed_time(stop), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def kernel_ms(fn: Callable[[], object], reps: int = 3) -> float | None:
    """The kernels' own time per call of ``fn`` (profiler, summed over kernels), host gaps excluded."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        total_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    except RuntimeError:  # no profiler on this machine: wall time only
        return None
    return total_us / 1e3 / reps
