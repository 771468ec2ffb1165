"""Packed-row attention kernels on one GPU: forward+backward of one row of log-normal documents.

Backends on the same bf16 tokens: ``cudnn_varlen`` (torch's cuDNN varlen op, one call per row), our
Triton kernels with key ranges, ``flash_varlen`` (torch's FlashAttention-2 varlen op), FlexAttention with
a document block mask (compiled), and dense cuDNN causal attention over the whole row (the per-FLOP
yardstick). Each is timed twice: wall time (CUDA events around the calls, host work included: torch 2.11's
cuDNN varlen op rebuilds its graph on every call) and GPU time (the kernels' own time, from the profiler).
Useful FLOPs count the pairs each query row sees: ``4 * heads * dim`` per pair forward, 3.5x that
forward+backward. It first runs single op calls of short sequences, each in its own process with a time
limit (one call of one-token sequences did not return).

Writes ``packed-kernels-<gpu>-<date>.json`` to ``--out`` and prints a table; the summary has
``packed_vs_dense_per_flop`` (best packed backend's time per useful FLOP over dense cuDNN's, 64K) and
``packed_speedup_vs_triton`` (Triton packed time over the best packed backend's, 64K).

``--device cpu`` is the smoke run (float32, the host clock, Triton's interpreter: set TRITON_INTERPRET=1;
the backends that need a GPU are left out), e.g. ``--device cpu --seqs 256 --dims 64 --heads 2/1
--extra-dim-seq "" --flex-seqs "" --median 32 --max-doc 128 --no-cudnn-varlen``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from benchlib.exactness import rel_err  # noqa: E402
from benchlib.results import device_name, device_slug, today, version  # noqa: E402
from benchlib.timing import adaptive_event_ms, kernel_ms, pair_flops, timed  # noqa: E402
from benchlib.workloads import lognormal_docs  # noqa: E402

from lightseq_hf.kernels import cudnn_ops, cudnn_varlen, flash_varlen  # noqa: E402
from lightseq_hf.parallel.doc_blocks import task_doc_blocks  # noqa: E402
from lightseq_hf.parallel.schedule import SpanTask  # noqa: E402
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range  # noqa: E402

PACKED = ("cudnn_varlen", "triton", "flash_varlen", "flex")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="16384,32768,65536,131072", help="tokens per packed row")
    p.add_argument("--heads", default="32/8", help="query/kv heads")
    p.add_argument("--dims", default="128", help="head dims (comma-separated)")
    p.add_argument("--extra-dim-seq", default="65536:64", help="SEQ:DIM rows added (empty: none)")
    p.add_argument("--median", type=int, default=2048, help="median document length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the document lengths")
    p.add_argument("--max-doc", type=int, default=32768)
    p.add_argument("--flex-seqs", default="16384,65536", help="rows where FlexAttention runs (compiles)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip further rows past this time")
    p.add_argument("--no-cudnn-varlen", action="store_true", help="leave the cuDNN varlen op out entirely")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--cudnn-varlen-despite-defects", action="store_true",
                   help="time cudnn_varlen also where its torch is refused (its backward may be wrong)")
    p.add_argument("--fact", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the smoke run")
    return p.parse_args(argv)


def wall_and_gpu_ms(run, dev) -> tuple[float, float | None]:
    """Wall ms (CUDA events; the host clock on the CPU) and the kernels' own ms (None on the CPU)."""
    if dev.type != "cuda":
        return timed(run, 2, dev, collective=False), None
    return adaptive_event_ms(run), kernel_ms(run)


def packed_runners(seg, q, k, v, dout, scale, seq, args):
    """name -> (fwd+bwd callable, forward callable returning (out (b, s, h, d), dq))."""
    n, d = q.shape[1], q.shape[3]
    dev = q.device
    blocks = task_doc_blocks(seg, SpanTask(0, 0, 0, n, 0, True), n, True, dev)
    rng = local_key_range(*key_ranges(seg, causal=True, device=dev), 0, n)
    runners = {}

    def kernel_pair(kernel, **mask):
        def run():
            out, lse = kernel.forward(q, k, v, causal=False, scale=scale, **mask)
            return out, kernel.backward(dout, q, k, v, out, lse, causal=False, scale=scale, **mask)[0]
        return run

    cudnn_ok = cudnn_ops.usable(dev) or args.cudnn_varlen_despite_defects
    if not args.no_cudnn_varlen and cudnn_ok and cudnn_ops.head_dim_ok(d):
        runners["cudnn_varlen"] = kernel_pair(cudnn_varlen.CudnnVarlenKernel(), doc_blocks=blocks)
    from lightseq_hf.kernels.triton_attn import TritonKernel

    runners["triton"] = kernel_pair(TritonKernel(), key_range=rng)
    if flash_varlen.usable(dev):
        runners["flash_varlen"] = kernel_pair(flash_varlen.FlashVarlenKernel(), doc_blocks=blocks)
    if seq in args.flex_seqs:
        runners["flex"] = flex_runner(seg, q, k, v, dout, scale)
    return runners


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


def bench_row(seq, d, args, h, hk, t0) -> dict:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    docs = lognormal_docs(seq, median=args.median, sigma=args.sigma, max_len=args.max_doc, seed=1000 + seq)
    seg = Segments(seq, (docs,))
    g = torch.Generator(device=dev).manual_seed(seq + d)
    q, dout = (torch.randn(1, seq, h, d, device=dev, generator=g, dtype=dtype) for _ in "qd")
    k, v = (torch.randn(1, seq, hk, d, device=dev, generator=g, dtype=dtype) for _ in "kv")
    scale = d ** -0.5
    pairs = sum((b - a) * (b - a + 1) // 2 for a, b in docs)
    flops = pair_flops(h, d, pairs, with_bwd=True)
    dense_flops = pair_flops(h, d, seq * (seq + 1) // 2, with_bwd=True)
    row = {"seq": seq, "head_dim": d, "heads": h, "kv_heads": hk, "docs": len(docs),
           "longest_doc": max(b - a for a, b in docs), "useful_pairs": pairs, "fwd_bwd": {}, "rel_err": {}}
    ref = None
    for name, run in packed_runners(seg, q, k, v, dout, scale, seq, args).items():
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
        print(f"  {seq // 1024}K d{d} {name}: {row['fwd_bwd'][name]} [{time.time() - t0:.0f}s]", flush=True)
        torch.cuda.empty_cache()
    run, gqa = dense_runner(q, k, v, dout, scale)
    ms, dense_gpu_ms = wall_and_gpu_ms(run, dev)
    row["dense_cudnn"] = {"ms": ms, "tflops": dense_flops / ms / 1e9, "gqa_native": gqa,
                          "gpu_ms": dense_gpu_ms}
    print(f"  {seq // 1024}K d{d} dense cuDNN: {row['dense_cudnn']}", flush=True)
    ok = {n: r["ms"] for n, r in row["fwd_bwd"].items() if "ms" in r}
    if not ok:
        row["best_packed"], row["packed_vs_dense_per_flop"] = None, None
        return row
    best = min(ok, key=ok.get)
    row["best_packed"] = best
    row["packed_vs_dense_per_flop"] = (ok[best] / flops) / (ms / dense_flops)
    if "triton" in ok:
        row["packed_speedup_vs_triton"] = ok["triton"] / ok[best]
    gpu = {n: r.get("gpu_ms") for n, r in row["fwd_bwd"].items() if r.get("gpu_ms")}
    dense_gpu = row["dense_cudnn"]["gpu_ms"]
    if "cudnn_varlen" in gpu and dense_gpu:  # what the op costs once its graph is not rebuilt every call
        row["cudnn_varlen_gpu_vs_dense_per_flop"] = (gpu["cudnn_varlen"] / flops) / (dense_gpu / dense_flops)
        if "triton" in gpu:
            row["cudnn_varlen_gpu_speedup_vs_triton"] = gpu["triton"] / gpu["cudnn_varlen"]
    return row


def probe_record() -> dict:
    dev = torch.device("cuda")
    try:
        tr = cudnn_ops.op_traits(dev)
    except Exception as e:  # the op cannot run here: recorded as such
        return {"usable": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    align = "bottom-right" if tr.bottom_right else "top-left"
    return {"usable": cudnn_ops.usable(dev), "unusable_reason": cudnn_ops.unusable_reason(dev),
            "lse_layout": repr(tr.lse), "causal": align,
            "host_ms_per_repeated_call": tr.call_ms, "rebuilds_graph_every_call": tr.rebuilds_graph}


FACT_CASES = [("gqa d64, lens (2,3)/(5,3)", (2, 3), (5, 3), 8, 2, 64),
              ("one-token sequences (1,1,1)/(1,1,1)", (1, 1, 1), (1, 1, 1), 4, 2, 128),
              ("longest query 1: (1,1)/(5,3)", (1, 1), (5, 3), 4, 2, 128),
              ("a one-token sequence among longer: (1,4)/(1,4)", (1, 4), (1, 4), 4, 2, 128),
              ("a one-row sequence among longer: (1,4)/(3,4)", (1, 4), (3, 4), 4, 2, 128),
              ("16K tokens, 8 sequences, 32/8 heads", (2048,) * 8, (2048,) * 8, 32, 8, 128)]


def op_fact(index: int) -> dict:
    """One case of raw op calls: forward, backward, lse layout, host time of repeated identical calls."""
    label, ql, kl, h, hk, d = FACT_CASES[index]
    dev, rec = torch.device("cuda"), {"case": label}
    q, dout = (torch.randn(sum(ql), h, d, device=dev, dtype=torch.bfloat16) for _ in "qd")
    k, v = (torch.randn(sum(kl), hk, d, device=dev, dtype=torch.bfloat16) for _ in "kv")
    cu_q, cu_k = (torch.tensor([0, *lens], device=dev).cumsum(0).int() for lens in (ql, kl))
    args = (cu_q, cu_k, max(ql), max(kl), True, d ** -0.5)
    out, lse, seed, off = cudnn_ops.op_forward(q, k, v, *args)
    torch.cuda.synchronize()
    rec.update(lse_shape=list(lse.shape), lse_stride=list(lse.stride()), lse_dtype=str(lse.dtype),
               out_finite=bool(out.isfinite().all()))

    def fwd():
        return cudnn_ops.op_forward(q, k, v, *args)

    def bwd():
        return cudnn_ops.op_backward(dout, q, k, v, out, lse, seed, off, *args)

    rec["host_ms_forward"] = [cudnn_ops.host_ms(fwd, dev) for _ in range(3)]
    rec["grads_finite"] = all(bool(x.isfinite().all()) for x in bwd())
    rec["host_ms_backward"] = [cudnn_ops.host_ms(bwd, dev) for _ in range(3)]
    torch.cuda.synchronize()
    return rec


def op_facts(limit_s: float = 40.0) -> list[dict]:
    """Every fact case in its own process, all at once, each given ``limit_s`` (a call may not return)."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, __file__, "--fact", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(len(FACT_CASES))]
    start, facts = time.time(), []
    for i, proc in enumerate(procs):
        try:
            text, _ = proc.communicate(timeout=max(1.0, limit_s - (time.time() - start)))
            lines = [ln for ln in text.splitlines() if ln.startswith("{")]
            rec = json.loads(lines[-1]) if lines else {"case": FACT_CASES[i][0], "error": text[-400:]}
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rec = {"case": FACT_CASES[i][0], "error": f"no result within {limit_s:.0f} s"}
        print("fact:", rec, flush=True)
        facts.append(rec)
    return facts


def summarize(rows: list[dict]) -> dict:
    at64 = [r for r in rows if r["seq"] == 65536 and r["head_dim"] == 128]
    s = {"per_row": {f"{r['seq']}/d{r['head_dim']}": {
        "best_packed": r["best_packed"], "packed_vs_dense_per_flop": r["packed_vs_dense_per_flop"],
        "packed_speedup_vs_triton": r.get("packed_speedup_vs_triton")} for r in rows}}
    if at64:
        s["packed_vs_dense_per_flop"] = at64[0]["packed_vs_dense_per_flop"]
        s["packed_speedup_vs_triton"] = at64[0].get("packed_speedup_vs_triton")
        s["best_packed_64k"] = at64[0]["best_packed"]
        s["cudnn_varlen_gpu_vs_dense_per_flop"] = at64[0].get("cudnn_varlen_gpu_vs_dense_per_flop")
        s["cudnn_varlen_gpu_speedup_vs_triton"] = at64[0].get("cudnn_varlen_gpu_speedup_vs_triton")
    return s


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fact is not None:
        try:
            print(json.dumps(op_fact(args.fact)), flush=True)
        except Exception as e:  # the parent records it
            error = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps({"case": FACT_CASES[args.fact][0], "error": error}))
        return
    args.flex_seqs = {int(x) for x in args.flex_seqs.split(",") if x}
    h, hk = (int(x) for x in args.heads.split("/"))
    plan = [(int(s), int(d)) for s in args.seqs.split(",") for d in args.dims.split(",")]
    if args.extra_dim_seq:
        s, d = args.extra_dim_seq.split(":")
        plan.append((int(s), int(d)))
    name = device_name(args.device)
    res = {"device": name, "date": today(),
           "versions": {package: version(package) for package in ("torch", "triton", "cuda", "cudnn")},
           "config": {"dtype": "bfloat16" if args.device == "cuda" else "float32",
                      "batch": 1, "heads": h, "kv_heads": hk, "median": args.median,
                      "sigma": args.sigma, "max_doc": args.max_doc,
                      "timing": "CUDA events, median" if args.device == "cuda" else "host clock, median",
                      "flops": "useful pairs x 4*heads*dim, fwd+bwd 3.5x"},
           "rows": []}
    if not args.no_cudnn_varlen:
        res["cudnn_op_facts"], res["cudnn_varlen_probe"] = op_facts(), probe_record()
    print("probe:", res.get("cudnn_varlen_probe"), flush=True)
    path = Path(args.out) / f"packed-kernels-{device_slug(name, short=True)}-{res['date']}{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for seq, d in plan:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {seq} d{d} skipped", flush=True)
            continue
        res["rows"].append(bench_row(seq, d, args, h, hk, t0))
        res["summary"] = summarize(res["rows"])
        path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    for r in res["rows"]:
        cells = " ".join(f"{n}={v['ms']:.2f}" if "ms" in v else f"{n}=err" for n, v in r["fwd_bwd"].items())
        print(f"{r['seq'] // 1024:>4}K d{r['head_dim']} docs {r['docs']:>3} | {cells} | "
              f"dense={r['dense_cudnn']['ms']:.2f} | best {r['best_packed']} per-FLOP vs dense "
              f"{r['packed_vs_dense_per_flop']:.3f}")
    print("summary:", json.dumps({k: v for k, v in res["summary"].items() if k != "per_row"}))


if __name__ == "__main__":
    main()
