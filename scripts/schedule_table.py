"""Print the critical path (in block units) of each causal schedule for P = 2..16."""

from __future__ import annotations

import argparse

from lightseq_hf.parallel.schedule import build_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-world", type=int, default=16)
    args = parser.parse_args()
    print("| P | ring (Alg. 1) | paper (Alg. 2, whole blocks) | ours (balanced) | ideal |")
    print("|---|---|---|---|---|")
    for world in range(2, args.max_world + 1):
        kinds = ("ring", "paper", "balanced")
        paths = [float(build_schedule(world, True, kind).critical_path()) for kind in kinds]
        print(f"| {world} | " + " | ".join(f"{p:g}" for p in paths) + f" | {world / 2:g} |")


if __name__ == "__main__":
    main()
