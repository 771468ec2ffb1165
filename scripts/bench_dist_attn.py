"""Distributed attention benchmark: ours against torch context parallel and one GPU, same run.

Launch with torchrun, one process per GPU (multicast off on shared machines)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 2 scripts/bench_dist_attn.py --out benchmarks/results

Rows (bf16, causal, head dim 128, batch 1): ours (balanced schedule, overlapped transfers)
with each local kernel, and the pipelined schedule (its last step in two halves); ablations
(ring schedule, serial transfers, compute only); torch
context parallel (ring attention over SDPA, head-tail load balancing) with both rotate
methods; one GPU computing the whole sequence. Times are medians of the slowest rank.

``--device cpu`` is the smoke run (gloo, float32, the reference kernel, torch's math SDPA for the
one-process row, no torch context parallel), e.g. ``torchrun --nproc_per_node 2 scripts/bench_dist_attn.py
--device cpu --seqs 64 --heads 4/4,4/2 --dim 16 --reps 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when this file is loaded by path

from benchlib.ablations import transfer_mode  # noqa: E402
from benchlib.launch import finish, free_memory, init_distributed  # noqa: E402
from benchlib.peers import cp_inputs, forward_only, fwd_bwd, ours, torch_context_parallel  # noqa: E402
from benchlib.plots import draw_lines, pyplot, save  # noqa: E402
from benchlib.results import (  # noqa: E402
    MULTICAST_ENV,
    ResultsFile,
    device_name,
    failure,
    find,
    results_path,
    run_meta,
)
from benchlib.timing import attention_flops, per_rank, synchronize, timed  # noqa: E402

from lightseq_hf._testing.kernel_knobs import cudnn_backward_fell_back  # noqa: E402
from lightseq_hf.kernels import get_kernel  # noqa: E402
from lightseq_hf.parallel.dist_attn import TaskMasks  # noqa: E402
from lightseq_hf.parallel.merge import empty_running  # noqa: E402
from lightseq_hf.parallel.schedule import Task, build_schedule  # noqa: E402

TORCH_CP_CPU_SKIP = ("torch's context_parallel shards only the flash, efficient and cuDNN SDPA kernels "
                     "(CUDA); not run on CPU")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="32768,65536,131072,262144",
                   help="total sequence lengths (multiples of the world size; 524288 fits 2 or 4 H200)")
    p.add_argument("--heads", default="32/32,32/8", help="query/kv heads, comma separated")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--backends", default=None, help="local kernels (default: sdpa_cudnn,triton on CUDA, "
                                                    "reference on CPU)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--no-torch-cp", action="store_true")
    p.add_argument("--no-single", action="store_true")
    p.add_argument("--no-ablations", action="store_true", help="skip the ring/paper/serial rows")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--trace", action="store_true", help="write a gzipped profiler trace of ours")
    p.add_argument("--trace-seq", type=int, default=65536, help="total length of the traced run")
    p.add_argument("--trace-backend", default=None, help="local kernel of the traced run (default: the "
                                                          "first of --backends)")
    p.add_argument("--trace-schedules", default="balanced",
                   help="schedules of the traced runs, comma separated (one trace each)")
    p.add_argument("--plot-from", default=None, help="only redraw the PNG of a results JSON")
    p.add_argument("--replay", action="store_true",
                   help="also time each rank's own tasks of the balanced schedule through the local kernel "
                        "on its own random inputs (no transfers, no peers' merges): rows replay_<backend> "
                        "with per_rank_ms")
    p.add_argument("--device-order", default="normal", choices=("normal", "reversed"),
                   help="reversed: local rank r runs on GPU (gpus - 1 - r), to tell a slow GPU from a slow "
                        "rank")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if available")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.backends = args.backends or ("sdpa_cudnn,triton" if args.device == "cuda" else "reference")
    args.trace_backend = args.trace_backend or args.backends.split(",")[0]
    return args


def gpu_ms(fn, reps: int, device: torch.device, **kwargs) -> float:
    """Median ms (``benchlib.timing.timed``: ranks in lock-step, the slowest) between CUDA events on a
    GPU, of the host clock on the CPU."""
    return timed(fn, reps, device, clock="cuda_events" if device.type == "cuda" else "wall", **kwargs)


def tflops_per_gpu(n: int, heads: int, dim: int, with_bwd: bool, gpus: int, ms: float) -> float:
    return attention_flops(1, heads, n, dim, causal=True, with_bwd=with_bwd) / gpus / ms / 1e9


def make_ours(q, k, v, dout, backend, schedule, with_bwd, group=None):
    """One forward (or forward+backward) of dist_flash_attn over ``group`` (default: the world)."""
    attn = ours(backend=backend, schedule=schedule, group=group, check_shapes=False)
    return fwd_bwd(attn, q, k, v, dout) if with_bwd else forward_only(attn, q, k, v)


def bench_torch_cp(n, h, hk, d, reps, device) -> dict:
    """torch's context_parallel over SDPA cuDNN; returns {(rotate, with_bwd): ms}."""
    g = torch.Generator(device=device).manual_seed(7)
    results = {}

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    for rotate in ("allgather", "alltoall"):
        qb, kb, vb = cp_inputs(n, h, hk, d, device, g)
        with torch_context_parallel([qb, kb, vb], [2, 2, 2], device, rotate):
            dout = torch.randn_like(qb)
            results[(rotate, False)] = gpu_ms(forward_only(sdpa, qb, kb, vb), reps, device)
            for t in (qb, kb, vb):
                t.requires_grad_()
            results[(rotate, True)] = gpu_ms(fwd_bwd(sdpa, qb, kb, vb, dout), reps, device)
    return results


def bench_single(n, h, hk, d, reps, rank, solo_group, backends, device):
    """One GPU computing the whole sequence (rank 0 times it; the others wait): SDPA cuDNN
    (``single_cudnn``; torch's math SDPA on the CPU, ``single_math``) and each of our local kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = {}
    if rank == 0:
        g = torch.Generator(device=device).manual_seed(3)
        opts = dict(device=device, dtype=dtype_on(device), generator=g, requires_grad=True)
        q = torch.randn(1, n, h, d, **opts)
        k = torch.randn(1, n, hk, d, **opts)
        v = torch.randn(1, n, hk, d, **opts)
        dout = torch.randn_like(q)
        cuda = device.type == "cuda"
        sdpa_name, sdpa_backend = ("single_cudnn", SDPBackend.CUDNN_ATTENTION) if cuda else \
            ("single_math", SDPBackend.MATH)

        def sdpa(with_bwd):
            def run():
                with sdpa_kernel(sdpa_backend):
                    o = F.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                        enable_gqa=h != hk,
                    )
                    if with_bwd:
                        o.backward(dout.transpose(1, 2))
                        q.grad = k.grad = v.grad = None
            return run

        for with_bwd in (False, True):
            ctx = torch.enable_grad() if with_bwd else torch.no_grad()
            with ctx:
                try:
                    results[(sdpa_name, with_bwd)] = gpu_ms(sdpa(with_bwd), reps, device, collective=False)
                except Exception as e:  # noqa: BLE001 - recorded in the results
                    results[(sdpa_name, with_bwd)] = f"error: {e}"
                for backend in (b for b in backends if not b.startswith("sdpa")):  # sdpa == single_cudnn
                    fn = make_ours(q, k, v, dout, backend, "balanced", with_bwd, solo_group)
                    try:
                        results[(f"single_{backend}", with_bwd)] = gpu_ms(fn, reps, device, collective=False)
                    except Exception as e:  # noqa: BLE001
                        results[(f"single_{backend}", with_bwd)] = f"error: {e}"
        del q, k, v, dout
        free_memory(device)
    dist.barrier()
    return results


def dtype_on(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; float32 on the CPU (the smoke run)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def per_rank_compute(q, k, v, dout, backend, reps, with_bwd):
    """Each rank's compute-only time (no transfers): the schedule's balance."""
    with transfer_mode("compute_only"):
        ms = gpu_ms(make_ours(q, k, v, dout, backend, "balanced", with_bwd), reps, q.device, reduce_max=False)
    return per_rank(ms, q.device)


def rank_tasks(world: int, rank: int, kind: str = "balanced") -> list[Task]:
    """The tasks ``rank`` computes under the causal schedule ``kind``, in step order."""
    return [step[rank] for step in build_schedule(world, True, kind).steps if step[rank] is not None]


def make_replay(q, k, v, dout, kernel, tasks: list[Task], with_bwd: bool, scale: float):
    """This rank's tasks through the local kernel on its own tensors: each task's query rows against
    the local keys/values (same shapes as the real loop: diagonal blocks causal, row halves), forward
    into a running (out, lse), then (``with_bwd``) every task's backward with the rows' global out and
    lse. Returns ``(run, calls)``; ``calls`` counts kernel calls per pass ``[forward, backward]``."""
    chunk = q.shape[1]
    q, k, v, dout = (x.detach() for x in (q, k, v, dout))
    with torch.no_grad():
        out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
    rows = [(task, *task.rows(chunk)) for task in tasks]
    lse_rows = [lse[:, :, a:b].contiguous() for _, a, b in rows]
    masks = TaskMasks()  # plain rows: what the loop hands the kernel per task
    calls = [0, 0]

    def run():
        with torch.no_grad():
            for task, a, b in rows:
                running_out, running_lse = empty_running(q[:, a:b])
                kernel.forward(q[:, a:b], k, v, scale=scale, mask=masks.for_task(task, chunk),
                               out=running_out, lse=running_lse)
                calls[0] += 1
            if with_bwd:
                for (task, a, b), task_lse in zip(rows, lse_rows):
                    kernel.backward(dout[:, a:b], q[:, a:b], k, v, out[:, a:b], task_lse, scale=scale,
                                    mask=masks.for_task(task, chunk))
                    calls[1] += 1
    return run, calls


def per_rank_replay(q, k, v, dout, backend, reps, world, with_bwd):
    """Each rank's kernel time for its own tasks (``make_replay``), as a list over the ranks."""
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1])
    tasks = rank_tasks(world, dist.get_rank())
    run, _ = make_replay(q, k, v, dout, kernel, tasks, with_bwd, q.shape[-1] ** -0.5)
    return per_rank(gpu_ms(run, reps, q.device, reduce_max=False), q.device)


def record_per_rank(record, row: dict, measure) -> None:
    """A row of per-rank times: ``ms`` the slowest rank's, ``per_rank_ms`` all (or the error)."""
    try:
        busy = measure()
        record({**row, "ms": max(busy), "per_rank_ms": busy})
    except Exception:  # noqa: BLE001 - recorded in the results
        record({**row, **failure(limit=3)})


def ablation_variants(main_config: bool, no_ablations: bool) -> list[tuple[str, str, str]]:
    """(row name, schedule, transfer mode) of ours and, on the main head layout, its ablations."""
    variants = [("ours", "balanced", "overlap"), ("pipelined", "pipelined", "overlap")]
    if main_config and not no_ablations:
        variants += [("ring", "ring", "overlap"), ("paper", "paper", "overlap"),
                     ("no_overlap", "balanced", "serial")]
    return variants


def bench_ours(args, tensors, base: dict, world: int, reps: int, record) -> None:
    """Ours, its ablations, per-rank compute and (``--replay``) replay rows of one length and layout."""
    q, k, v, dout = tensors
    n, h, d = base["seq"], base["heads"], args.dim
    main_config = base["kv_heads"] == h
    for with_bwd in (False, True):
        phase = "fwd_bwd" if with_bwd else "fwd"
        for backend in args.backends.split(","):
            for name, schedule, mode in ablation_variants(main_config, args.no_ablations):
                row = {**base, "impl": f"{name}_{backend}", "phase": phase}
                try:
                    with transfer_mode(mode):
                        ms = gpu_ms(make_ours(q, k, v, dout, backend, schedule, with_bwd), reps, q.device)
                    record({**row, "ms": ms, "tflops_per_gpu": tflops_per_gpu(n, h, d, with_bwd, world, ms)})
                except Exception:  # noqa: BLE001 - recorded in the results
                    record({**row, **failure(limit=3)})
            record_per_rank(record, {**base, "impl": f"compute_only_{backend}", "phase": phase},
                            lambda: per_rank_compute(q, k, v, dout, backend, reps, with_bwd))
            if args.replay and main_config:
                record_per_rank(record, {**base, "impl": f"replay_{backend}", "phase": phase},
                                lambda: per_rank_replay(q, k, v, dout, backend, reps, world, with_bwd))


def bench_peers(args, base: dict, world: int, reps: int, solo_group, record, device) -> None:
    """torch context parallel and one GPU at one length and head layout."""
    n, h, hk, d = base["seq"], base["heads"], base["kv_heads"], args.dim
    if not args.no_torch_cp and device.type != "cuda":
        record({**base, "impl": "torch_cp_cudnn", "skipped": TORCH_CP_CPU_SKIP})
    elif not args.no_torch_cp:
        try:
            for (rotate, with_bwd), ms in bench_torch_cp(n, h, hk, d, reps, device).items():
                record({**base, "impl": f"torch_cp_{rotate}_cudnn", "phase": "fwd_bwd" if with_bwd else "fwd",
                        "ms": ms, "tflops_per_gpu": tflops_per_gpu(n, h, d, with_bwd, world, ms)})
        except Exception:  # noqa: BLE001 - recorded in the results
            record({**base, "impl": "torch_cp_cudnn", **failure(limit=4)})
        free_memory(device)
    if not args.no_single:
        single = bench_single(n, h, hk, d, reps, dist.get_rank(), solo_group, args.backends.split(","),
                              device)
        obj = [single]
        dist.broadcast_object_list(obj, src=0)
        for (name, with_bwd), ms in obj[0].items():
            row = {**base, "impl": name, "phase": "fwd_bwd" if with_bwd else "fwd"}
            if isinstance(ms, str):
                row["error"] = ms
            else:
                row.update(ms=ms, tflops_per_gpu=tflops_per_gpu(n, h, d, with_bwd, 1, ms))
            record(row)


def bench_length(args, n: int, heads: str, world: int, solo_group, record, device) -> None:
    """Every row of one total length and head layout."""
    rank = dist.get_rank()
    h, hk = (int(x) for x in heads.split("/"))
    d, local = args.dim, n // world
    reps = args.reps if n <= 65536 else max(3, args.reps // 2)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    opts = dict(device=device, dtype=dtype_on(device), generator=g, requires_grad=True)
    q = torch.randn(1, local, h, d, **opts)
    k = torch.randn(1, local, hk, d, **opts)
    v = torch.randn(1, local, hk, d, **opts)
    dout = torch.randn_like(q)
    base = {"seq": n, "heads": h, "kv_heads": hk}
    bench_ours(args, (q, k, v, dout), base, world, reps, record)
    if args.trace and n == args.trace_seq and hk == h:
        for schedule in args.trace_schedules.split(","):
            write_trace(q, k, v, dout, args.trace_backend, schedule, Path(args.out), rank, n)
    del q, k, v, dout
    free_memory(device)
    bench_peers(args, base, world, reps, solo_group, record, device)


def run_order_meta(args, device: torch.device, world: int) -> dict:
    """Run metadata, with the GPU each rank ran on (a slow GPU follows its bus id, a slow rank does not)."""
    cuda = device.type == "cuda"
    packages = ("nccl", "triton") if cuda else ("triton",)
    meta = run_meta(device_name(device), world, *packages, env=MULTICAST_ENV)
    meta.update(dtype=str(dtype_on(device)).removeprefix("torch."), causal=True, head_dim=args.dim, batch=1,
                device_order=args.device_order, backends=args.backends.split(","))
    gpus = [None] * world
    mine = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        mine = {"cuda_index": device.index, "pci_bus_id": getattr(props, "pci_bus_id", None),
                "uuid": str(getattr(props, "uuid", ""))}
    dist.all_gather_object(gpus, mine)
    meta["rank_gpus"] = gpus
    return meta


def main(argv=None) -> Path | None:
    args = parse_args(argv)
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text())["rows"], Path(args.plot_from).with_suffix(".png"))
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device_order == "reversed" and args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count())) - 1 - local_rank
    device, owns_group = init_distributed(args.device, local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = [n for n in (int(x) for x in args.seqs.split(",")) if n % world]
    if bad:
        raise SystemExit(f"--seqs {bad}: every total length must split into {world} equal shards")
    solo_groups = [dist.new_group([r]) for r in range(world)]
    out_path = results_path(args.out, "dist", device_name(device), world, args.tag)
    results = ResultsFile(out_path, run_order_meta(args, device, world), lambda rows: summarize(rows, world),
                          rank=rank)

    def record(row):
        results.meta["cudnn_backward_fell_back_to_flash"] = cudnn_backward_fell_back()
        results.record(row)

    for n in [int(s) for s in args.seqs.split(",")]:
        for heads in args.heads.split(","):
            bench_length(args, n, heads, world, solo_groups[rank], record, device)
    if rank == 0:
        print(json.dumps(summarize(results.rows, world), indent=1))
        try:
            plot(results.rows, out_path.with_suffix(".png"))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    dist.barrier()
    finish(owns_group)
    return out_path


def write_trace(q, k, v, dout, backend, schedule, out_dir, rank, n):
    """A profiler trace (gzipped Chrome JSON) of one forward+backward of ours on this rank."""
    from torch.profiler import ProfilerActivity, profile

    fn = make_ours(q, k, v, dout, backend, schedule, True)
    fn()
    synchronize(q.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(q.device)
    name = f"trace-dist-{n // 1024}k-{backend}-{schedule}-rank{rank}.json.gz"
    prof.export_chrome_trace(str(out_dir / name))


def _per_rank(rows, **match) -> list[float] | None:
    """The per-rank milliseconds of the first matching row (compute-only rows), if every rank has one."""
    busy = find(rows, "per_rank_ms", **match)
    return busy if busy and all(x and x > 0 for x in busy) else None


def summarize(rows, world) -> dict:
    """The headline ratios (heads 32/32, forward+backward, local kernel cuDNN unless named)."""
    seqs = sorted({r["seq"] for r in rows})
    summary: dict = {"per_seq": {}}
    vs_cp = []
    for n in seqs:
        m = dict(seq=n, heads=32, kv_heads=32, phase="fwd_bwd")
        ours = find(rows, "ms", impl="ours_sdpa_cudnn", **m)
        ours_triton = find(rows, "ms", impl="ours_triton", **m)
        cps = [find(rows, "ms", impl=f"torch_cp_{r}_cudnn", **m) for r in ("allgather", "alltoall")]
        cps = [x for x in cps if x]
        single = find(rows, "ms", impl="single_cudnn", **m)
        compute = find(rows, "ms", impl="compute_only_sdpa_cudnn", **m)
        entry = {}
        if ours and cps:
            entry["vs_torch_cp"] = min(cps) / ours
            if n >= 65536:
                vs_cp.append(entry["vs_torch_cp"])
        if ours and single:
            entry["efficiency"] = single / (world * ours)
        if ours_triton and single:
            entry["efficiency_triton_vs_single_cudnn"] = single / (world * ours_triton)
        if ours_triton and cps:
            entry["vs_torch_cp_triton"] = min(cps) / ours_triton
        if ours and compute:
            entry["comm_overhead"] = ours / compute - 1
        pipelined = find(rows, "ms", impl="pipelined_sdpa_cudnn", **m)
        if pipelined and cps:
            entry["vs_torch_cp_pipelined"] = min(cps) / pipelined
        if pipelined and single:
            entry["efficiency_pipelined"] = single / (world * pipelined)
        if pipelined and compute:  # against the balanced schedule's compute (the same blocks, one step fewer)
            entry["comm_overhead_pipelined"] = pipelined / compute - 1
        busy = _per_rank(rows, impl="compute_only_sdpa_cudnn", **m)
        if busy:
            entry["compute_spread"] = max(busy) / min(busy) - 1
        busy_fwd = _per_rank(rows, impl="compute_only_sdpa_cudnn", seq=n, heads=32, kv_heads=32, phase="fwd")
        if busy_fwd:
            entry["compute_spread_fwd"] = max(busy_fwd) / min(busy_fwd) - 1
        replay = _per_rank(rows, impl="replay_sdpa_cudnn", **m)
        if replay:
            entry["replay_spread"] = max(replay) / min(replay) - 1
        fwd_single = find(rows, "ms", impl="single_cudnn", seq=n, heads=32, kv_heads=32, phase="fwd")
        for name in ("ours", "ring", "paper"):
            t = find(rows, "ms", impl=f"{name}_sdpa_cudnn", seq=n, heads=32, kv_heads=32, phase="fwd")
            if t and fwd_single:
                entry[f"fwd_speedup_{name}"] = fwd_single / t
        summary["per_seq"][str(n)] = entry
    summary["vs_torch_cp_min"] = min(vs_cp) if vs_cp else None
    summary["efficiency_128k"] = summary["per_seq"].get("131072", {}).get("efficiency")
    summary["efficiency_32k"] = summary["per_seq"].get("32768", {}).get("efficiency")
    summary["comm_overhead_64k"] = summary["per_seq"].get("65536", {}).get("comm_overhead")
    summary["efficiency_64k"] = summary["per_seq"].get("65536", {}).get("efficiency")
    summary["efficiency_256k"] = summary["per_seq"].get("262144", {}).get("efficiency")
    # slowest over fastest rank's compute-only forward+backward (no transfers), minus 1
    summary["compute_spread_256k"] = summary["per_seq"].get("262144", {}).get("compute_spread")
    return summary


def plot(rows, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("fwd", "fwd_bwd")):
        mha = [r for r in rows if r.get("phase") == phase and "ms" in r and r["heads"] == r["kv_heads"]]
        draw_lines(ax, {impl: [(r["seq"] / 1024, r["ms"]) for r in mha if r["impl"] == impl]
                        for impl in sorted({r["impl"] for r in mha})})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("total sequence (K tokens)")
        ax.set_ylabel("ms (slowest rank)")
        ax.set_title(f"causal attention {phase}, 32 heads, d=128, bf16")
        ax.legend(fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    main()
