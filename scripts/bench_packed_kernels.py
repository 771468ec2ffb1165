"""Packed-row attention kernels on one GPU: forward+backward of one row of log-normal documents.

Backends on the same bf16 tokens, per row length and key/value head count: our Triton kernels with key
ranges, ``flash_varlen`` (torch's FlashAttention-2 varlen op), ``cudnn_fe`` (cuDNN's variable-length op from
nvidia-cudnn-frontend, through our backend: bucketed graph shapes, the backward's key-length split),
``auto`` (the backend ``backend="auto"`` picks for packed rows on this device class, its row ``auto_backend``;
when that backend has its own column the measurement is shared), ``op`` (one direct call of the cuDNN
frontend's op each way on the row's exact document lengths: the yardstick of ``cudnn_fe``), ``cudnn_fe_raw``
(the package's own autograd op, bottom-right causal), FlexAttention with a document block mask (compiled),
and dense cuDNN causal attention over the whole row (the per-FLOP yardstick). ``op``, ``auto`` and
``cudnn_fe_raw`` are not candidates for "best". Each is timed as wall time (CUDA events, host work
included) and GPU time (the kernels' own time, from the profiler). Useful FLOPs count the pairs each query
row sees: ``4 * heads * dim`` per pair forward, 3.5x that forward+backward.

``--stream STEPS`` then runs a changing packed stream: every step a new row of log-normal documents (seeds
20000 + step), forward+backward of every ring task of ``--stream-worlds`` ranks run on this GPU (world 1:
the whole row), per backend, timed step by step with host work and cuDNN graph builds included (graphs the
op gained in a step are counted; the ring's schedule is built before the clock starts, each task's mask,
document blocks or key ranges, inside it), against dense cuDNN on the same tokens per useful FLOP.

Writes ``packed-kernels-<gpu>-<date>.json`` to ``--out`` and prints a table. The summary has
``packed_vs_dense_per_flop`` (best packed backend's time per useful FLOP over dense cuDNN's, 64K, first head
layout), ``cudnn_fe_vs_dense_per_flop`` and ``cudnn_fe_speedup_vs_triton`` (64K, per head layout too), and
with a stream ``stream_cudnn_fe_vs_dense_per_flop`` and builds per step. Per row: ``cudnn_fe_vs_op`` (our
backend's time over the direct op call's) and ``auto_vs_fastest`` (auto's time over the fastest candidate's),
and their largest over the rows (``cudnn_fe_vs_op_max``, ``auto_vs_fastest_max``).

``--device cpu`` is the smoke run (float32, the host clock, Triton's interpreter: set TRITON_INTERPRET=1;
the backends that need a GPU are left out), e.g. ``--device cpu --seqs 256 --dims 64 --heads 2/1
--extra-dim-seq "" --flex-seqs "" --median 32 --max-doc 128``; the stream runs there on backends that take
CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from benchlib.exactness import rel_err  # noqa: E402
from benchlib.results import device_name, device_slug, today, version  # noqa: E402
from benchlib.timing import adaptive_event_ms, kernel_ms, pair_flops, timed  # noqa: E402
from benchlib.workloads import lognormal_docs  # noqa: E402

from lightseq_hf.kernels import AttentionMask, KernelRequest, MaskKind, kernel_named, select_backend  # noqa: E402
from lightseq_hf.kernels.autoselect import refusal  # noqa: E402
from lightseq_hf.kernels.varlen import cudnn as cudnn_fe  # noqa: E402
from lightseq_hf.parallel.doc_blocks import task_doc_blocks  # noqa: E402
from lightseq_hf.parallel.schedule import SpanTask  # noqa: E402
from lightseq_hf.parallel.segment_schedule import build_segment_schedule  # noqa: E402
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range  # noqa: E402

#: measured runners that are not candidates for the best packed backend
DIAGNOSTIC = ("cudnn_fe_raw", "op", "auto")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="65536,16384,32768,131072", help="tokens per packed row")
    p.add_argument("--heads", default="32/32,32/8", help="query/kv heads, comma-separated layouts")
    p.add_argument("--dims", default="128", help="head dims (comma-separated)")
    p.add_argument("--extra-dim-seq", default="65536:64", help="SEQ:DIM rows added, first head layout")
    p.add_argument("--median", type=int, default=2048, help="median document length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the document lengths")
    p.add_argument("--max-doc", type=int, default=32768)
    p.add_argument("--flex-seqs", default="16384,65536", help="rows where FlexAttention runs (compiles)")
    p.add_argument("--backends", default="triton,flash_varlen,cudnn_fe,op,auto,flex",
                   help="of triton, flash_varlen, cudnn_fe, op, auto, cudnn_fe_raw, flex")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip further table rows past this time")
    p.add_argument("--stream", type=int, default=0, help="steps of a changing packed stream (0: none)")
    p.add_argument("--stream-seq", type=int, default=65536)
    p.add_argument("--stream-heads", default="32/8")
    p.add_argument("--stream-worlds", default="1,2", help="ring sizes whose tasks the stream replays")
    p.add_argument("--stream-backends", default="cudnn_fe,triton")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke run")
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the table


def wall_and_gpu_ms(run, dev) -> tuple[float, float | None]:
    """Wall ms (CUDA events; the host clock on the CPU) and the kernels' own ms (None on the CPU)."""
    if dev.type != "cuda":
        return timed(run, 2, dev, collective=False), None
    return adaptive_event_ms(run), kernel_ms(run)


def packed_runners(seg, q, k, v, dout, scale, seq, args):
    """name -> fwd+bwd callable returning (out (b, s, h, d), dq), for the backends that run here, and the
    backend auto runs (its runner is ``"auto"``'s unless that backend has its own column)."""
    n, dev = q.shape[1], q.device
    wanted = [b for b in args.backends.split(",") if b]
    blocks = task_doc_blocks(seg, SpanTask(0, 0, 0, n, 0, True), n, True, dev)
    ranges = AttentionMask(key_range=local_key_range(*key_ranges(seg, causal=True, device=dev), 0, n))
    request = KernelRequest(dev, q.dtype, q.shape[-1], v.shape[-1], MaskKind.DOCUMENTS)
    runners = {}

    def kernel_pair(name):
        kernel = kernel_named(name)
        mask = AttentionMask(doc_blocks=blocks) if kernel.capabilities.supports_doc_blocks else ranges

        def run():
            out, lse = kernel.forward(q, k, v, scale=scale, mask=mask)
            return out, kernel.backward(dout, q, k, v, out, lse, scale=scale, mask=mask)[0]
        return run

    for name in ("triton", "flash_varlen", "cudnn_fe"):
        if name in wanted and refusal(name, request) is None:
            runners[name] = kernel_pair(name)
    if refusal("cudnn_fe", request) is None:
        if "op" in wanted:
            runners["op"] = op_runner(seg, q, k, v, dout, scale)
        if "cudnn_fe_raw" in wanted:
            runners["cudnn_fe_raw"] = raw_cudnn_fe_runner(seg, q, k, v, dout, scale)
    if "flex" in wanted and seq in args.flex_seqs:
        runners["flex"] = flex_runner(seg, q, k, v, dout, scale)
    auto = select_backend("auto", request) if "auto" in wanted else None
    if auto is not None and auto not in runners:
        runners["auto"] = kernel_pair(auto)
    return runners, auto


def op_runner(seg, q, k, v, dout, scale):
    """One direct call of the cuDNN frontend's op each way over the row's documents with their exact
    lengths (top-left causal: every document is square), the forward's lse laid out for the backward in
    between; the op reads the row's own tensors."""
    lens = [b - a for a, b in seg.docs[0]]
    dev, longest = q.device, max(lens)
    cu = torch.tensor([0, *lens]).cumsum(0).int().to(dev)
    block = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
    pos = torch.arange(sum(lens), device=dev) - cu[:-1].long()[block]
    qt, kt, vt, dt = (x[0] for x in (q, k, v, dout))
    ops = cudnn_fe.ops()
    lengths = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)

    def run():
        out, stats = ops.forward(qt, kt, vt, scale, is_causal=True, return_lse=True, **lengths)
        lse = stats.new_zeros((len(lens), q.shape[2], longest))
        lse[block, :, pos] = stats[:, :, 0]
        dq, _, _ = ops.backward(dt, qt, kt, vt, out, lse, scale, is_causal=True, **lengths)
        return out.unsqueeze(0), dq.unsqueeze(0)

    return run


def raw_cudnn_fe_runner(seg, q, k, v, dout, scale):
    """The package's own autograd op over the row's documents with their exact lengths (no buckets)."""
    lens = [b - a for a, b in seg.docs[0]]
    cu = torch.tensor([0, *lens]).cumsum(0).int().to(q.device)
    qt, kt, vt = (x[0].detach().requires_grad_() for x in (q, k, v))
    sdpa_fwd = cudnn_fe.ops().forward

    def run():
        qt.grad = kt.grad = vt.grad = None
        out, _ = sdpa_fwd(qt, kt, vt, scale, is_causal=True, causal_bottom_right=True, cu_seqlens_q=cu,
                          cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens), return_lse=True)
        out.backward(dout[0])
        return out.unsqueeze(0), qt.grad.unsqueeze(0)

    return run


def flex_runner(seg, q, k, v, dout, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[1]
    doc = torch.full((n,), -1, dtype=torch.int32)
    for i, (a, b) in enumerate(seg.docs[0]):
        doc[a:b] = i
    doc = doc.to(q.device)

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    block_mask = create_block_mask(mask_mod, 1, None, n, n, device=q.device, _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def run():
        qt.grad = kt.grad = vt.grad = None
        out = flex(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
        out.backward(dt)
        return out.transpose(1, 2), qt.grad.transpose(1, 2)

    return run


def dense_runner(q, k, v, dout, scale):
    """Dense causal cuDNN attention over the whole row, fwd+bwd (GQA native, else k/v heads expanded)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def make(kk, vv, gqa):
        def run():
            qt.grad = kk.grad = vv.grad = None
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH):
                out = F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
            out.backward(dt)
        return run

    try:
        run = make(kt, vt, group > 1)
        run()
        return run, group > 1
    except RuntimeError:
        ke, ve = (x.detach().repeat_interleave(group, 1).requires_grad_() for x in (kt, vt))
        return make(ke, ve, False), False


def row_tensors(seq, h, hk, d, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q, dout = (torch.randn(1, seq, h, d, device=device, generator=g, dtype=dtype) for _ in "qd")
    k, v = (torch.randn(1, seq, hk, d, device=device, generator=g, dtype=dtype) for _ in "kv")
    return q, k, v, dout


def bench_row(seq, d, h, hk, args, t0) -> dict:
    dev = torch.device(args.device)
    docs = lognormal_docs(seq, median=args.median, sigma=args.sigma, max_len=args.max_doc, seed=1000 + seq)
    seg = Segments(seq, (docs,))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v, dout = row_tensors(seq, h, hk, d, dev, dtype, seq + d)
    scale = d ** -0.5
    pairs = sum((b - a) * (b - a + 1) // 2 for a, b in docs)
    flops = pair_flops(h, d, pairs, with_bwd=True)
    dense_flops = pair_flops(h, d, seq * (seq + 1) // 2, with_bwd=True)
    row = {"seq": seq, "head_dim": d, "heads": h, "kv_heads": hk, "docs": len(docs),
           "longest_doc": max(b - a for a, b in docs), "useful_pairs": pairs, "fwd_bwd": {}, "rel_err": {}}
    ref = None
    runners, auto = packed_runners(seg, q, k, v, dout, scale, seq, args)
    for name, run in runners.items():
        try:
            out, dq = run()
            if ref is None:
                ref = (out.float(), dq.float())
            row["rel_err"][name] = [rel_err(x, r) for x, r in zip((out, dq), ref)]
            del out, dq
            ms, gpu_ms = wall_and_gpu_ms(run, dev)
            row["fwd_bwd"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "gpu_ms": gpu_ms}
        except Exception as e:  # a backend may refuse a shape: recorded, the table goes on
            row["fwd_bwd"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"  {seq // 1024}K {h}/{hk} d{d} {name}: {row['fwd_bwd'][name]} [{time.time() - t0:.0f}s]",
              flush=True)
        torch.cuda.empty_cache()
    if auto is not None:
        row["auto_backend"] = auto
        if auto in row["fwd_bwd"]:  # measured in its own column
            row["fwd_bwd"]["auto"] = {**row["fwd_bwd"][auto], "same_as": auto}
    run, gqa = dense_runner(q, k, v, dout, scale)
    ms, dense_gpu_ms = wall_and_gpu_ms(run, dev)
    row["dense_cudnn"] = {"ms": ms, "tflops": dense_flops / ms / 1e9, "gqa_native": gqa,
                          "gpu_ms": dense_gpu_ms}
    print(f"  {seq // 1024}K {h}/{hk} d{d} dense cuDNN: {row['dense_cudnn']}", flush=True)
    return add_ratios(row, flops, dense_flops)


def add_ratios(row: dict, flops: float, dense_flops: float) -> dict:
    """Per-FLOP ratios against dense cuDNN (the best packed backend's, cudnn_fe's); speedups over Triton."""
    ok = {n: r["ms"] for n, r in row["fwd_bwd"].items() if "ms" in r}
    dense_ms = row["dense_cudnn"]["ms"]
    candidates = {n: ms for n, ms in ok.items() if n not in DIAGNOSTIC}
    row["best_packed"] = min(candidates, key=candidates.get) if candidates else None
    row["packed_vs_dense_per_flop"] = (candidates[row["best_packed"]] / flops) / (dense_ms / dense_flops) \
        if candidates else None
    for name in ("cudnn_fe", "cudnn_fe_raw"):
        if name in ok:
            row[f"{name}_vs_dense_per_flop"] = (ok[name] / flops) / (dense_ms / dense_flops)
            if "triton" in ok:
                row[f"{name}_speedup_vs_triton"] = ok["triton"] / ok[name]
    if "triton" in ok and row["best_packed"]:
        row["packed_speedup_vs_triton"] = ok["triton"] / candidates[row["best_packed"]]
    if "cudnn_fe" in ok and "op" in ok:
        row["cudnn_fe_vs_op"] = ok["cudnn_fe"] / ok["op"]
    if "auto" in ok and candidates:
        row["auto_vs_fastest"] = ok["auto"] / candidates[row["best_packed"]]
    return row


# ----------------------------------------------------------------------------- the changing stream


def stream_tasks(seg: Segments, world: int) -> list[tuple[SpanTask, int]]:
    """Every task of every rank of a ``world``-rank ring over ``seg`` (world 1: the whole row), with its
    chunk length."""
    if world == 1:
        return [(SpanTask(0, 0, 0, seg.length, 0, diagonal=True), seg.length)]
    chunk = seg.length // world
    sched = build_segment_schedule(world, seg, True)
    return [(t, chunk) for step in sched.steps for t in step if t is not None]


def stream_step(kernel, seg, tasks, tensors, scale) -> None:
    """Forward and backward of every task of the step (the rows' own out/lse as their global ones), the
    tasks' masks built here (document blocks or key ranges: part of each backend's cost)."""
    q, k, v, dout = tensors
    blocks = kernel.capabilities.supports_doc_blocks
    ranges = None if blocks else key_ranges(seg, causal=True, device=q.device)
    for task, chunk in tasks:
        rows = slice(task.q_owner * chunk + task.row_start, task.q_owner * chunk + task.row_stop)
        key_a, key_b = task.keys(chunk)
        keys = slice(task.kv_owner * chunk + key_a, task.kv_owner * chunk + key_b)
        if ranges is None:
            mask = AttentionMask(doc_blocks=task_doc_blocks(seg, task, chunk, True, q.device))
        else:
            lo, hi = ranges
            key_range = local_key_range(lo[:, rows], hi[:, rows], keys.start, key_b - key_a)
            mask = AttentionMask(key_range=key_range)
        qt, kt, vt, dt = q[:, rows], k[:, keys], v[:, keys], dout[:, rows]
        out, lse = kernel.forward(qt, kt, vt, scale=scale, mask=mask)
        kernel.backward(dt, qt, kt, vt, out.to(qt.dtype), lse, scale=scale, mask=mask)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_stream(args, device: torch.device, dtype: torch.dtype, backends: list[str]) -> list[dict]:
    """One record per (world, backend): per-step wall ms (builds included), graphs built per step
    (cudnn_fe), useful FLOPs; steps share one set of random tensors, the documents change."""
    h, hk = (int(x) for x in args.stream_heads.split("/"))
    d, seq = int(args.dims.split(",")[0]), args.stream_seq
    tensors = row_tensors(seq, h, hk, d, device, dtype, 3)
    layouts = [Segments(seq, (lognormal_docs(seq, median=args.median, sigma=args.sigma, max_len=args.max_doc,
                                             seed=20000 + step),)) for step in range(args.stream)]
    records = []
    for world in (int(x) for x in args.stream_worlds.split(",")):
        for name in backends:
            if name == "cudnn_fe" and cudnn_fe.unavailable_reason() is not None:
                records.append({"world": world, "backend": name, "skipped": cudnn_fe.unavailable_reason()})
                continue
            kernel = kernel_named(name)
            step_ms, builds, flops = [], [], []
            for seg in layouts:
                tasks = stream_tasks(seg, world)  # the schedule: every backend's, built before the clock
                before = set(cudnn_fe.ops().graphs) if name == "cudnn_fe" else set()
                _sync(device)
                start = time.perf_counter()
                stream_step(kernel, seg, tasks, tensors, d ** -0.5)
                _sync(device)
                step_ms.append((time.perf_counter() - start) * 1e3)
                builds.append(len(set(cudnn_fe.ops().graphs) - before) if name == "cudnn_fe" else 0)
                pairs = sum((b - a) * (b - a + 1) // 2 for a, b in seg.docs[0])
                flops.append(pair_flops(h, d, pairs, with_bwd=True))
            records.append({"world": world, "backend": name, "steps": len(step_ms), "seq": seq, "heads": h,
                            "kv_heads": hk, "head_dim": d, "step_ms": step_ms, "builds": builds,
                            "step_flops": flops, "total_ms": sum(step_ms),
                            "median_step_ms": statistics.median(step_ms), "useful_flops": sum(flops),
                            "graph_stats": cudnn_fe.graph_stats()})
            print(f"stream world {world} {name}: total {sum(step_ms):.0f} ms over {len(step_ms)} steps, "
                  f"median {statistics.median(step_ms):.2f} ms, builds {sum(builds)} "
                  f"(last half {sum(builds[len(builds) // 2:])})", flush=True)
    return records


def stream_dense_ms(args) -> float:
    h, hk = (int(x) for x in args.stream_heads.split("/"))
    d = int(args.dims.split(",")[0])
    q, k, v, dout = row_tensors(args.stream_seq, h, hk, d, torch.device("cuda"), torch.bfloat16, 3)
    return adaptive_event_ms(dense_runner(q, k, v, dout, d ** -0.5)[0])


def stream_summary(records: list[dict], dense_ms: float | None) -> dict:
    """Per world: cudnn_fe's stream time per useful FLOP over dense cuDNN's (builds included, and over the
    steps that built no graph: what a step costs once its layouts' graphs exist, as in a model whose layers
    share them), its speedup over Triton on the same steps, and its graph builds (all, and in the last half
    of the steps)."""
    out = {}
    for world in sorted({r["world"] for r in records}):
        by = {r["backend"]: r for r in records if r["world"] == world and "skipped" not in r}
        entry = {}
        fe = by.get("cudnn_fe")
        if fe:
            half = fe["builds"][len(fe["builds"]) // 2:]
            entry.update(builds=sum(fe["builds"]), builds_per_step_last_half=sum(half) / max(1, len(half)),
                         median_step_ms=fe["median_step_ms"], mean_step_ms=fe["total_ms"] / fe["steps"])
            if dense_ms:
                dense = dense_ms / pair_flops(fe["heads"], fe["head_dim"], fe["seq"] * (fe["seq"] + 1) // 2,
                                              with_bwd=True)
                entry["vs_dense_per_flop"] = fe["total_ms"] / fe["useful_flops"] / dense
                steady = [(ms, f) for ms, f, b in zip(fe["step_ms"], fe["step_flops"], fe["builds"]) if not b]
                if steady:
                    entry["vs_dense_per_flop_steps_without_builds"] = (
                        sum(ms for ms, _ in steady) / sum(f for _, f in steady) / dense)
            if "triton" in by:
                entry["speedup_vs_triton"] = by["triton"]["total_ms"] / fe["total_ms"]
                late = len(fe["step_ms"]) // 2  # both past their first compiles and graph builds
                entry["speedup_vs_triton_last_half"] = sum(by["triton"]["step_ms"][late:]) / sum(
                    fe["step_ms"][late:])
        out[str(world)] = entry
    return out


# ----------------------------------------------------------------------------- summary and main


def summarize(rows: list[dict], stream: dict | None = None) -> dict:
    s = {"per_row": {f"{r['seq']}/{r['heads']}/{r['kv_heads']}/d{r['head_dim']}": {
        key: r.get(key) for key in ("best_packed", "packed_vs_dense_per_flop", "packed_speedup_vs_triton",
                                    "cudnn_fe_vs_dense_per_flop", "cudnn_fe_speedup_vs_triton",
                                    "cudnn_fe_raw_vs_dense_per_flop", "cudnn_fe_vs_op", "auto_backend",
                                    "auto_vs_fastest")} for r in rows}}
    for key in ("cudnn_fe_vs_op", "auto_vs_fastest"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            s[f"{key}_max"] = max(values)
    at64 = [r for r in rows if r["seq"] == 65536 and r["head_dim"] == 128]
    if at64:
        first = at64[0]
        s["packed_vs_dense_per_flop"] = first["packed_vs_dense_per_flop"]
        s["packed_speedup_vs_triton"] = first.get("packed_speedup_vs_triton")
        s["best_packed_64k"] = first["best_packed"]
        s["cudnn_fe_vs_dense_per_flop"] = first.get("cudnn_fe_vs_dense_per_flop")
        s["cudnn_fe_speedup_vs_triton"] = first.get("cudnn_fe_speedup_vs_triton")
        s["cudnn_fe_vs_dense_per_flop_by_heads"] = {f"{r['heads']}/{r['kv_heads']}":
                                                    r.get("cudnn_fe_vs_dense_per_flop") for r in at64}
    if stream:
        s["stream"] = stream
        ring = stream.get("2") or next(iter(stream.values()), {})
        s["stream_cudnn_fe_vs_dense_per_flop"] = ring.get("vs_dense_per_flop")
        s["stream_builds_per_step_last_half"] = ring.get("builds_per_step_last_half")
    return s


def table_plan(args) -> list[tuple[int, int, int, int]]:
    heads = [tuple(int(x) for x in layout.split("/")) for layout in args.heads.split(",") if layout]
    plan = [(int(s), int(d), h, hk) for h, hk in heads for s in args.seqs.split(",") if s
            for d in args.dims.split(",")]
    if args.extra_dim_seq:
        s, d = args.extra_dim_seq.split(":")
        plan.append((int(s), int(d), *heads[0]))
    return sorted(plan, key=lambda p: (p[0] != 65536, p[0]))  # the summary's 64K rows first


def main(argv=None) -> None:
    args = parse_args(argv)
    args.flex_seqs = {int(x) for x in args.flex_seqs.split(",") if x}
    device = torch.device(args.device)
    name = device_name(device)
    cuda = device.type == "cuda"
    res = {"device": name, "date": today(),
           "versions": {package: version(package) for package in ("torch", "triton", "cuda", "cudnn")},
           "config": {"dtype": "bfloat16" if cuda else "float32", "batch": 1, "heads": args.heads,
                      "median": args.median, "sigma": args.sigma, "max_doc": args.max_doc,
                      "timing": "CUDA events, median" if cuda else "host clock, median",
                      "flops": "useful pairs x 4*heads*dim, fwd+bwd 3.5x"},
           "cudnn_fe": {"unavailable": cudnn_fe.unavailable_reason()}, "rows": []}
    res["versions"]["nvidia-cudnn-frontend"] = version("nvidia-cudnn-frontend")
    if res["cudnn_fe"]["unavailable"] is None:
        res["versions"]["cudnn_loaded_by_frontend"] = cudnn_fe.ops().cudnn_version
    path = Path(args.out) / f"packed-kernels-{device_slug(name, short=True)}-{res['date']}{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for seq, d, h, hk in table_plan(args):
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {seq} {h}/{hk} d{d} skipped", flush=True)
            continue
        res["rows"].append(bench_row(seq, d, h, hk, args, t0))
        res["summary"] = summarize(res["rows"])
        path.write_text(json.dumps(res, indent=1))
    stream = None
    if args.stream:
        dtype = torch.bfloat16 if cuda else torch.float64
        backends = [b for b in args.stream_backends.split(",") if b]
        res["stream"] = run_stream(args, device, dtype, backends)
        stream = stream_summary(res["stream"], stream_dense_ms(args) if cuda else None)
    res["summary"] = summarize(res["rows"], stream)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    for r in res["rows"]:
        cells = " ".join(f"{n}={v['ms']:.2f}" if "ms" in v else f"{n}=err" for n, v in r["fwd_bwd"].items())
        per_flop = r["packed_vs_dense_per_flop"]
        print(f"{r['seq'] // 1024:>4}K {r['heads']}/{r['kv_heads']} d{r['head_dim']} docs {r['docs']:>3} | "
              f"{cells} | dense={r['dense_cudnn']['ms']:.2f} | best {r['best_packed']} per-FLOP vs dense "
              f"{per_flop if per_flop is None else round(per_flop, 3)}")
    print("summary:", json.dumps({k: v for k, v in res["summary"].items() if k != "per_row"}))


if __name__ == "__main__":
    main()
