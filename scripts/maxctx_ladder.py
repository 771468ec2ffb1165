"""The longest context per model: ours with the planner's options against torch context parallel at its
best, rung by rung, each rung a full optimizer step (forward, backward, AdamW with its state) in its own
launch under its own time limit.

    python scripts/maxctx_ladder.py plan  --gpus 4 --host-gib 512 --models 8b --budget-min 15
    python scripts/maxctx_ladder.py start --gpus 4 --host-gib 512 --models 8b --budget-min 15 --out DIR
    python scripts/maxctx_ladder.py poll  --out DIR [--wait 540]

``plan`` prints each ladder's variant, the planner's longest context, the first rung and its estimated
minutes, and runs nothing. ``start`` runs the ladders detached (setsid, output in
``DIR/maxctx-ladder.log``) and returns at once; ``poll`` prints their progress (``--wait S``: until they end
or S seconds pass). ``run`` is what ``start`` detaches (the same in the foreground).

Ours starts at the planner's longest context for the variant that reaches furthest within a rung's time
(``benchlib/ladder.py``); torch context parallel (chunked loss, Transformers' checkpoint offload,
expandable segments, and FSDP2's CPU optimizer when ours uses it) at the planner's estimate for its
options. Each next length comes from the previous rungs (climb from the measured bytes per token, step
down after a failure, bisect to 1/8). Rungs run round by round over the ladders, each only if its estimated
time fits what is left of ``--budget-min``; a rung that fails (out of memory, its time limit, a crash) is
recorded and the ladder goes on from it. A rung's time limit is 1.5x its estimate plus a minute.

The host's memory comes from ``--host-gib`` (the machine's total, split over the ranks), not from
``/proc/meminfo``: some machines show a small MemTotal at start that grows later. Results:
``DIR/maxctx-<device>-x<P>-<date>.json``, rows as ``bench_train.py --rung`` measured them and a
``summary`` (``benchlib.ladder.summarize``). ``--device cpu`` runs the same on CPU processes (the tiny
model; torch context parallel is skipped there) as a smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from benchlib.alst import unavailable as alst_unavailable  # noqa: E402
from benchlib.ladder import (  # noqa: E402
    MODEL_NAMES,
    OURS_VARIANTS,
    Ladder,
    alst_start,
    choose_ours,
    estimate_seconds,
    summarize,
    torch_cp_start,
    with_budget_share,
)
from benchlib.results import device_slug, today  # noqa: E402
from benchlib.rungs import alive, bench_train_command, detach, nvidia_smi, run_launch  # noqa: E402
from benchlib.workloads import SHAPES  # noqa: E402

STATE = "maxctx-ladder-state.json"
LOG = "maxctx-ladder.log"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("plan", "start", "run", "poll"))
    p.add_argument("--out", default="benchmarks/results", help="results, state and logs")
    p.add_argument("--gpus", type=int, default=None, help="processes (GPUs) per rung (default: all GPUs)")
    p.add_argument("--host-gib", type=float, default=None,
                   help="the host's memory in GiB (all ranks together); required but for poll")
    p.add_argument("--gpu-gib", type=float, default=None, help="one card's memory (default: nvidia-smi)")
    p.add_argument("--models", default="8b,7b", help="comma-separated: 8b (Llama-3.1-8B), 7b (Llama-2-7B)")
    p.add_argument("--budget-min", type=float, default=15.0, help="the ladders' total time (rungs start "
                   "only while their estimate fits what is left)")
    p.add_argument("--rung-min", type=float, default=None,
                   help="the longest a first rung may be estimated to take (default: budget / ladders)")
    p.add_argument("--tflops", type=float, default=400.0, help="per GPU, for the time estimates")
    p.add_argument("--unit", type=int, default=8192, help="lengths are multiples of this (and of --gpus)")
    p.add_argument("--tile", type=int, default=8192, help="tokens per tile of ours' tiled MLP")
    p.add_argument("--ours-variants", default=",".join(OURS_VARIANTS),
                   help="the variants the planner chooses among for ours")
    p.add_argument("--max-rungs", type=int, default=4, help="per ladder")
    p.add_argument("--first-rung", action="append", default=[], metavar="IMPL=TOKENS",
                   help="start IMPL's ladders (ours, torch_cp) at TOKENS instead of the planner's length, "
                        "e.g. torch_cp just past the planner's longest to find where it fails first")
    p.add_argument("--impls", default="ours,torch_cp,alst",
                   help="ours and torch_cp always; alst (benchlib/alst.py) when listed and installed")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--wait", type=float, default=0.0, help="poll: wait up to S seconds for the end")
    args = p.parse_args(argv)
    try:
        args.first_rungs = {impl: int(n) for impl, n in (item.split("=") for item in args.first_rung)}
    except ValueError:
        p.error("--first-rung takes IMPL=TOKENS, e.g. --first-rung torch_cp=344064")
    if set(args.first_rungs) - {"ours", "torch_cp", "alst"}:
        p.error(f"--first-rung: unknown implementation in {args.first_rung}; use ours, torch_cp or alst")
    if args.mode != "poll" and args.host_gib is None:
        p.error("--host-gib is required: the host's memory in GiB (e.g. 512 for a machine of 4 GPUs)")
    return args


# ----------------------------------------------------------------------------- the machine


def machine(args: argparse.Namespace) -> dict:
    """The cards (names and GiB, from nvidia-smi), the world of a rung and the per-rank budgets."""
    cards = [] if args.device == "cpu" else nvidia_smi("gpu=name,memory.total")
    world = args.gpus or len(cards) or 1
    gpu_gib = args.gpu_gib or (float(cards[0][1]) / 1024 if cards else None)
    if gpu_gib is None:
        raise SystemExit("no GPU found by nvidia-smi: pass --gpu-gib (or --device cpu)")
    name = cards[0][0] if cards else "cpu"
    gpu_bytes, host_bytes = with_budget_share(gpu_gib, args.host_gib, world)
    return {"device": name, "cards": [c[0] for c in cards[:world]], "world": world, "gpu_gib": gpu_gib,
            "host_gib": args.host_gib, "gpu_budget_bytes": gpu_bytes, "host_budget_bytes": host_bytes}


def make_ladders(args: argparse.Namespace, m: dict) -> list[Ladder]:
    """Ours, torch context parallel and (``--impls``) ALST for each model, their variants and first rungs from
    the planner."""
    models = args.models.split(",")
    rung_s = 60 * (args.rung_min or args.budget_min / (2 * len(models)))
    world, gpu, host = m["world"], m["gpu_budget_bytes"], m["host_budget_bytes"]
    unit = args.unit * world // math.gcd(args.unit, world)
    ladders = []
    for model in models:
        shape = SHAPES[model]
        ours = choose_ours(shape, world, gpu, host, unit, rung_s, args.ours_variants.split(","),
                           args.tflops, args.tile)
        cp = torch_cp_start(shape, world, gpu, host, unit, rung_s, "cpuadam" in ours["variant"], args.tflops)
        first = args.first_rungs
        ladders.append(Ladder(model, "ours", ours["variant"], ours["planned_max"],
                              first.get("ours", ours["start"]), unit))
        ladder = Ladder(model, "torch_cp", cp["variant"], cp["planned_max"],
                        first.get("torch_cp", cp["start"]), unit)
        if args.device == "cpu":
            ladder.stopped = "skipped: torch context parallel shards only the GPU SDPA kernels"
        ladders.append(ladder)
        if "alst" in args.impls:
            peer = alst_start(shape, world, gpu, host, unit, rung_s, args.tflops)
            start = first.get("alst", peer["start"])
            ladder = Ladder(model, "alst", peer["variant"], peer["planned_max"], start, unit)
            ladder.stopped = alst_unavailable() and f"skipped: {alst_unavailable()}"
            ladders.append(ladder)
    return ladders


def plan_lines(args: argparse.Namespace, m: dict, ladders: list[Ladder]) -> list[str]:
    lines = [f"{m['world']} x {m['device']} ({m['gpu_gib']:.0f} GiB), host {m['host_gib']:.0f} GiB: "
             f"budgets per rank {m['gpu_budget_bytes'] / 2**30:.1f} GiB device, "
             f"{m['host_budget_bytes'] / 2**30:.1f} GiB host; estimates at {args.tflops:.0f} TFLOP/s per "
             f"GPU; total budget {args.budget_min:.0f} min"]
    for ladder in ladders:
        est = estimate_seconds(ladder.variant, SHAPES[ladder.model], ladder.start, m["world"], args.tflops)
        name = MODEL_NAMES.get(ladder.model, ladder.model)
        lines.append(f"  {name:<14} {ladder.impl:<8} {ladder.variant:<32}"
                     f" planner's longest {ladder.planned_max // 1024}K, first rung {ladder.start // 1024}K: "
                     f"about {est['total_s'] / 60:.1f} min ({est['setup_s'] / 60:.1f} set-up, "
                     f"{est['step_s'] / 60:.1f} step)" + (f" [{ladder.stopped}]" if ladder.stopped else ""))
    return lines


# ----------------------------------------------------------------------------- one rung


def rung_command(args: argparse.Namespace, m: dict, ladder: Ladder, n: int, row_out: Path) -> list[str]:
    budgets = ("--gpu-budget-gib", f"{m['gpu_budget_bytes'] / 2**30:.3f}",
               "--host-budget-gib", f"{m['host_budget_bytes'] / 2**30:.3f}")
    return bench_train_command(m["world"], ladder.model, n, ladder.variant, 1, row_out,
                               "--tile", str(args.tile), *budgets)


def time_limit(estimate: dict) -> float:
    """A rung's time limit: 1.5x its estimate and a minute (set-up varies, the estimate is rough)."""
    return 1.5 * estimate["total_s"] + 60


def run_rung(args: argparse.Namespace, m: dict, ladder: Ladder, n: int, estimate: dict,
             limit: float | None = None) -> dict:
    """Launch one rung under its time limit; ``{"row", "meta"}``: bench_train's row and metadata, or a
    failed rank's row, or a row saying how the launch ended (its time limit, its exit status)."""
    out = Path(args.out) / "maxctx-rungs"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{ladder.model}-{ladder.impl}-{n}"
    row_out, log = out / f"{stem}.json", out / f"{stem}.log"
    limit = time_limit(estimate) if limit is None else limit
    found = run_launch(rung_command(args, m, ladder, n, row_out), row_out, log, limit, args.device)
    row = {"seq": n, "variant": ladder.variant, "search": True, **found["row"]}
    row.update(model=ladder.model, impl=ladder.impl, wall_s=found["wall_s"], estimated_s=estimate["total_s"],
               time_limit_s=limit, log=str(log.relative_to(Path(args.out))))
    return {"row": row, "meta": found["meta"]}


# ----------------------------------------------------------------------------- the ladders


def results_file(args: argparse.Namespace, m: dict) -> tuple[Path, list[dict], dict]:
    """``OUT/maxctx-<device>-x<P>-<date>.json``, with the rows and ladders of a ladder run that wrote it
    earlier the same day (another model, say), which this run adds to; ``-ladder`` is appended to the
    name when a file of another kind has it."""
    slug = "cpu" if m["device"] == "cpu" else device_slug(m["device"], short=True)
    path = Path(args.out) / f"maxctx-{slug}-x{m['world']}-{today()}.json"
    if not path.exists():
        return path, [], {}
    doc = json.loads(path.read_text())
    if doc.get("kind") != "maxctx-ladder":
        return path.with_name(f"{path.stem}-ladder.json"), [], {}
    return path, doc["rows"], doc.get("ladders", {})


class Run:
    """The results file and the state file of a ladder run, rewritten after every rung."""

    def __init__(self, args: argparse.Namespace, m: dict, ladders: list[Ladder]) -> None:
        self.args, self.m, self.ladders = args, m, ladders
        self.path, self.rows, self.earlier_ladders = results_file(args, m)
        models = {r["model"] for r in self.rows} | set(args.models.split(","))
        self.meta = {"kind": "maxctx-ladder", "device": m["device"], "cards": m["cards"], "world": m["world"],
                     "date": today(), "gpu_gib": m["gpu_gib"], "host_gib": m["host_gib"],
                     "budget_per_rank_gib": {"gpu": m["gpu_budget_bytes"] / 2**30,
                                             "host": m["host_budget_bytes"] / 2**30},
                     "budget_min": args.budget_min, "tflops_estimate": args.tflops,
                     "models": {k: MODEL_NAMES.get(k, k) for k in sorted(models)},
                     "notes": "each rung one launch of bench_train.py --rung: one full optimizer step "
                              "(forward, backward, AdamW with its state allocated first), FSDP2 over every "
                              "GPU, sequence parallel over every GPU, bf16 compute, fp32 master weights; "
                              "device bytes per token: the phase peak above the weights, gradients and "
                              "optimizer state; host: the step's peak resident memory above its start"}
        self.state = {"status": "running", "pid": os.getpid(), "started": time.time(),
                      "results": str(self.path),
                      "budget_s": 60 * args.budget_min, "used_s": 0.0, "current": None,
                      "plan": plan_lines(args, m, ladders)}

    def ladders_meta(self) -> dict:
        out: dict = {model: dict(v) for model, v in self.earlier_ladders.items()}
        for ladder in self.ladders:
            out.setdefault(ladder.model, {})[ladder.impl] = {
                "variant": ladder.variant, "planned_max": ladder.planned_max, "first_rung": ladder.start,
                "stopped": ladder.stopped}
        return out

    def write(self) -> None:
        ladders = self.ladders_meta()
        doc = {**self.meta, "ladders": ladders, "rows": self.rows, "summary": summarize(self.rows, ladders)}
        self.path.write_text(json.dumps(doc, indent=1))
        (Path(self.args.out) / STATE).write_text(json.dumps(self.state, indent=1))

    def record(self, found: dict) -> None:
        if found["meta"]:
            for key in ("torch", "transformers", "alloc_conf", "alloc_conf_set_by", "backend"):
                self.meta.setdefault(key, found["meta"].get(key))
        self.rows.append(found["row"])
        self.write()


def _climb_once(args: argparse.Namespace, m: dict, run_state: Run, ladder: Ladder, rungs: dict) -> bool:
    """The ladder's next rung, if it has one within the budget; whether a rung ran."""
    n = ladder.next_length(m["gpu_budget_bytes"], m["host_budget_bytes"], m["world"])
    if n is None:
        return False
    if rungs[id(ladder)] >= args.max_rungs:
        ladder.stopped = f"--max-rungs {args.max_rungs} reached"
        return False
    est = estimate_seconds(ladder.variant, SHAPES[ladder.model], n, m["world"], args.tflops)
    state = run_state.state
    left = state["budget_s"] - state["used_s"]
    if est["total_s"] > left:
        ladder.stopped = (f"time budget: the next rung ({n}) would take about "
                          f"{est['total_s'] / 60:.1f} min, {left / 60:.1f} min left")
        return False
    state["current"] = {"model": ladder.model, "impl": ladder.impl, "variant": ladder.variant, "seq": n,
                        "since": time.time(), "estimated_s": est["total_s"]}
    run_state.write()
    print(f"[{datetime.datetime.now():%H:%M:%S}] {ladder.model} {ladder.impl} {ladder.variant} at {n}: "
          f"about {est['total_s'] / 60:.1f} min", flush=True)
    found = run_rung(args, m, ladder, n, est)
    ladder.rows.append(found["row"])
    rungs[id(ladder)] += 1
    state["used_s"] += found["row"]["wall_s"]
    state["current"] = None
    run_state.record(found)
    shown = {k: v for k, v in found["row"].items() if k != "memory_breakdown"}
    print(json.dumps(shown)[:600], flush=True)
    return True


def run(args: argparse.Namespace) -> None:
    """Every ladder, round by round, until none has a rung left within the budget."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    m = machine(args)
    ladders = make_ladders(args, m)
    run_state = Run(args, m, ladders)
    print("\n".join(run_state.state["plan"]), flush=True)
    for ladder in ladders:
        if ladder.stopped:  # recorded, so that the results say why this implementation has no rung
            row = {"model": ladder.model, "impl": ladder.impl, "variant": ladder.variant, "seq": ladder.start,
                   "skipped": ladder.stopped}
            ladder.rows.append(row)
            run_state.rows.append(row)
    run_state.write()
    rungs = {id(ladder): 0 for ladder in ladders}
    while any([_climb_once(args, m, run_state, ladder, rungs) for ladder in ladders]):
        pass
    run_state.state["status"] = "done"
    run_state.write()
    print(json.dumps(summarize(run_state.rows, run_state.ladders_meta()), indent=1), flush=True)


# ----------------------------------------------------------------------------- start and poll


def start(args: argparse.Namespace, argv: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / STATE
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if state.get("status") == "running" and alive(state.get("pid")):
            raise SystemExit(f"a ladder is running in {out} (pid {state['pid']}): poll it, or kill it first")
    m = machine(args)
    print("\n".join(plan_lines(args, m, make_ladders(args, m))), flush=True)
    pid = detach([sys.executable, str(Path(__file__).resolve()), "run", *argv[1:]], out / LOG)
    state_file.write_text(json.dumps({"status": "starting", "pid": pid, "started": time.time()}))
    print(f"started: pid {pid}, log {out / LOG}; poll with: python scripts/maxctx_ladder.py poll "
          f"--out {args.out}", flush=True)


def poll(args: argparse.Namespace) -> int:
    """Print the ladders' progress; 0 when they have ended, 3 while they run, 1 when they died."""
    out = Path(args.out)
    deadline = time.monotonic() + args.wait
    while True:
        state = json.loads((out / STATE).read_text()) if (out / STATE).exists() else {}
        running = state.get("status") in ("running", "starting") and alive(state.get("pid"))
        if not running or time.monotonic() >= deadline:
            break
        time.sleep(min(10.0, max(0.5, deadline - time.monotonic())))
    if not state:
        print(f"no ladder in {out}")
        return 1
    results = Path(state["results"]) if state.get("results") else None
    doc = json.loads(results.read_text()) if results and results.exists() else {"rows": [], "summary": {}}
    used = state.get("used_s", 0.0)
    print(f"ladder {state['status']} (pid {state.get('pid')}), {used / 60:.1f} of "
          f"{state.get('budget_s', 0) / 60:.1f} min used; results {results}")
    for row in doc["rows"]:
        what = f"step {row['step_s']:.0f} s" if "step_s" in row else \
            str(row.get("error", row.get("skipped")))[:160]
        print(f"  done: {row['model']} {row['impl']} {row['variant']} {row['seq']}: {what} "
              f"(wall {row.get('wall_s', 0):.0f} s, estimated {row.get('estimated_s', 0):.0f} s)")
    current = state.get("current")
    if current and running:
        print(f"  running: {current['model']} {current['impl']} {current['variant']} {current['seq']}, "
              f"{(time.time() - current['since']) / 60:.1f} min of about {current['estimated_s'] / 60:.1f}")
    summary = {k: v for k, v in doc.get("summary", {}).items() if k not in ("per_model", "step_s_per_rung")}
    print("summary:", json.dumps(summary))
    if running:
        return 3
    if state.get("status") != "done":
        print(f"the ladder process ended without finishing: see {out / LOG}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.mode == "poll":
        return poll(args)
    if args.mode == "plan":
        m = machine(args)
        print("\n".join(plan_lines(args, m, make_ladders(args, m))))
    elif args.mode == "start":
        start(args, argv)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
