"""Distributed attention benchmark: ours against torch context parallel and one GPU, same run.

Launch with torchrun, one process per GPU (multicast off on shared machines)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 2 scripts/bench_dist_attn.py --out benchmarks/results

Rows (bf16, causal, head dim 128, batch 1): ours (balanced schedule, overlapped transfers)
with each local kernel; ablations (ring schedule, serial transfers, compute only); torch
context parallel (ring attention over SDPA, head-tail load balancing) with both rotate
methods; one GPU computing the whole sequence. Times are medians of the slowest rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightseq_hf
from lightseq_hf.kernels import get_kernel
from lightseq_hf.parallel.comm import set_transfer_mode
from lightseq_hf.parallel.merge import empty_running
from lightseq_hf.parallel.schedule import Task, build_schedule


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="32768,65536,131072,262144",
                   help="total sequence lengths (multiples of the world size; 524288 fits 2 or 4 H200)")
    p.add_argument("--heads", default="32/32,32/8", help="query/kv heads, comma separated")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--backends", default="sdpa_cudnn,triton")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--no-torch-cp", action="store_true")
    p.add_argument("--no-single", action="store_true")
    p.add_argument("--no-ablations", action="store_true", help="skip the ring/paper/serial rows")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--trace", action="store_true", help="write a gzipped profiler trace of ours")
    p.add_argument("--trace-seq", type=int, default=65536, help="total length of the traced run")
    p.add_argument("--trace-backend", default="sdpa_cudnn", help="local kernel of the traced run")
    p.add_argument("--plot-from", default=None, help="only redraw the PNG of a results JSON")
    p.add_argument("--replay", action="store_true",
                   help="also time each rank's own tasks of the balanced schedule through the local kernel "
                        "on its own random inputs (no transfers, no peers' merges): rows replay_<backend> "
                        "with per_rank_ms")
    p.add_argument("--device-order", default="normal", choices=("normal", "reversed"),
                   help="reversed: local rank r runs on GPU (gpus - 1 - r), to tell a slow GPU from a slow "
                        "rank")
    return p.parse_args()


def timed(fn, reps: int, warmup: int = 1, reduce_max: bool = True, collective: bool = True) -> float:
    """Median milliseconds of ``fn``; with ``collective`` every rank runs it in lock-step (a barrier
    before each repetition) and ``reduce_max`` takes the slowest rank per repetition."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if collective:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor(times, device="cuda")
    if collective and reduce_max:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def flops(n: int, heads: int, dim: int, with_bwd: bool) -> float:
    """Causal attention FLOPs: forward 2*H*N^2*D (half of full), forward+backward 3.5x."""
    fwd = 2.0 * heads * n * n * dim
    return fwd * 3.5 if with_bwd else fwd


def make_ours(q, k, v, dout, backend, schedule, with_bwd, group=None):
    """One forward (or forward+backward) of dist_flash_attn over ``group`` (default: the world)."""
    kwargs = dict(backend=backend, schedule=schedule, group=group, check_shapes=False)

    def run():
        if with_bwd:
            lightseq_hf.dist_flash_attn(q, k, v, **kwargs).backward(dout)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                lightseq_hf.dist_flash_attn(q, k, v, **kwargs)
    return run


def bench_torch_cp(n, h, hk, d, reps, world, rank):
    """torch's context_parallel over SDPA cuDNN; returns {(rotate, with_bwd): ms}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world,))
    g = torch.Generator(device="cuda").manual_seed(7)
    results = {}
    for rotate in ("allgather", "alltoall"):
        set_rotate_method(rotate)
        # torch CP's ring runs on equal head counts: GQA key/value heads are expanded.
        qb = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kb = torch.randn(1, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vb = torch.randn(1, hk, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kb, vb = kb.repeat_interleave(h // hk, 1), vb.repeat_interleave(h // hk, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), context_parallel(
            mesh, buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2], no_restore_buffers={qb, kb, vb}
        ):
            dout = torch.randn_like(qb)
            with torch.no_grad():
                results[(rotate, False)] = timed(
                    lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True), reps
                )
            for t in (qb, kb, vb):
                t.requires_grad_()

            def fwd_bwd():
                F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).backward(dout)
                qb.grad = kb.grad = vb.grad = None

            results[(rotate, True)] = timed(fwd_bwd, reps)
    return results


def bench_single(n, h, hk, d, reps, rank, solo_group, backends):
    """One GPU computing the whole sequence (rank 0 times it; the others wait)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = {}
    if rank == 0:
        g = torch.Generator(device="cuda").manual_seed(3)
        q = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        k = torch.randn(1, n, hk, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        v = torch.randn(1, n, hk, d, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        dout = torch.randn_like(q)

        def sdpa(with_bwd):
            def run():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
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
                    results[("single_cudnn", with_bwd)] = timed(sdpa(with_bwd), reps, collective=False)
                except Exception as e:  # noqa: BLE001 - recorded in the results
                    results[("single_cudnn", with_bwd)] = f"error: {e}"
                for backend in (b for b in backends if not b.startswith("sdpa")):  # sdpa == single_cudnn
                    fn = make_ours(q, k, v, dout, backend, "balanced", with_bwd, solo_group)
                    try:
                        results[(f"single_{backend}", with_bwd)] = timed(fn, reps, collective=False)
                    except Exception as e:  # noqa: BLE001
                        results[(f"single_{backend}", with_bwd)] = f"error: {e}"
        del q, k, v, dout
        torch.cuda.empty_cache()
    dist.barrier()
    return results


def per_rank_compute(q, k, v, dout, backend, reps, world, with_bwd):
    """Each rank's compute-only time (no transfers): the schedule's balance."""
    set_transfer_mode("compute_only")
    try:
        ms = timed(make_ours(q, k, v, dout, backend, "balanced", with_bwd), reps, reduce_max=False)
    finally:
        set_transfer_mode("overlap")
    t = torch.zeros(world, device="cuda")
    t[dist.get_rank()] = ms
    dist.all_reduce(t)
    return t.tolist()


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
    calls = [0, 0]

    def run():
        with torch.no_grad():
            for task, a, b in rows:
                running_out, running_lse = empty_running(q[:, a:b])
                kernel.forward(q[:, a:b], k, v, causal=task.diagonal, scale=scale, out=running_out,
                               lse=running_lse)
                calls[0] += 1
            if with_bwd:
                for (task, a, b), task_lse in zip(rows, lse_rows):
                    kernel.backward(dout[:, a:b], q[:, a:b], k, v, out[:, a:b], task_lse,
                                    causal=task.diagonal, scale=scale)
                    calls[1] += 1
    return run, calls


def per_rank_replay(q, k, v, dout, backend, reps, world, with_bwd):
    """Each rank's kernel time for its own tasks (``make_replay``), as a list over the ranks."""
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1])
    tasks = rank_tasks(world, dist.get_rank())
    run, _ = make_replay(q, k, v, dout, kernel, tasks, with_bwd, q.shape[-1] ** -0.5)
    ms = timed(run, reps, reduce_max=False)
    t = torch.zeros(world, device="cuda")
    t[dist.get_rank()] = ms
    dist.all_reduce(t)
    return t.tolist()


def main() -> None:
    args = parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text())["rows"], Path(args.plot_from).with_suffix(".png"))
        return
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device_order == "reversed":
        local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count())) - 1 - local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = [n for n in (int(x) for x in args.seqs.split(",")) if n % world]
    if bad:
        raise SystemExit(f"--seqs {bad}: every total length must split into {world} equal shards")
    solo_groups = [dist.new_group([r]) for r in range(world)]
    backends = args.backends.split(",")
    device_name = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = device_name.replace("NVIDIA ", "").replace(" ", "-").lower()
    tag = f"-{args.tag}" if args.tag else ""
    out_path = out_dir / f"dist-{slug}-x{world}-{date}{tag}.json"
    rows = []
    meta = {
        "device": device_name, "world": world, "date": date, "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "dtype": "bfloat16", "causal": True,
        "head_dim": args.dim, "batch": 1, "device_order": args.device_order,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS")},
    }
    gpus = [None] * world  # which GPU each rank ran on (a slow GPU follows its bus id, a slow rank does not)
    props = torch.cuda.get_device_properties(local_rank)
    dist.all_gather_object(gpus, {"cuda_index": local_rank, "pci_bus_id": getattr(props, "pci_bus_id", None),
                                  "uuid": str(getattr(props, "uuid", ""))})
    meta["rank_gpus"] = gpus
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass

    def record(row):
        rows.append(row)
        cudnn = lightseq_hf.kernels._cache.get("sdpa_cudnn")
        meta["cudnn_backward_fell_back_to_flash"] = getattr(cudnn, "_cudnn_backward_failed", None)
        if rank == 0:
            print(json.dumps(row), flush=True)
            result = {**meta, "rows": rows, "summary": summarize(rows, world)}
            out_path.write_text(json.dumps(result, indent=1))

    for n in [int(s) for s in args.seqs.split(",")]:
        for heads in args.heads.split(","):
            h, hk = (int(x) for x in heads.split("/"))
            d, local = args.dim, n // world
            reps = args.reps if n <= 65536 else max(3, args.reps // 2)
            g = torch.Generator(device="cuda").manual_seed(1000 + rank)
            opts = dict(device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            q = torch.randn(1, local, h, d, **opts)
            k = torch.randn(1, local, hk, d, **opts)
            v = torch.randn(1, local, hk, d, **opts)
            dout = torch.randn_like(q)
            base = {"seq": n, "heads": h, "kv_heads": hk}
            main_config = hk == h
            for with_bwd in (False, True):
                phase = "fwd_bwd" if with_bwd else "fwd"
                for backend in backends:
                    variants = [("ours", "balanced", "overlap")]
                    if main_config and not args.no_ablations:
                        variants += [("ring", "ring", "overlap"), ("paper", "paper", "overlap"),
                                     ("no_overlap", "balanced", "serial")]
                    for name, schedule, mode in variants:
                        set_transfer_mode(mode)
                        try:
                            ms = timed(make_ours(q, k, v, dout, backend, schedule, with_bwd), reps)
                            record({**base, "impl": f"{name}_{backend}", "phase": phase, "ms": ms,
                                    "tflops_per_gpu": flops(n, h, d, with_bwd) / world / ms / 1e9})
                        except Exception:  # noqa: BLE001 - recorded in the results
                            record({**base, "impl": f"{name}_{backend}", "phase": phase,
                                    "error": traceback.format_exc(limit=3)})
                        finally:
                            set_transfer_mode("overlap")
                    try:
                        busy = per_rank_compute(q, k, v, dout, backend, reps, world, with_bwd)
                        record({**base, "impl": f"compute_only_{backend}", "phase": phase,
                                "ms": max(busy), "per_rank_ms": busy})
                    except Exception:  # noqa: BLE001
                        record({**base, "impl": f"compute_only_{backend}", "phase": phase,
                                "error": traceback.format_exc(limit=3)})
                    if args.replay and main_config:
                        try:
                            busy = per_rank_replay(q, k, v, dout, backend, reps, world, with_bwd)
                            record({**base, "impl": f"replay_{backend}", "phase": phase,
                                    "ms": max(busy), "per_rank_ms": busy})
                        except Exception:  # noqa: BLE001
                            record({**base, "impl": f"replay_{backend}", "phase": phase,
                                    "error": traceback.format_exc(limit=3)})
            if args.trace and n == args.trace_seq and main_config:
                write_trace(q, k, v, dout, args.trace_backend, out_dir, rank, n)
            del q, k, v, dout
            torch.cuda.empty_cache()
            if not args.no_torch_cp:
                try:
                    for (rotate, with_bwd), ms in bench_torch_cp(n, h, hk, d, reps, world, rank).items():
                        phase = "fwd_bwd" if with_bwd else "fwd"
                        record({**base, "impl": f"torch_cp_{rotate}_cudnn", "phase": phase, "ms": ms,
                                "tflops_per_gpu": flops(n, h, d, with_bwd) / world / ms / 1e9})
                except Exception:  # noqa: BLE001
                    record({**base, "impl": "torch_cp_cudnn", "error": traceback.format_exc(limit=4)})
                torch.cuda.empty_cache()
            if not args.no_single:
                single = bench_single(n, h, hk, d, reps, rank, solo_groups[rank], backends)
                obj = [single]
                dist.broadcast_object_list(obj, src=0)
                for (name, with_bwd), ms in obj[0].items():
                    row = {**base, "impl": name, "phase": "fwd_bwd" if with_bwd else "fwd"}
                    if isinstance(ms, str):
                        row["error"] = ms
                    else:
                        row.update(ms=ms, tflops_per_gpu=flops(n, h, d, with_bwd) / ms / 1e9)
                    record(row)
    if rank == 0:
        print(json.dumps(summarize(rows, world), indent=1))
        try:
            plot(rows, out_path.with_suffix(".png"))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    dist.destroy_process_group()


def write_trace(q, k, v, dout, backend, out_dir, rank, n):
    from torch.profiler import ProfilerActivity, profile

    fn = make_ours(q, k, v, dout, backend, "balanced", True)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out_dir / f"trace-dist-{n // 1024}k-{backend}-rank{rank}.json.gz"))


def _ms(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and "ms" in r:
            return r["ms"]
    return None


def _per_rank(rows, **match) -> list[float] | None:
    """The per-rank milliseconds of the first matching row (compute-only rows), if every rank has one."""
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and r.get("per_rank_ms"):
            busy = r["per_rank_ms"]
            return busy if all(x and x > 0 for x in busy) else None
    return None


def summarize(rows, world) -> dict:
    """The headline ratios (heads 32/32, forward+backward, local kernel cuDNN unless named)."""
    seqs = sorted({r["seq"] for r in rows})
    summary: dict = {"per_seq": {}}
    vs_cp = []
    for n in seqs:
        m = dict(seq=n, heads=32, kv_heads=32, phase="fwd_bwd")
        ours = _ms(rows, impl="ours_sdpa_cudnn", **m)
        ours_triton = _ms(rows, impl="ours_triton", **m)
        cps = [_ms(rows, impl=f"torch_cp_{r}_cudnn", **m) for r in ("allgather", "alltoall")]
        cps = [x for x in cps if x]
        single = _ms(rows, impl="single_cudnn", **m)
        compute = _ms(rows, impl="compute_only_sdpa_cudnn", **m)
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
        busy = _per_rank(rows, impl="compute_only_sdpa_cudnn", **m)
        if busy:
            entry["compute_spread"] = max(busy) / min(busy) - 1
        busy_fwd = _per_rank(rows, impl="compute_only_sdpa_cudnn", seq=n, heads=32, kv_heads=32, phase="fwd")
        if busy_fwd:
            entry["compute_spread_fwd"] = max(busy_fwd) / min(busy_fwd) - 1
        replay = _per_rank(rows, impl="replay_sdpa_cudnn", **m)
        if replay:
            entry["replay_spread"] = max(replay) / min(replay) - 1
        fwd_single = _ms(rows, impl="single_cudnn", seq=n, heads=32, kv_heads=32, phase="fwd")
        for name in ("ours", "ring", "paper"):
            t = _ms(rows, impl=f"{name}_sdpa_cudnn", seq=n, heads=32, kv_heads=32, phase="fwd")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("fwd", "fwd_bwd")):
        mha = [r for r in rows if r.get("phase") == phase and "ms" in r and r["heads"] == r["kv_heads"]]
        impls = sorted({r["impl"] for r in mha})
        for impl in impls:
            pts = sorted((r["seq"], r["ms"]) for r in mha if r["impl"] == impl)
            ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("total sequence (K tokens)")
        ax.set_ylabel("ms (slowest rank)")
        ax.set_title(f"causal attention {phase}, 32 heads, d=128, bf16")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
