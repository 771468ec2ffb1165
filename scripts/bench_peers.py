"""Training step of ours against the strongest peers, in the same run, on the same model shapes, tokens,
data and dtype: ALST (DeepSpeed Ulysses + ZeRO-3 + tiling + offload, ``benchlib/alst.py``) and torch
context parallel (FSDP2, the chunked loss), each variant in its own launch of ``bench_train.py --rung``
(a fresh process and allocator for each; the AdamW state allocated before the first step; ``--steps``
steps, the first a warm-up).

    python scripts/bench_peers.py run   --models 8b,7b --seqs 131072 --variants remat,alst,torch_cp --out DIR
    python scripts/bench_peers.py start ... --out DIR      # the same, detached (log: DIR/peers.log)
    python scripts/bench_peers.py poll  --out DIR [--wait S]

A variant is ``bench_train.py``'s (``remat``, ``remat+tiled``, ``alst+tiled+offload``, ``torch_cp+offload``
...); its base names the implementation (``remat``/``hf``: ours). ALST's refusals (a head count the SP size
does not divide) are rows too. Results: ``DIR/peers-<device>-x<P>-<date>.json`` with a ``summary``:
per model and length each implementation's fastest variant, ``vs_alst`` and ``vs_torch_cp`` (the peer's
step time over ours). ``--device cpu`` runs the tiny model on CPU processes as a smoke test (torch
context parallel needs GPUs and is left out there). Installing the peers: ``scripts/install_peers.sh``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from benchlib.alst import RECIPE  # noqa: E402
from benchlib.results import device_slug, today  # noqa: E402
from benchlib.rungs import alive, bench_train_command, detach, nvidia_smi, run_launch  # noqa: E402

IMPLS = {"remat": "ours", "hf": "ours", "alst": "alst", "torch_cp": "torch_cp"}
LOG, STATE = "peers.log", "peers-state.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("run", "start", "poll"))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--models", default="8b", help="comma-separated model shapes (benchlib/workloads.py)")
    p.add_argument("--seqs", default="131072", help="comma-separated total tokens per sequence")
    p.add_argument("--variants", default="remat,alst,torch_cp", help="comma-separated bench_train variants")
    p.add_argument("--steps", type=int, default=4, help="steps per launch; the first is a warm-up")
    p.add_argument("--gpus", type=int, default=None, help="processes per launch (default: all GPUs)")
    p.add_argument("--limit-s", type=float, default=900.0, help="time limit of one launch")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--wait", type=float, default=0.0, help="poll: wait up to S seconds for the end")
    return p.parse_args(argv)


def impl_of(variant: str) -> str:
    base = variant.split("+")[0]
    if base not in IMPLS:
        raise SystemExit(f"unknown variant {variant!r}: its base is one of {sorted(IMPLS)}")
    return IMPLS[base]


def summarize(rows: list[dict]) -> dict:
    """Per model and length: each implementation's fastest variant (step, tokens/s, MFU, peaks) and the
    ratios ``vs_alst`` / ``vs_torch_cp`` (the peer's step time over ours; None where one did not train)."""
    per_model: dict = {}
    for row in rows:
        per_model.setdefault(row["model"], {}).setdefault(str(row["seq"]), []).append(row)
    out: dict = {"vs_alst": {}, "vs_torch_cp": {}, "per_model": {}}
    for model, by_seq in per_model.items():
        for seq, found in by_seq.items():
            best = {}
            for impl in ("ours", "alst", "torch_cp"):
                ok = [r for r in found if r["impl"] == impl and "step_s" in r]
                if ok:
                    top = min(ok, key=lambda r: r["step_s"])
                    keys = ("variant", "step_s", "tokens_per_s", "mfu", "peak_gib", "host_peak_gib")
                    best[impl] = {k: top.get(k) for k in keys}
                else:
                    ended = [r.get("refused") or r.get("error") for r in found if r["impl"] == impl]
                    best[impl] = {"not_trained": str(ended[0])[:300] if ended else "not run"}
            ours = best["ours"].get("step_s")
            for impl in ("alst", "torch_cp"):
                peer = best[impl].get("step_s")
                out[f"vs_{impl}"].setdefault(model, {})[seq] = peer / ours if ours and peer else None
            out["per_model"].setdefault(model, {})[seq] = best
    return out


def machine(args: argparse.Namespace) -> dict:
    cards = [] if args.device == "cpu" else [c[0] for c in nvidia_smi("gpu=name")]
    if args.device == "cuda" and not cards:
        raise SystemExit("no GPU found by nvidia-smi: run on GPUs, or pass --device cpu")
    world = args.gpus or len(cards) or 2
    return {"device": cards[0] if cards else "cpu", "cards": cards[:world], "world": world}


def results_path(args: argparse.Namespace, m: dict) -> Path:
    slug = "cpu" if m["device"] == "cpu" else device_slug(m["device"], short=True)
    return Path(args.out) / f"peers-{slug}-x{m['world']}-{today()}.json"


def run(args: argparse.Namespace) -> Path:
    """Every model, length and variant in turn, the results file rewritten after each launch."""
    out = Path(args.out)
    (out / "peers-rungs").mkdir(parents=True, exist_ok=True)
    m = machine(args)
    path = results_path(args, m)
    doc = json.loads(path.read_text()) if path.exists() else {}
    rows = doc.get("rows", [])
    meta = {"kind": "peers", "device": m["device"], "cards": m["cards"], "world": m["world"], "date": today(),
            "alst_recipe": RECIPE,
            "notes": "each row one launch of bench_train.py --rung: --steps steps (the first a warm-up; "
                     "step_s the median of the others on the slowest rank), the AdamW state allocated "
                     "first, bf16 compute, one random row of the length's tokens (the same ids for every "
                     "implementation), every GPU in one sequence-parallel group; ours and torch CP under "
                     "FSDP2, ALST under ZeRO-3 (its configuration in each row's peer_config)"}
    variants = args.variants.split(",")
    for model in args.models.split(","):
        for n in (int(s) for s in args.seqs.split(",")):
            for variant in variants:
                stem = f"{model}-{n}-{variant}"
                row_out, log = out / "peers-rungs" / f"{stem}.json", out / "peers-rungs" / f"{stem}.log"
                print(f"[{time.strftime('%H:%M:%S')}] {stem}", flush=True)
                command = bench_train_command(m["world"], model, n, variant, args.steps, row_out)
                found = run_launch(command, row_out, log, args.limit_s, args.device)
                row = {"seq": n, "variant": variant, **found["row"], "model": model, "impl": impl_of(variant),
                       "wall_s": found["wall_s"], "log": str(log.relative_to(out))}
                for key in ("torch", "transformers", "deepspeed", "cudnn", "nccl", "alloc_conf"):
                    if found["meta"] and found["meta"].get(key) is not None:
                        meta.setdefault(key, found["meta"][key])
                rows.append(row)
                doc.update(meta, rows=rows, summary=summarize(rows))
                path.write_text(json.dumps(doc, indent=1))
                shown = {k: v for k, v in row.items() if k not in ("memory_breakdown", "peer_config")}
                print(json.dumps(shown)[:500], flush=True)
    print(json.dumps(summarize(rows), indent=1), flush=True)
    return path


def start(args: argparse.Namespace, argv: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pid = detach([sys.executable, str(Path(__file__).resolve()), "run", *argv[1:]], out / LOG)
    (out / STATE).write_text(json.dumps({"pid": pid, "started": time.time()}))
    print(f"started: pid {pid}, log {out / LOG}", flush=True)


def poll(args: argparse.Namespace) -> int:
    """Print the log's end; 0 when the run has ended, 3 while it runs, 1 when there is none."""
    out = Path(args.out)
    if not (out / STATE).exists():
        print(f"no run in {out}")
        return 1
    pid = json.loads((out / STATE).read_text())["pid"]
    deadline = time.monotonic() + args.wait
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(5)
    print("\n".join((out / LOG).read_text(errors="replace").splitlines()[-40:]))
    return 3 if alive(pid) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    for variant in args.variants.split(","):
        impl_of(variant)
    if args.mode == "poll":
        return poll(args)
    if args.mode == "start":
        start(args, argv)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
