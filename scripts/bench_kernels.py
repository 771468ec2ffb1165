"""Benchmark the triton backend against torch SDPA (cuDNN and flash) in one run, on the same inputs, and the
backend ``backend="auto"`` picks on this device class through the kernel contract (``auto``; the row's
``auto_backend``, and per mode ``auto_vs_fastest``: its time over the fastest of ours, cuDNN and flash).

Forward and forward+backward, bf16, batch 1, seq 4K..64K, heads 32/32 and 32/8 (8/8 and 8/2 at 64K),
head dims 128 and 64, causal and non-causal. Writes ``kernels-<device>-<date>.json`` and a PNG plot
to ``--out`` and prints a table. ``--plot-from FILE.json`` only redraws the plot from a JSON file.

TFLOP/s: causal forward = 2*B*H*N^2*D, non-causal 4*B*H*N^2*D, forward+backward = 3.5x forward.

``--device cpu`` is the smoke run: the Triton kernels in Triton's interpreter (set ``TRITON_INTERPRET=1``
before Python starts), float32, the host clock, torch's math SDPA as the reference, no SDPA timings, e.g.
``TRITON_INTERPRET=1 python scripts/bench_kernels.py --device cpu --seqs 128 --head-dims 64 --heads 2/2,2/1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from benchlib.exactness import rel_err  # noqa: E402
from benchlib.plots import draw_lines, pyplot, save  # noqa: E402
from benchlib.results import device_name, device_slug, today, version  # noqa: E402
from benchlib.timing import attention_flops, timed  # noqa: E402

IMPLS = ("ours", "cudnn", "flash", "auto")
#: the columns that are registered backends (triton, sdpa_cudnn, sdpa_flash): auto is measured against them
REGISTERED = ("ours", "cudnn", "flash")


def measure_ceilings(torch, do_bench) -> dict:
    """bf16 8192^3 matmul rate and device-to-device copy bandwidth (read + write)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    x = torch.randn(512 * 2**20, device="cuda", dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    ms_copy = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return {
        "matmul_bf16_8192_tflops": 2 * 8192**3 / ms / 1e9,
        "copy_bandwidth_tbps": 2 * x.numel() * 4 / ms_copy / 1e9,
    }


def kernel_fns(kern, n: int, h: int, hk: int, d: int, causal: bool, device) -> dict:
    """Closures over one shape's random inputs (bf16; float32 on the CPU): ``ours_fwd``, ``ours_fwd_bwd``,
    ``ours_bwd`` (the backward alone, of a forward made here; the only holder of its out and lse),
    ``auto_fwd``, ``auto_fwd_bwd`` (the backend auto picks, named by ``auto_backend``),
    ``sdpa_fwd(backend, expanded=False)``, ``sdpa_fwd_bwd(backend, expanded=False)``; with ``sdpa_grads``
    (the SDPA inputs, whose gradients the timer drops) and ``rel_err_vs_flash`` (ours against SDPA flash,
    checked before any timing; ``rel_err_vs_math`` against math SDPA on the CPU)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, n, h, d, device=device, dtype=dtype)
    k = torch.randn(1, n, hk, d, device=device, dtype=dtype)
    v = torch.randn(1, n, hk, d, device=device, dtype=dtype)
    do = torch.randn_like(q)
    scale, gqa = d**-0.5, h != hk
    # SDPA inputs in (b, h, s, d), made contiguous outside the timed region.
    qt, kt, vt, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    for t in (qt, kt, vt):
        t.requires_grad_()

    def ours_fwd():
        return kern.forward(q, k, v, causal=causal, scale=scale)

    def ours_fwd_bwd():
        o, lse = kern.forward(q, k, v, causal=causal, scale=scale)
        return kern.backward(do, q, k, v, o, lse, causal=causal, scale=scale)

    from lightseq_hf.kernels import KernelRequest, MaskKind, kernel_named, select_backend

    auto_backend = select_backend("auto", KernelRequest(device, dtype, d, d,
                                                        MaskKind.CAUSAL if causal else MaskKind.FULL))
    auto = kernel_named(auto_backend)

    def auto_fwd():
        return auto.forward(q, k, v, causal=causal, scale=scale)

    def auto_fwd_bwd():
        o, lse = auto.forward(q, k, v, causal=causal, scale=scale)
        return auto.backward(do, q, k, v, o, lse, causal=causal, scale=scale)

    def sdpa(be, expanded=False):
        """torch SDPA with GQA heads in place, or (``expanded``) the way Transformers' SDPA attention calls
        it: keys/values repeated to every query head."""
        keys, values = (t.repeat_interleave(h // hk, 1) for t in (kt, vt)) if expanded else (kt, vt)
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(qt, keys, values, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa and not expanded)

    def sdpa_fwd(be, expanded=False):
        with torch.no_grad():
            return sdpa(be, expanded)

    def sdpa_fwd_bwd(be, expanded=False):
        sdpa(be, expanded).backward(dot)

    o, lse = ours_fwd()
    reference, backend = ("flash", SDPBackend.FLASH_ATTENTION) if device.type == "cuda" else \
        ("math", SDPBackend.MATH)
    err = rel_err(o.transpose(1, 2), sdpa_fwd(backend))
    return {"ours_fwd": ours_fwd, "ours_fwd_bwd": ours_fwd_bwd, "auto_fwd": auto_fwd,
            "auto_fwd_bwd": auto_fwd_bwd, "auto_backend": auto_backend, "sdpa_fwd": sdpa_fwd,
            "sdpa_fwd_bwd": sdpa_fwd_bwd, "sdpa_grads": [qt, kt, vt], f"rel_err_vs_{reference}": err,
            "ours_bwd": lambda: kern.backward(do, q, k, v, o, lse, causal=causal, scale=scale)}


def bench_shape(kern, bench, ceil: dict | None, n: int, h: int, hk: int, d: int, causal: bool,
                device) -> dict:
    """One row: ours, SDPA cuDNN and SDPA flash (GPU only), forward and forward+backward, at one shape; for
    GQA heads also cuDNN given keys/values repeated to every query head (``cudnn_expanded``)."""
    from torch.nn.attention import SDPBackend

    fns = kernel_fns(kern, n, h, hk, d, causal, device)
    row = {"seq": n, "heads": h, "kv_heads": hk, "head_dim": d, "causal": causal,
           "auto_backend": fns["auto_backend"],
           **{key: value for key, value in fns.items() if key.startswith("rel_err_vs_")}}
    row["ours_bwd_only_ms"] = bench(fns.pop("ours_bwd"))  # frees the forward's out and lse
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    for mode in ("fwd", "fwd_bwd"):
        sdpa = fns[f"sdpa_{mode}"]
        ms = {"ours": bench(fns[f"ours_{mode}"])}
        ms.update({impl: bench(lambda be=be: sdpa(be), fns["sdpa_grads"]) if device.type == "cuda" else None
                   for impl, be in backends.items()})
        if h != hk and device.type == "cuda":
            ms["cudnn_expanded"] = bench(lambda: sdpa(backends["cudnn"], True), fns["sdpa_grads"])
        ms["auto"] = bench(fns[f"auto_{mode}"])
        fl = attention_flops(1, h, n, d, causal=causal, with_bwd=mode == "fwd_bwd")
        row[mode] = {impl: None if t is None else {"ms": t, "tflops": fl / t / 1e9} for impl, t in ms.items()}
        for impl in (i for i in ms if i != "ours"):
            row[mode][f"{impl}_over_ours"] = (
                None if ms[impl] is None or ms["ours"] is None else ms[impl] / ms["ours"]
            )
        row[mode]["floor_ms_matmul"] = fl / ceil["matmul_bf16_8192_tflops"] / 1e9 if ceil else None
        fastest = min((ms[impl] for impl in REGISTERED if ms.get(impl) is not None), default=None)
        row[mode]["auto_vs_fastest"] = ms["auto"] / fastest if ms["auto"] and fastest else None
    return row


def gpu_timer(args, torch):
    """``bench(fn, grad_to_none)``: do_bench's median ms, None when the call fails (and says why)."""
    from triton.testing import do_bench

    def bench(fn, grad_to_none=None):
        try:
            return do_bench(
                fn, warmup=args.warmup, rep=args.rep, grad_to_none=grad_to_none, return_mode="median"
            )
        except Exception as e:  # an SDPA backend may refuse a shape (e.g. GQA on cuDNN)
            print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            torch.cuda.synchronize()
            return None

    return bench


def cpu_timer(device):
    """``bench(fn, grad_to_none)`` on the CPU: the host clock's median of 2 runs after one warm-up."""
    def bench(fn, grad_to_none=None):
        def run():
            fn()
            for t in grad_to_none or ():
                t.grad = None
        return timed(run, 2, device, collective=False)

    return bench


def head_layouts(spec: str, n: int) -> list[tuple[int, int]]:
    """``auto``: 32/32 and 32/8 (8/8 and 8/2 from 64K tokens); else ``H/HK,...``."""
    if spec != "auto":
        return [tuple(int(x) for x in pair.split("/")) for pair in spec.split(",")]
    return [(8, 8), (8, 2)] if n >= 65536 else [(32, 32), (32, 8)]


def run(args) -> dict:
    import torch

    from lightseq_hf.kernels import triton_attn

    device = torch.device(args.device)
    kern = triton_attn.TritonKernel()
    dev_name = device_name(device)
    ceil, bench = None, cpu_timer(device)
    if device.type == "cuda":
        from triton.testing import do_bench

        ceil, bench = measure_ceilings(torch, do_bench), gpu_timer(args, torch)
        print(f"device {dev_name}: matmul {ceil['matmul_bf16_8192_tflops']:.0f} TFLOP/s, "
              f"copy {ceil['copy_bandwidth_tbps']:.2f} TB/s", flush=True)

    rows = []
    t_start = time.time()
    for n in args.seqs:
        for h, hk in head_layouts(args.heads, n):
            for d in args.head_dims:
                for causal in (True, False):
                    rows.append(bench_shape(kern, bench, ceil, n, h, hk, d, causal, device))
                    if args.partial:  # survive a time limit: keep what is measured so far
                        Path(args.partial).write_text(json.dumps({"rows": rows, "ceilings": ceil}, indent=1))
                    print(fmt_row(rows[-1]), f"[{time.time() - t_start:.0f}s]", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()

    return {
        "device": dev_name,
        "date": today(),
        "versions": {package: version(package) for package in ("torch", "triton", "cuda", "cudnn")},
        "config": {
            "dtype": "bfloat16" if device.type == "cuda" else "float32",
            "batch": 1,
            "warmup_ms": args.warmup,
            "rep_ms": args.rep,
            "timing": "triton.testing.do_bench median" if device.type == "cuda" else
                      "host clock, median of 2 after one warm-up (Triton's interpreter)",
            "flops": "causal fwd 2*B*H*N^2*D, non-causal 4*B*H*N^2*D, fwd+bwd 3.5x fwd",
        },
        "ceilings": ceil,
        "rows": rows,
        "summary": summarize(rows),
        "resources": resource_report(),
    }


def summarize(rows: list[dict]) -> dict:
    def ratio(r, mode, impl):
        return r[mode].get(f"{impl}_over_ours")

    causal128 = [r for r in rows if r["causal"] and r["head_dim"] == 128]
    flash_fb = [ratio(r, "fwd_bwd", "flash") for r in causal128 if ratio(r, "fwd_bwd", "flash") is not None]
    at16k = [r for r in causal128 if r["seq"] == 16384 and r["heads"] == 32 and r["kv_heads"] == 32]
    s = {
        "fwd_bwd_vs_sdpa_flash_min": min(flash_fb) if flash_fb else None,
        "fwd_bwd_vs_cudnn_16k": ratio(at16k[0], "fwd_bwd", "cudnn") if at16k else None,
        "fwd_vs_cudnn_16k": ratio(at16k[0], "fwd", "cudnn") if at16k else None,
    }
    cud_fb = [ratio(r, "fwd_bwd", "cudnn") for r in causal128 if r["seq"] >= 16384]
    cud_f = [ratio(r, "fwd", "cudnn") for r in causal128]
    s["fwd_bwd_vs_cudnn_min_16k_up"] = min([x for x in cud_fb if x is not None], default=None)
    s["fwd_vs_cudnn_min"] = min([x for x in cud_f if x is not None], default=None)
    auto = [r["fwd_bwd"].get("auto_vs_fastest") for r in rows]
    s["auto_vs_fastest_max"] = max([x for x in auto if x is not None], default=None)
    s["auto_backends"] = sorted({r["auto_backend"] for r in rows})
    s["gqa_fwd_bwd_cudnn_expanded_over_native"] = [
        {"seq": r["seq"], "heads": f"{r['heads']}/{r['kv_heads']}", "head_dim": r["head_dim"],
         "causal": r["causal"], "ratio": r["fwd_bwd"]["cudnn_expanded"]["ms"] / r["fwd_bwd"]["cudnn"]["ms"]}
        for r in rows if (r["fwd_bwd"].get("cudnn_expanded") or {}).get("ms") and r["fwd_bwd"]["cudnn"]]
    return s


def resource_report() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of our kernels."""
    from lightseq_hf._testing.kernel_knobs import AUTOTUNED, triton_kernels

    out = []
    kernels = triton_kernels()
    for name, at in ((name, kernels[name]) for name in AUTOTUNED):
        best = {str(k): str(v) for k, v in getattr(at, "cache", {}).items()}
        jit = at.fn
        caches = getattr(jit, "device_caches", {}) or {}
        for dev_cache in caches.values():
            kcache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for ck in kcache.values():
                md = ck.metadata
                out.append(
                    {
                        "kernel": name,
                        "n_regs": getattr(ck, "n_regs", None),
                        "n_spills": getattr(ck, "n_spills", None),
                        "shared_bytes": getattr(md, "shared", None),
                        "num_warps": getattr(md, "num_warps", None),
                        "num_stages": getattr(md, "num_stages", None),
                    }
                )
        out.append({"kernel": name, "autotune_choices": best})
    return out


def fmt_row(r: dict) -> str:
    def part(mode):
        m = r[mode]
        t = " ".join(f"{impl}={m[impl]['tflops']:6.1f}" if m.get(impl) else f"{impl}=   n/a"
                     for impl in IMPLS)
        c = m.get("cudnn_over_ours")
        f = m.get("flash_over_ours")
        return f"{t} cudnn/ours={c:.2f} flash/ours={f:.2f}" if c and f else t

    return (
        f"{r['seq'] // 1024:>3}K {r['heads']:>2}/{r['kv_heads']:<2} d{r['head_dim']:<3} "
        f"{'causal' if r['causal'] else 'full  '} | fwd {part('fwd')} | fwd+bwd {part('fwd_bwd')}"
    )


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    for i, mode in enumerate(("fwd", "fwd_bwd")):
        for j, causal in enumerate((True, False)):
            ax = axes[i][j]
            for impl, color in zip(IMPLS, ("C0", "C1", "C2", "C3")):
                for d, gqa, style in ((128, False, "-"), (128, True, "--"), (64, False, ":")):
                    pts = [
                        (r["seq"], r[mode][impl]["tflops"])
                        for r in res["rows"]
                        if r["causal"] == causal
                        and r["head_dim"] == d
                        and (r["heads"] != r["kv_heads"]) == gqa
                        and r[mode].get(impl)
                    ]
                    draw_lines(ax, {f"{impl} d{d}{' GQA' if gqa else ''}": pts}, style, color=color, ms=3)
            ax.set_xscale("log", base=2)
            ax.set_title(
                f"{'forward' if mode == 'fwd' else 'forward+backward'}, "
                f"{'causal' if causal else 'non-causal'}"
            )
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[1][0].set_xlabel("sequence length")
    axes[1][1].set_xlabel("sequence length")
    axes[0][0].legend(fontsize=7, ncol=3)
    ceil = res["ceilings"]
    fig.suptitle(f"{res['device']} {res['config']['dtype']}, batch 1 ({res['date']})"
                 + (f"; matmul {ceil['matmul_bf16_8192_tflops']:.0f} TFLOP/s" if ceil else ""))
    save(fig, path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> Path | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"))
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    p.add_argument("--heads", default="auto",
                   help="query/kv heads H/HK,... (auto: 32/32,32/8; 8/8,8/2 from 64K)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the smoke run in Triton's interpreter (TRITON_INTERPRET=1)")
    p.add_argument("--warmup", type=float, default=10.0, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=60.0, help="do_bench repetitions, ms")
    p.add_argument("--partial", default=None, help="rewrite this JSON file after every row")
    p.add_argument("--plot-from", default=None, help="redraw the plot from this JSON and exit")
    args = p.parse_args(argv)
    if args.plot_from:
        src = Path(args.plot_from)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        return None
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the Triton kernels in Triton's interpreter: "
                         "set TRITON_INTERPRET=1")
    res = run(args)
    slug = device_slug(res["device"], short=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels-{slug}-{res['date']}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    try:
        plot(res, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: run --plot-from on another machine")
    print("\nseq heads dim mask | TFLOP/s fwd (ours cudnn flash) | fwd+bwd")
    for r in res["rows"]:
        print(fmt_row(r))
    print("summary:", json.dumps(res["summary"]))
    print("ceilings:", json.dumps(res["ceilings"]))
    return path


if __name__ == "__main__":
    main()
