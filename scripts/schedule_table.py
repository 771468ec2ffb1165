"""Print the critical path (in block units) of each causal schedule for P = 2..16; with ``--packed``,
the segment schedule of packed rows (bench_packed.py's length mix): per-rank visible-pair and modeled
tile cost; with ``--model-check RESULTS.json``, the cost model against a bench_packed.py run's measured
per-rank busy time (a model check, not a measurement)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout that was never installed

from lightseq_hf.parallel.schedule import Schedule, SpanTask, build_schedule  # noqa: E402
from lightseq_hf.parallel.segment_schedule import (
    DEFAULT_COST,
    PAIRS,
    TileCost,
    build_segment_schedule,
    modeled_loads,
)
from lightseq_hf.parallel.segments import Segments

#: tiles, no fixed costs (what tile counting alone predicts)
TILES_ONLY = TileCost(launch=0.0, row_tile=0.0)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_packed", Path(__file__).with_name("bench_packed.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def spread(loads: list[float]) -> float:
    """Slowest over fastest rank, minus 1 (``busy_spread`` of bench_packed.py)."""
    return max(loads) / min(loads) - 1


def packed_table(seqs: list[int], worlds: list[int]) -> None:
    bench = _bench()
    print("| tokens | docs | P | visible / causal pairs | pairs schedule: pair spread, modeled spread | "
          "model schedule: pair spread, modeled spread | steps | non-local tasks |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in seqs:
        docs = bench.lognormal_docs(seq, median=2048, sigma=1.0, max_len=32768, seed=1000 + seq)
        seg = Segments(seq, (docs,))
        for world in worlds:
            cells = []
            for model in (PAIRS, DEFAULT_COST):
                sched = build_segment_schedule(world, seg, True, None, cost=model)
                pairs = modeled_loads(sched, seg, cost=PAIRS)
                cells.append(f"{spread(pairs):.2%}, {spread(modeled_loads(sched, seg)):.2%}")
            helpers = sum(1 for step in sched.steps for r, t in enumerate(step)
                          if t is not None and not t.q_owner == t.kv_owner == r)
            print(f"| {seq // 1024}K | {len(docs)} | {world} | {sum(pairs) / (seq * (seq + 1) // 2):.3f} | "
                  f"{cells[0]} | {cells[1]} | {len(sched.steps)} | {helpers} |")


def measured_schedule(result: dict, row: dict, seg: Segments) -> tuple[Schedule, str]:
    """The schedule the run computed, as bench_packed.py records it in the results."""
    if "schedule" not in row:
        raise SystemExit("the results hold no schedule (a run before the tile model); rebuild it from the "
                         "commit that ran the benchmark.")
    # files before key spans hold 5 fields per task (the whole key chunk)
    steps = tuple(tuple(None if t is None else SpanTask(*t[:5], t[0] == t[1], *t[5:7]) for t in step)
                  for step in row["schedule"])
    return Schedule(result["world"], True, "segments", steps), "recorded in the results"


def model_check(path: str) -> None:
    """Per rank: measured busy ms against the modeled cost of the same mix and schedule."""
    bench = _bench()
    result = json.loads(Path(path).read_text())
    mix = result["length_mix"]
    for row in result["rows"]:
        if row.get("impl") != "packed_compute_only" or "per_rank_ms" not in row:
            continue
        seq, busy = row["seq"], row["per_rank_ms"]
        docs = bench.lognormal_docs(seq, median=mix["median"], sigma=mix["sigma"], max_len=mix["max"],
                                    seed=1000 + seq)
        assert len(docs) == row["docs"] and max(b - a for a, b in docs) == row["longest_doc"], "mix differs"
        seg = Segments(seq, (docs,))
        sched, how = measured_schedule(result, row, seg)
        print(f"{seq} tokens, {len(docs)} documents, P = {result['world']}, backend "
              f"{row.get('backend', '?')}, schedule {how}:")
        tasks = [[(t.q_owner, t.kv_owner, t.row_start, t.row_stop) for t in (s[r] for s in sched.steps) if t]
                 for r in range(result["world"])]
        print(f"  tasks per rank (q chunk, kv chunk, rows): {tasks}")
        print(f"  measured busy ms {[round(x, 2) for x in busy]}: spread {spread(busy):.2%}")
        models = (("visible pairs", PAIRS), ("tiles only", TILES_ONLY), ("tile model", DEFAULT_COST))
        for name, model in models:
            loads = modeled_loads(sched, seg, cost=model)
            ratio = [x / loads[0] for x in loads]
            print(f"  {name:13s}: {[round(x) for x in loads]} spread {spread(loads):.2%}, rank / rank 0 "
                  f"{[round(x, 4) for x in ratio]} (measured {[round(x / busy[0], 4) for x in busy]})")
        new = build_segment_schedule(result["world"], seg, True, None)
        print(f"  the tile-model schedule: modeled {[round(x) for x in modeled_loads(new, seg)]} spread "
              f"{spread(modeled_loads(new, seg)):.2%} (pairs spread "
              f"{spread(modeled_loads(new, seg, cost=PAIRS)):.2%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-world", type=int, default=16)
    parser.add_argument("--packed", action="store_true", help="the segment schedule of packed rows")
    parser.add_argument("--model-check", metavar="RESULTS_JSON", help="model vs a bench_packed.py run")
    args = parser.parse_args()
    if args.model_check:
        model_check(args.model_check)
        return
    if args.packed:
        packed_table([65536, 131072], [2, 4, 8])
        return
    print("| P | ring (Alg. 1) | paper (Alg. 2, whole blocks) | ours (balanced) | ideal |")
    print("|---|---|---|---|---|")
    for world in range(2, args.max_world + 1):
        kinds = ("ring", "paper", "balanced")
        paths = [float(build_schedule(world, True, kind).critical_path()) for kind in kinds]
        print(f"| {world} | " + " | ".join(f"{p:g}" for p in paths) + f" | {world / 2:g} |")


if __name__ == "__main__":
    main()
