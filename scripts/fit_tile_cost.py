"""Fit the packed schedule's tile cost model to measured per-rank busy times.

Reads ``scripts/replay_packed.py`` results (JSON lines: one per layout and rank, with the tasks that
rank computed and its compute-only forward+backward milliseconds), counts each rank's modeled quantities
with the schedule's own code (:func:`~lightseq_hf.parallel.segment_schedule.block_tiles`): tiles visited,
masked tiles, query-row tiles, tasks, rows computed for another rank and rows of its own merged from
another, and fits ``busy = sum(coefficient * quantity) + common * chunk rows`` by least squares on the
relative error with non-negative coefficients (``common``, the same for every rank of a layout, absorbs
the per-rank fixed work). Prints the fit, its leave-one-layout-out error of each rank's share of its
layout's mean (what balancing needs), and the :class:`TileCost` in forward-tile units::

    python scripts/fit_tile_cost.py benchmarks/results/raw/replay-packed-h200-*-key-spans*.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightseq_hf.parallel.segment_schedule import TileCost, block_tiles  # noqa: E402
from lightseq_hf.parallel.segments import Segments  # noqa: E402

QUANTITIES = ("tiles", "masked", "row_tiles", "tasks", "helper_rows", "owner_rows", "common")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--tile", default="128x128", help="tile_m x tile_n of the model")
    p.add_argument("--backward", type=float, default=4.0,
                   help="backward cost per tile relative to the forward (units only; the fit is of the sum)")
    return p.parse_args(argv)


def rank_quantities(rows: list[dict], tile_m: int, tile_n: int) -> list[dict]:
    """Per (layout, rank): the model's quantities and the measured busy ms."""
    layouts = defaultdict(list)
    for r in rows:
        key = (r["seq"], r["world"], r["layout"], r["heads"], r.get("cost_name"), r.get("repeat"))
        layouts[key].append(r)
    out = []
    for key, ranks in layouts.items():
        first = ranks[0]
        seg = Segments(first["seq"], (tuple(tuple(d) for d in first["docs"]),))
        world = first["world"]
        model, tiles = TileCost(tile_m=tile_m, tile_n=tile_n), {}
        q = [dict.fromkeys(QUANTITIES, 0.0) for _ in range(world)]
        for r in ranks:
            mine = q[r["rank"]]
            mine["common"] = seg.length // world / 1e4
            for i, j, a, b, *_ in r["tasks"]:
                if (i, j) not in tiles:
                    tiles[i, j] = block_tiles(seg, world, True, None, i, j, model)
                visited, masked = tiles[i, j].tile_counts(a, b)
                mine["tiles"] += visited
                mine["masked"] += masked
                mine["row_tiles"] += math.ceil((b - a) / tile_m)
                mine["tasks"] += 1
                if i != r["rank"]:
                    mine["helper_rows"] += b - a
                    q[i]["owner_rows"] += b - a
        for r in ranks:
            out.append({"layout": key, "rank": r["rank"], "busy": r["ms"], **q[r["rank"]]})
    return out


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``x @ c ~ y`` relative to ``y`` with ``c >= 0`` (drop the most negative, refit)."""
    active = list(range(x.shape[1]))
    w = 1 / y
    while True:
        c = np.zeros(x.shape[1])
        c[active] = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)[0]
        if c.min() >= 0:
            return c
        active.remove(int(np.argmin(c)))


def main(argv=None) -> None:
    args = parse_args(argv)
    tile_m, tile_n = (int(v) for v in args.tile.split("x"))
    rows = [json.loads(line) for f in args.files for line in open(f)]
    data = rank_quantities(rows, tile_m, tile_n)
    x = np.array([[d[k] for k in QUANTITIES] for d in data])
    y = np.array([d["busy"] for d in data])
    coef = nonnegative_fit(x, y)
    layouts = sorted({d["layout"] for d in data})
    share_err, rank_err = [], []
    for lay in layouts:  # leave one layout out
        held = np.array([d["layout"] == lay for d in data])
        c = nonnegative_fit(x[~held], y[~held])
        pred, meas = x[held] @ c, y[held]
        rank_err += list(np.abs(pred - meas) / meas)
        share_err += list(np.abs(pred / pred.mean() - meas / meas.mean()))
    print(f"{len(data)} ranks of {len(layouts)} layouts; ms per quantity:")
    for name, c in zip(QUANTITIES, coef):
        print(f"  {name:12s} {c:.6g}")
    print(f"leave-one-layout-out: rank time error mean {np.mean(rank_err):.2%}, max {np.max(rank_err):.2%}; "
          f"share of the layout mean: mean {np.mean(share_err):.2%}, p90 {np.quantile(share_err, 0.9):.2%}, "
          f"max {np.max(share_err):.2%}")
    per_tile = coef[0] / (1 + args.backward)  # ms of one forward tile
    model = TileCost(tile_m=tile_m, tile_n=tile_n, forward=1.0, backward=args.backward,
                     masked=round(coef[1] / per_tile, 3), row_tile=round(coef[2] / per_tile, 3),
                     launch=round(coef[3] / 3 / per_tile, 3), launches=3,
                     helper_row=round(coef[4] / per_tile, 5), owner_row=round(coef[5] / per_tile, 5))
    print(model)


if __name__ == "__main__":
    main()
