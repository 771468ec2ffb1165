"""Print the critical path (in block units) of each causal schedule for P = 2..16; with ``--packed``,
the segment schedule of packed rows (bench_packed.py's length mix): per-rank visible-pair load."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from lightseq_hf.parallel.schedule import build_schedule, build_segment_schedule
from lightseq_hf.parallel.segments import Segments


def packed_table(seqs: list[int], worlds: list[int]) -> None:
    spec = importlib.util.spec_from_file_location("bench_packed", Path(__file__).with_name("bench_packed.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    print("| tokens | docs | P | visible / causal pairs | busiest rank over mean | steps | non-local tasks |")
    print("|---|---|---|---|---|---|---|")
    for seq in seqs:
        docs = bench.lognormal_docs(seq, median=2048, sigma=1.0, max_len=32768, seed=1000 + seq)
        seg = Segments(seq, (docs,))
        for world in worlds:
            sched = build_segment_schedule(world, seg, True, None)
            loads = [float(sched.load(r)) for r in range(world)]
            total = sum(loads)
            helpers = sum(1 for step in sched.steps for r, t in enumerate(step)
                          if t is not None and not t.q_owner == t.kv_owner == r)
            print(f"| {seq // 1024}K | {len(docs)} | {world} | {total / (seq * (seq + 1) // 2):.3f} | "
                  f"{max(loads) / (total / world) - 1:.2%} | {len(sched.steps)} | {helpers} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-world", type=int, default=16)
    parser.add_argument("--packed", action="store_true", help="the segment schedule of packed rows")
    args = parser.parse_args()
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
