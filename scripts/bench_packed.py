"""Packed-sequence attention benchmark: ours against the ways peers handle documents, same run.

Launch with torchrun, one process per GPU (multicast off on shared machines)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 2 scripts/bench_packed.py --out benchmarks/results

Each row of ``--seqs`` tokens is packed from documents of a log-normal length mix (median 2K,
at most 32K, fixed seed; the last document is cut to fit). Rows, forward+backward, bf16:

- ``packed_ours``: ``dist_flash_attn(segments=...)`` (the segment schedule, one key/value shard per GPU,
  overlapped transfers), once per local kernel of ``--packed-backends`` (each row tagged ``backend``):
  ``flash_varlen`` (torch's FlashAttention-2 varlen op, one call per task for all its documents; when the
  op runs on the GPU) and ``triton`` (our kernels with per-row key ranges);
- ``packed_compute_only``: the same without transfers (per backend), timed on each rank alone: per-rank busy
  time (``busy_spread`` = slowest / fastest - 1), with the schedule that ran and its modeled
  per-rank cost (``scripts/schedule_table.py --model-check`` compares the two);
- ``unpacked_ours_<backend>``: the same tokens as one causal sequence (what a run that cannot pack
  computes), ours with the cuDNN and Triton kernels; ``torch_cp``: torch context parallel (ring
  attention over SDPA cuDNN, head-tail balancing) on that sequence;
- ``allgather_varlen``: the all-gather varlen ring of ring-flash-attention's ``llama3`` mode and
  torchtitan: every rank all-gathers all keys/values, attends its queries with the Triton
  document-mask kernel (it needs per-row key ranges), and reduce-scatters dk/dv;
- ``padded_docs`` (derived, not timed): each document padded to the full row, as a run without
  packing does: number of documents x the measured ``unpacked_ours`` time of one row.

Every row reports ms (slowest rank), ms per real token, and peak memory per rank. Before timing,
an exactness check on 16K tokens compares ours (every packed backend) on all ranks with a per-document
float32 reference (SDPA per document) and with the same kernel on one GPU; ``summary.exact`` is true only
when it passed for every backend. The summary's keys are those of the fastest packed backend per length
(``packed_backend``), with ``packed_<other>_over_packed`` for the others. Results:
``benchmarks/results/packed-<device>-x<P>-<date>.json``.

``--device cpu`` runs the same code on gloo with the reference kernel and tiny sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightseq_hf  # noqa: E402
from lightseq_hf.kernels import get_kernel  # noqa: E402
from lightseq_hf.parallel.comm import set_transfer_mode  # noqa: E402
from lightseq_hf.parallel.segment_schedule import PAIRS, build_segment_schedule, modeled_loads  # noqa: E402
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="65536,131072", help="tokens per packed row")
    p.add_argument("--heads", default="32/8", help="query/kv heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--median", type=int, default=2048, help="median document length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the document lengths")
    p.add_argument("--max-doc", type=int, default=32768)
    p.add_argument("--check-seq", type=int, default=16384, help="tokens of the exactness check")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-torch-cp", action="store_true")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--packed-backends", default="auto",
                   help="local kernels of the packed rows, comma-separated (auto: flash_varlen,triton on a "
                        "GPU whose torch has the varlen op, else triton; reference on the CPU)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


def lognormal_docs(
    total: int, *, median: int, sigma: float, max_len: int, seed: int
) -> tuple[tuple[int, int], ...]:
    """Documents ``[start, stop)`` filling ``total`` tokens, lengths log-normal (``median``, ``sigma``)
    clipped to ``[1, max_len]``; the last document is cut at the row end. Deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    docs, t = [], 0
    while t < total:
        length = math.exp(math.log(median) + sigma * float(torch.randn(1, generator=g)))
        length = max(1, min(max_len, round(length)))
        docs.append((t, min(total, t + length)))
        t += length
    return tuple(docs)


# ----------------------------------------------------------------------------- timing and memory


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, reps: int, device: torch.device, *, collective: bool = True, warmup: int = 1) -> float:
    """Median milliseconds of ``fn``; ``collective``: ranks start together and the slowest counts."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        if collective:
            dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    t = torch.tensor(times, dtype=torch.float64)
    if collective:
        t = t.to(device) if dist.get_backend() == "nccl" else t
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.cpu().tolist())


def peak_gib(fn, device: torch.device) -> float | None:
    """Peak allocated memory (GiB, slowest rank) during one call of ``fn`` (None on the CPU)."""
    if device.type != "cuda":
        fn()
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    t = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def per_rank(value: float, device: torch.device) -> list[float]:
    world = dist.get_world_size()
    t = torch.zeros(world, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return t.tolist()


# ----------------------------------------------------------------------------- the peers


def fwd_bwd(attn, q, k, v, dout):
    """One forward+backward of ``attn(q, k, v)``; gradients dropped."""

    def run():
        attn(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    return run


class AllGatherVarlen(torch.autograd.Function):
    """The all-gather varlen ring: all keys/values gathered on every rank, dk/dv reduce-scattered."""

    @staticmethod
    def forward(ctx, q, k, v, key_range, kernel, scale):
        world = dist.get_world_size()
        k_all = torch.cat(_all_gather(k, world), dim=1)
        v_all = torch.cat(_all_gather(v, world), dim=1)
        out, lse = kernel.forward(q, k_all, v_all, causal=False, scale=scale, key_range=key_range)
        ctx.save_for_backward(q, k_all, v_all, out, lse, *key_range)
        ctx.kernel, ctx.scale = kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, lse, lo, hi = ctx.saved_tensors
        dq, dk_all, dv_all = ctx.kernel.backward(dout.contiguous(), q, k_all, v_all, out, lse, causal=False,
                                                 scale=ctx.scale, key_range=(lo, hi))
        world = dist.get_world_size()
        dk, dv = _reduce_scatter(dk_all, world), _reduce_scatter(dv_all, world)
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None, None


def _all_gather(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return parts


def _reduce_scatter(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(world, dim=1)]
    if dist.get_backend() == "nccl":
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts)
        return mine
    for p in parts:  # gloo has no reduce_scatter: all-reduce, keep this rank's part
        dist.all_reduce(p)
    return parts[dist.get_rank()]


def allgather_varlen(segments: Segments, backend: str, device: torch.device):
    """``attn(q, k, v)`` of the all-gather varlen baseline for ``segments`` (this rank's query rows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = key_ranges(segments, causal=True, device=device)

    def attn(q, k, v):
        n = q.shape[1]
        rows = slice(rank * n, (rank + 1) * n)
        rng = local_key_range(lo[:, rows], hi[:, rows], 0, n * world)
        kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1])
        return AllGatherVarlen.apply(q, k, v, rng, kernel, q.shape[-1] ** -0.5)

    return attn


def torch_cp_ms(n, h, hk, d, reps, device) -> tuple[float, float]:
    """torch context parallel (SDPA cuDNN, allgather rotation) on one causal sequence: (ms, peak GiB)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    set_rotate_method("allgather")
    g = torch.Generator(device=device).manual_seed(7)
    qb = torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16, generator=g)
    kb = torch.randn(1, hk, n, d, device=device, dtype=torch.bfloat16, generator=g)
    vb = torch.randn(1, hk, n, d, device=device, dtype=torch.bfloat16, generator=g)
    kb, vb = kb.repeat_interleave(h // hk, 1), vb.repeat_interleave(h // hk, 1)  # its ring needs equal heads
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), context_parallel(
        mesh, buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2], no_restore_buffers={qb, kb, vb}
    ):
        dout = torch.randn_like(qb)
        for t in (qb, kb, vb):
            t.requires_grad_()
        def attn(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

        fn = fwd_bwd(attn, qb, kb, vb, dout)
        ms = timed(fn, reps, device)
        peak = peak_gib(fn, device)
    return ms, peak


# ----------------------------------------------------------------------------- exactness on the device


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, r64 = x.detach().double(), ref.detach().double()
    fin = torch.isfinite(r64)
    if not torch.equal(fin, torch.isfinite(x64)):
        return float("inf")
    denom = r64[fin].norm().item()
    return (x64[fin] - r64[fin]).norm().item() / max(denom, 1e-30)


def per_document_reference(q, k, v, dout, docs):
    """float32 attention of each document on its own (SDPA), with gradients; full rows."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = torch.zeros_like(q)
    group = q.shape[2] // k.shape[2]
    for start, stop in docs:
        qs, ks, vs = (t[:, start:stop].transpose(1, 2) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        out[:, start:stop] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2)
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def exactness_check(args, device, backends, ranged_backend, solo_group) -> dict:
    """Ours (each of ``backends``) on every rank against a per-document float32 reference and the same
    kernel on one device; the all-gather baseline with ``ranged_backend``. Top-level ``out``/``dq``/...
    are the first backend's; ``per_backend`` holds each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.check_seq
    h, hk = (int(x) for x in args.heads.split("/"))
    h, hk = max(1, h // 4), max(1, hk // 4)
    docs = lognormal_docs(n, median=max(1, args.median // 4), sigma=args.sigma, max_len=n // 2, seed=11)
    seg = Segments(n, (docs,))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(5)
    q, dout = (torch.randn(1, n, h, args.dim, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, n, hk, args.dim, device=device, generator=g).to(dtype) for _ in range(2))
    ref = per_document_reference(q, k, v, dout, docs)
    local = n // world
    sl = slice(rank * local, (rank + 1) * local)

    def run(qq, kk, vv, dd, group, backend):
        qq, kk, vv = (t.clone().requires_grad_() for t in (qq, kk, vv))
        out = lightseq_hf.dist_flash_attn(qq, kk, vv, segments=seg, backend=backend, group=group)
        out.backward(dd)
        return out.detach(), qq.grad, kk.grad, vv.grad

    qa, ka, va = (t[:, sl].clone().requires_grad_() for t in (q, k, v))
    out_ag = allgather_varlen(seg, ranged_backend, device)(qa, ka, va)
    out_ag.backward(dout[:, sl])
    gathered = (out_ag.detach(), qa.grad, ka.grad, va.grad)
    result = {"seq": n, "heads": h, "kv_heads": hk, "docs": len(docs), "dtype": str(dtype), "passed": True,
              "backends": list(backends), "per_backend": {}}
    for backend in backends:
        ours = run(q[:, sl], k[:, sl], v[:, sl], dout[:, sl], None, backend)
        single = run(q, k, v, dout, solo_group, backend)
        mine: dict = {"passed": True}
        for name, x, s, a, r in zip(("out", "dq", "dk", "dv"), ours, single, gathered, ref):
            err, ag_err = rel_err(x, r[:, sl]), rel_err(a, r[:, sl])
            single_err = rel_err(s[:, sl], r[:, sl])
            bound = 2 * single_err + 1e-3  # distributed within twice the one-device error
            ok = err <= bound and single_err <= 3e-2
            mine[name] = {"rel_err_per_rank": per_rank(err, device), "single_device_rel_err": single_err,
                          "bound": bound, "allgather_varlen_rel_err_per_rank": per_rank(ag_err, device)}
            ok_all = torch.tensor([int(ok)], device=device if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
            mine["passed"] = mine["passed"] and bool(ok_all.item())
        result["per_backend"][backend] = mine
        result["passed"] = result["passed"] and mine["passed"]
    result.update({name: result["per_backend"][backends[0]][name] for name in ("out", "dq", "dk", "dv")})
    return result


# ----------------------------------------------------------------------------- main


def summarize(rows: list[dict], check: dict | None) -> dict:
    """Headline numbers: busy spread, packed vs the same tokens unpacked, exactness."""
    def ms(impl, seq):
        for r in rows:
            if r.get("impl") == impl and r.get("seq") == seq and "ms" in r:
                return r["ms"]
        return None

    summary: dict = {"per_seq": {}}
    spreads = []
    for seq in sorted({r["seq"] for r in rows}):
        packed_by = {r.get("backend"): r["ms"] for r in rows
                     if r.get("impl") == "packed_ours" and r.get("seq") == seq and "ms" in r}
        fastest = min(packed_by, key=packed_by.get) if packed_by else None
        packed = packed_by.get(fastest)
        entry = {}
        if fastest is not None:
            entry["packed_backend"] = fastest
            for other, other_ms in packed_by.items():
                if other != fastest:
                    entry[f"packed_{other}_over_packed"] = other_ms / packed
        for r in rows:
            if (r.get("impl") == "packed_compute_only" and r.get("seq") == seq and "per_rank_ms" in r
                    and (fastest is None or r.get("backend") == fastest)):
                busy = r["per_rank_ms"]
                entry["busy_spread"] = max(busy) / min(busy) - 1 if min(busy) > 0 else None
                if entry["busy_spread"] is not None:
                    spreads.append(entry["busy_spread"])
        if packed:
            for impl in ("unpacked_ours_sdpa_cudnn", "unpacked_ours_triton", "unpacked_ours_reference",
                         "torch_cp", "allgather_varlen", "padded_docs"):
                other = ms(impl, seq)
                if other:
                    entry[f"{impl}_over_packed"] = other / packed
        summary["per_seq"][str(seq)] = entry
    summary["busy_spread_max"] = max(spreads) if spreads else None
    e64 = summary["per_seq"].get("65536", {})
    unpacked = [e64.get(f"unpacked_ours_{b}_over_packed") for b in ("sdpa_cudnn", "triton", "reference")]
    unpacked = [x for x in unpacked if x]
    summary["packed_vs_unpacked_64k"] = min(unpacked) if unpacked else None  # vs the fastest unpacked
    summary["exact"] = bool(check and check.get("passed"))
    return summary


def bench_seq(args, seq, device, dtype, packed_backends, ranged_backend, unpacked_backends,
              record) -> tuple[dict, int]:
    """Every row of one packed length."""
    rank, world = dist.get_rank(), dist.get_world_size()
    h, hk = (int(x) for x in args.heads.split("/"))
    reps = args.reps if seq <= 65536 else max(3, args.reps // 2)
    docs = lognormal_docs(seq, median=args.median, sigma=args.sigma, max_len=args.max_doc, seed=1000 + seq)
    seg = Segments(seq, (docs,))
    local = seq // world
    g = torch.Generator(device=device).manual_seed(100 + rank)
    q = torch.randn(1, local, h, args.dim, device=device, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, local, hk, args.dim, device=device, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, local, hk, args.dim, device=device, generator=g).to(dtype).requires_grad_()
    dout = torch.randn_like(q)
    base = {"seq": seq, "docs": len(docs), "longest_doc": max(b - a for a, b in docs)}

    def run_row(impl, attn, **tags):
        try:
            fn = fwd_bwd(attn, q, k, v, dout)
            ms = timed(fn, reps, device)
            peak = peak_gib(fn, device)
            record({**base, "impl": impl, **tags, "ms": ms, "ms_per_real_token": ms / seq, "peak_gib": peak})
            return ms
        except Exception:  # noqa: BLE001 - recorded in the results
            record({**base, "impl": impl, **tags, "error": traceback.format_exc(limit=4)})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    def ours(segments, backend):
        return lambda a, b, c: lightseq_hf.dist_flash_attn(a, b, c, segments=segments, backend=backend,
                                                           check_shapes=False)

    for packed_backend in packed_backends:
        run_row("packed_ours", ours(seg, packed_backend), backend=packed_backend)
        try:
            set_transfer_mode("compute_only")
            alone = timed(fwd_bwd(ours(seg, packed_backend), q, k, v, dout), reps, device, collective=False)
            busy = per_rank(alone, device)
            record({**base, "impl": "packed_compute_only", "backend": packed_backend, "ms": max(busy),
                    "per_rank_ms": busy, **schedule_record(seg, world)})
        except Exception:  # noqa: BLE001
            record({**base, "impl": "packed_compute_only", "backend": packed_backend,
                    "error": traceback.format_exc(limit=4)})
        finally:
            set_transfer_mode("overlap")
    unpacked = {b: run_row(f"unpacked_ours_{b}", ours(None, b)) for b in unpacked_backends}
    run_row("allgather_varlen", allgather_varlen(seg, ranged_backend, device), backend=ranged_backend)
    fastest = min((x for x in unpacked.values() if x), default=None)
    if fastest:
        ms = fastest * len(docs)
        record({**base, "impl": "padded_docs", "ms": ms, "ms_per_real_token": ms / seq, "derived": True,
                "how": "documents x the measured time of one unpacked row of this length"})
    return base, reps


def schedule_record(seg: Segments, world: int) -> dict:
    """The segment schedule the packed rows ran (steps of ``[q chunk, kv chunk, row start, row stop,
    visible pairs, key start, key stop]``, ``null`` for idle) and its modeled per-rank cost (tile model,
    visible pairs): the inputs of ``scripts/schedule_table.py --model-check``."""
    sched = build_segment_schedule(world, seg, True, None)
    chunk = seg.length // world
    steps = [[None if t is None else [t.q_owner, t.kv_owner, t.row_start, t.row_stop, t.work, *t.keys(chunk)]
              for t in step] for step in sched.steps]
    return {"schedule": steps, "modeled_cost_per_rank": modeled_loads(sched, seg),
            "modeled_pairs_per_rank": modeled_loads(sched, seg, cost=PAIRS)}


def bench_torch_cp(args, seq, device, base, reps, record) -> None:
    h, hk = (int(x) for x in args.heads.split("/"))
    try:
        ms, peak = torch_cp_ms(seq, h, hk, args.dim, reps, device)
        record({**base, "impl": "torch_cp", "ms": ms, "ms_per_real_token": ms / seq, "peak_gib": peak})
    except Exception:  # noqa: BLE001 - recorded in the results
        record({**base, "impl": "torch_cp", "error": traceback.format_exc(limit=4)})


def packed_backend_list(spec: str, device: torch.device) -> list[str]:
    """The packed rows' backends: ``auto`` is flash_varlen (when torch's varlen op runs here) and triton on
    a GPU, the reference kernel on the CPU."""
    if spec != "auto":
        return [b.strip() for b in spec.split(",") if b.strip()]
    if device.type != "cuda":
        return ["reference"]
    from lightseq_hf.kernels import flash_varlen

    return ["flash_varlen", "triton"] if flash_varlen.usable(device) else ["triton"]


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    owns_group = not dist.is_initialized()  # tests call main() inside their own process group
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if owns_group:
            dist.init_process_group("nccl", device_id=device)
        ranged_backend, unpacked_backends = "triton", ("sdpa_cudnn", "triton")
        dtype = torch.bfloat16
    else:
        if owns_group:
            dist.init_process_group("gloo")
        ranged_backend, unpacked_backends = "reference", ("reference",)
        dtype = torch.float32
    packed_backends = packed_backend_list(args.packed_backends, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    solo_group = [dist.new_group([r]) for r in range(world)][rank]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    slug = name.replace("NVIDIA ", "").replace(" ", "-").lower()
    date = datetime.date.today().isoformat()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"packed-{slug}-x{world}-{date}{'-' + args.tag if args.tag else ''}.json"
    h, hk = (int(x) for x in args.heads.split("/"))
    meta = {"device": name, "world": world, "date": date, "torch": torch.__version__, "dtype": str(dtype),
            "heads": h, "kv_heads": hk, "head_dim": args.dim, "batch": 1, "packed_backends": packed_backends,
            "length_mix": {"median": args.median, "sigma": args.sigma, "max": args.max_doc,
                           "seed": "1000 + seq"},
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NVSHMEM_DISABLE_NVLS", "LIGHTSEQ_TRITON_AUTOTUNE")}}
    rows: list[dict] = []
    check = None

    def write():
        if rank == 0:
            result = {**meta, "exactness_check": check, "rows": rows, "summary": summarize(rows, check)}
            out_path.write_text(json.dumps(result, indent=1))

    def record(row):
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        write()

    try:
        check = exactness_check(args, device, packed_backends, ranged_backend, solo_group)
    except Exception:  # noqa: BLE001 - recorded; summary.exact stays false
        check = {"passed": False, "error": traceback.format_exc(limit=4)}
    if rank == 0:
        print(json.dumps({"exactness_check": check}), flush=True)
    write()

    for seq in (int(x) for x in args.seqs.split(",")):
        started = time.perf_counter()
        base, reps = bench_seq(args, seq, device, dtype, packed_backends, ranged_backend, unpacked_backends,
                               record)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            if not args.no_torch_cp:
                bench_torch_cp(args, seq, device, base, reps, record)
                torch.cuda.empty_cache()
        record({**base, "impl": "wall", "wall_s": time.perf_counter() - started,
                "how": "seconds this length took, every row (autotuning included)"})
    if rank == 0:
        print(json.dumps(summarize(rows, check), indent=1))
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
