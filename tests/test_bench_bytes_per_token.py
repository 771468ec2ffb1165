"""scripts/bench_bytes_per_token.py: the measured bytes per token beside the planner's, smoke-run on two
CPU processes (the host's peak only: the CPU has no allocator statistics), and its line fit."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_bytes_per_token", ROOT / "scripts" /
                                                  "bench_bytes_per_token.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_smoke(rank, world, out_dir):
    bench = _load()
    bench.main(["--device", "cpu", "--model", "tiny", "--tokens-per-rank", "48,96", "--warmup-tokens", "16",
                "--tile", "32", "--recompute", "1", "--layers", "3", "--out", out_dir, "--tag", "smoke"])
    return []


def test_smoke_run_on_two_cpu_processes(tmp_path):
    failures = [f for r in run_distributed(worker_smoke, 2, str(tmp_path)) for f in r]
    assert not failures, "\n".join(failures)
    (path,) = tmp_path.glob("bytes-per-token-cpu-x2-*-tiny-smoke.json")
    result = json.loads(path.read_text())
    assert result["world"] == 2 and result["offload"] == {"layers": 3, "recompute": 1}
    assert result["shape"][2] == 3  # --layers: the tiny shape with three decoder layers
    rows = result["rows"]
    assert [r["tokens_per_rank"] for r in rows] == [48, 96] and len(result["rows_per_rank"]) == 2
    assert all(math.isfinite(r["loss"]) and r["host_increase"] > 0 and r["phases"] == {} for r in rows)
    summary = result["summary"]
    planned, measured = summary["planned"], summary["measured"]
    # tiny: hidden 64, one layer under plain recompute (its input), two under remat (input, out, lse)
    assert planned["host"] == 64 * 4 + 2 * (64 * 4 + 64 * 4 + 4 * 4)
    assert planned["backward"] > planned["forward"] > 0
    assert "this layer: layer input" in planned["terms_per_token"]
    assert measured["host"] > 0 and "backward" not in measured  # no CUDA allocator on the CPU
    assert summary["device_bytes_per_token"] is None and summary["host_bytes_per_token"] == measured["host"]


def test_line_fit():
    bench = _load()
    assert bench.fit([1, 2, 3], [5, 7, 9]) == pytest.approx((2.0, 3.0))
    assert bench.fit([10, 20], [100, 300]) == pytest.approx((20.0, -100.0))
