"""Packed-sequence attention benchmark: ours against the ways peers handle documents, same run.

Launch with torchrun, one process per GPU (multicast off on shared machines)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 2 scripts/bench_packed.py --out benchmarks/results

Each row of ``--seqs`` tokens is packed from documents of a log-normal length mix (median 2K,
at most 32K, fixed seed; the last document is cut to fit). Rows, forward+backward, bf16:

- ``packed_ours``: ``dist_flash_attn(segments=...)`` (the segment schedule, one key/value shard per GPU,
  overlapped transfers), once per local kernel of ``--packed-backends`` (each row tagged ``backend``):
  ``flash_varlen`` (torch's FlashAttention-2 varlen op, one call per task for all its documents; when the
  op runs on the GPU), ``cudnn_fe`` (cuDNN's variable-length op from nvidia-cudnn-frontend, one call per
  task; when the package is installed) and ``triton`` (our kernels with per-row key ranges);
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
(``packed_backend``), with ``packed_<other>_over_packed`` for the others, ``ring_speedup_vs_triton`` per
backend (the Triton ring's time over the backend's) and ``ring_speedup_vs_triton_64k`` (cudnn_fe's at
64K, else the fastest other backend's). Results:
``benchmarks/results/packed-<device>-x<P>-<date>.json``.

``--device cpu`` runs the same code on gloo with the reference kernel and tiny sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from benchlib.ablations import transfer_mode  # noqa: E402
from benchlib.exactness import all_ranks, per_document_reference, rel_err  # noqa: E402
from benchlib.launch import finish, free_memory, init_distributed, solo_group  # noqa: E402
from benchlib.peers import allgather_varlen, cp_inputs, fwd_bwd, ours, torch_context_parallel  # noqa: E402
from benchlib.results import (  # noqa: E402
    MULTICAST_ENV,
    ResultsFile,
    device_name,
    env_vars,
    failure,
    find,
    results_path,
    run_meta,
)
from benchlib.timing import peak_gib, per_rank, timed  # noqa: E402
from benchlib.workloads import lognormal_docs  # noqa: E402

from lightseq_hf.parallel.segment_schedule import PAIRS, build_segment_schedule, modeled_loads  # noqa: E402
from lightseq_hf.parallel.segments import Segments  # noqa: E402


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
                   help="local kernels of the packed rows, comma-separated (auto: on a GPU, flash_varlen "
                        "where torch has the varlen op, cudnn_fe where its package is installed, and "
                        "triton; reference on the CPU)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- exactness on the device


def check_inputs(args, device: torch.device):
    """The exactness check's packed row (a quarter of the heads, shorter documents) and its full
    ``(q, k, v, dout)`` (the same on every rank)."""
    n = args.check_seq
    h, hk = (int(x) for x in args.heads.split("/"))
    h, hk = max(1, h // 4), max(1, hk // 4)
    docs = lognormal_docs(n, median=max(1, args.median // 4), sigma=args.sigma, max_len=n // 2, seed=11)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(5)
    q, dout = (torch.randn(1, n, h, args.dim, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, n, hk, args.dim, device=device, generator=g).to(dtype) for _ in range(2))
    return docs, (q, k, v, dout)


def exactness_check(args, device, backends, ranged_backend, solo_group) -> dict:
    """Ours (each of ``backends``) on every rank against a per-document float32 reference and the same
    kernel on one device; the all-gather baseline with ``ranged_backend``. Top-level ``out``/``dq``/...
    are the first backend's; ``per_backend`` holds each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    docs, (q, k, v, dout) = check_inputs(args, device)
    n, h, hk = q.shape[1], q.shape[2], k.shape[2]
    seg = Segments(n, (docs,))
    ref = per_document_reference(q, k, v, dout, docs)
    local = n // world
    sl = slice(rank * local, (rank + 1) * local)

    def run(attn, qq, kk, vv, dd):
        qq, kk, vv = (t.clone().requires_grad_() for t in (qq, kk, vv))
        out = attn(qq, kk, vv)
        out.backward(dd)
        return out.detach(), qq.grad, kk.grad, vv.grad

    gathered = run(allgather_varlen(seg, ranged_backend, device), q[:, sl], k[:, sl], v[:, sl], dout[:, sl])
    result = {"seq": n, "heads": h, "kv_heads": hk, "docs": len(docs), "dtype": str(q.dtype), "passed": True,
              "backends": list(backends), "per_backend": {}}
    for backend in backends:
        mine = run(ours(segments=seg, backend=backend, group=None), q[:, sl], k[:, sl], v[:, sl], dout[:, sl])
        single = run(ours(segments=seg, backend=backend, group=solo_group), q, k, v, dout)
        entry: dict = {"passed": True}
        for name, x, s, a, r in zip(("out", "dq", "dk", "dv"), mine, single, gathered, ref):
            err, ag_err = rel_err(x, r[:, sl]), rel_err(a, r[:, sl])
            single_err = rel_err(s[:, sl], r[:, sl])
            bound = 2 * single_err + 1e-3  # distributed within twice the one-device error
            entry[name] = {"rel_err_per_rank": per_rank(err, device), "single_device_rel_err": single_err,
                           "bound": bound, "allgather_varlen_rel_err_per_rank": per_rank(ag_err, device)}
            entry["passed"] = all_ranks(err <= bound and single_err <= 3e-2, device) and entry["passed"]
        result["per_backend"][backend] = entry
        result["passed"] = result["passed"] and entry["passed"]
    result.update({name: result["per_backend"][backends[0]][name] for name in ("out", "dq", "dk", "dv")})
    return result


# ----------------------------------------------------------------------------- rows and summary


def summarize(rows: list[dict], check: dict | None) -> dict:
    """Headline numbers: busy spread, packed vs the same tokens unpacked, exactness."""
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
        if "triton" in packed_by and len(packed_by) > 1:
            entry["ring_speedup_vs_triton"] = {b: packed_by["triton"] / ms for b, ms in packed_by.items()
                                               if b != "triton"}
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
                other = find(rows, "ms", impl=impl, seq=seq)
                if other:
                    entry[f"{impl}_over_packed"] = other / packed
        summary["per_seq"][str(seq)] = entry
    summary["busy_spread_max"] = max(spreads) if spreads else None
    e64 = summary["per_seq"].get("65536", {})
    unpacked = [e64.get(f"unpacked_ours_{b}_over_packed") for b in ("sdpa_cudnn", "triton", "reference")]
    unpacked = [x for x in unpacked if x]
    summary["packed_vs_unpacked_64k"] = min(unpacked) if unpacked else None  # vs the fastest unpacked
    vs_triton = e64.get("ring_speedup_vs_triton", {})
    summary["ring_speedup_vs_triton_64k"] = vs_triton.get("cudnn_fe", max(vs_triton.values(), default=None))
    summary["exact"] = bool(check and check.get("passed"))
    return summary


def row_inputs(args, seq: int, device: torch.device, dtype: torch.dtype):
    """This rank's shard ``(q, k, v, dout)`` of a ``seq``-token row (leaves requiring gradients)."""
    h, hk = (int(x) for x in args.heads.split("/"))
    local = seq // dist.get_world_size()
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    q = torch.randn(1, local, h, args.dim, device=device, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, local, hk, args.dim, device=device, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, local, hk, args.dim, device=device, generator=g).to(dtype).requires_grad_()
    return q, k, v, torch.randn_like(q)


def bench_seq(args, seq, device, dtype, packed_backends, ranged_backend, unpacked_backends,
              record) -> tuple[dict, int]:
    """Every row of one packed length."""
    world = dist.get_world_size()
    reps = args.reps if seq <= 65536 else max(3, args.reps // 2)
    docs = lognormal_docs(seq, median=args.median, sigma=args.sigma, max_len=args.max_doc, seed=1000 + seq)
    seg = Segments(seq, (docs,))
    tensors = row_inputs(args, seq, device, dtype)
    base = {"seq": seq, "docs": len(docs), "longest_doc": max(b - a for a, b in docs)}

    def run_row(impl, attn, **tags):
        try:
            fn = fwd_bwd(attn, *tensors)
            ms = timed(fn, reps, device)
            peak = peak_gib(fn, device)
            record({**base, "impl": impl, **tags, "ms": ms, "ms_per_real_token": ms / seq, "peak_gib": peak})
            return ms
        except Exception:  # noqa: BLE001 - recorded in the results
            record({**base, "impl": impl, **tags, **failure(limit=4)})
            free_memory(device)
            return None

    for packed_backend in packed_backends:
        packed = ours(segments=seg, backend=packed_backend, check_shapes=False)
        run_row("packed_ours", packed, backend=packed_backend)
        row = {**base, "impl": "packed_compute_only", "backend": packed_backend}
        try:
            with transfer_mode("compute_only"):
                alone = timed(fwd_bwd(packed, *tensors), reps, device, collective=False)
            busy = per_rank(alone, device)
            record({**row, "ms": max(busy), "per_rank_ms": busy, **schedule_record(seg, world)})
        except Exception:  # noqa: BLE001
            record({**row, **failure(limit=4)})
    unpacked = {b: run_row(f"unpacked_ours_{b}", ours(segments=None, backend=b, check_shapes=False))
                for b in unpacked_backends}
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
    """torch context parallel (SDPA cuDNN, allgather rotation) on the row as one causal sequence."""
    h, hk = (int(x) for x in args.heads.split("/"))
    try:
        qb, kb, vb = cp_inputs(seq, h, hk, args.dim, device, torch.Generator(device=device).manual_seed(7))
        with torch_context_parallel([qb, kb, vb], [2, 2, 2], device, "allgather"):
            dout = torch.randn_like(qb)
            for t in (qb, kb, vb):
                t.requires_grad_()
            fn = fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                         qb, kb, vb, dout)
            ms = timed(fn, reps, device)
            peak = peak_gib(fn, device)
        record({**base, "impl": "torch_cp", "ms": ms, "ms_per_real_token": ms / seq, "peak_gib": peak})
    except Exception:  # noqa: BLE001 - recorded in the results
        record({**base, "impl": "torch_cp", **failure(limit=4)})


def packed_backend_list(spec: str, device: torch.device) -> list[str]:
    """The packed rows' backends: ``auto`` is, on a GPU, flash_varlen (when torch's varlen op runs here),
    cudnn_fe (when nvidia-cudnn-frontend is installed and usable) and triton; the reference kernel on the
    CPU."""
    if spec != "auto":
        return [b.strip() for b in spec.split(",") if b.strip()]
    if device.type != "cuda":
        return ["reference"]
    from lightseq_hf.kernels.varlen import cudnn as cudnn_fe
    from lightseq_hf.kernels.varlen import flash as flash_varlen

    found = ["flash_varlen"] if flash_varlen.usable(device) else []
    if cudnn_fe.unavailable_reason() is None:
        found.append("cudnn_fe")
    return [*found, "triton"]


def packed_meta(args, device: torch.device, dtype: torch.dtype, packed_backends: list[str]) -> dict:
    h, hk = (int(x) for x in args.heads.split("/"))
    meta = run_meta(device_name(device), dist.get_world_size(), "triton", "cudnn", "nvidia-cudnn-frontend")
    meta.update(dtype=str(dtype), heads=h, kv_heads=hk, head_dim=args.dim, batch=1,
                packed_backends=packed_backends,
                length_mix={"median": args.median, "sigma": args.sigma, "max": args.max_doc,
                            "seed": "1000 + seq"},
                env=env_vars(*MULTICAST_ENV))
    return meta


def main(argv=None) -> None:
    args = parse_args(argv)
    device, owns_group = init_distributed(args.device)
    cuda = device.type == "cuda"
    ranged_backend, unpacked_backends = ("triton", ("sdpa_cudnn", "triton")) if cuda else \
        ("reference", ("reference",))
    dtype = torch.bfloat16 if cuda else torch.float32
    packed_backends = packed_backend_list(args.packed_backends, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    alone = solo_group()
    results = ResultsFile(results_path(args.out, "packed", device_name(device), world, args.tag),
                          packed_meta(args, device, dtype, packed_backends),
                          lambda rows: summarize(rows, results.sections["exactness_check"]), rank=rank)
    results.sections["exactness_check"] = None
    try:
        check = exactness_check(args, device, packed_backends, ranged_backend, alone)
    except Exception:  # noqa: BLE001 - recorded; summary.exact stays false
        check = {"passed": False, **failure(limit=4)}
    results.sections["exactness_check"] = check
    if rank == 0:
        print(json.dumps({"exactness_check": check}), flush=True)
    results.write()
    for seq in (int(x) for x in args.seqs.split(",")):
        started = time.perf_counter()
        base, reps = bench_seq(args, seq, device, dtype, packed_backends, ranged_backend, unpacked_backends,
                               results.record)
        if cuda:
            torch.cuda.empty_cache()
            if not args.no_torch_cp:
                bench_torch_cp(args, seq, device, base, reps, results.record)
                torch.cuda.empty_cache()
        results.record({**base, "impl": "wall", "wall_s": time.perf_counter() - started,
                        "how": "seconds this length took, every row (autotuning included)"})
    if rank == 0:
        print(json.dumps(summarize(results.rows, check), indent=1))
    dist.barrier()
    finish(owns_group)


if __name__ == "__main__":
    main()
