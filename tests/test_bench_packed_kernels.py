"""scripts/bench_packed_kernels.py on the CPU: its ratios and summary, the table's plan, and the
changing-stream mode end to end on the emulated cuDNN frontend ops (graph builds counted from the op's
cache)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from cudnn_fe_emulation import install

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_packed_kernels",
                                                  ROOT / "scripts" / "bench_packed_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(seq, hk, ms, dense_ms, d=128):
    return {"seq": seq, "head_dim": d, "heads": 32, "kv_heads": hk, "dense_cudnn": {"ms": dense_ms},
            "fwd_bwd": {n: {"ms": t} for n, t in ms.items()}}


def test_ratios_and_summary(bench):
    flops, dense_flops = 1.0, 4.0  # the documents hold a quarter of the causal pairs
    times = {"triton": 100.0, "cudnn_fe": 64.0, "cudnn_fe_raw": 60.0, "op": 56.0, "auto": 64.0, "flex": 80.0}
    row = bench.add_ratios(_row(65536, 32, times, 240.0), flops, dense_flops)
    assert row["best_packed"] == "cudnn_fe"  # the raw op, the direct op call and auto: measured, never "best"
    assert row["cudnn_fe_vs_op"] == pytest.approx(64 / 56) and row["auto_vs_fastest"] == 1.0
    assert row["packed_vs_dense_per_flop"] == pytest.approx(64.0 / 60.0)
    assert row["cudnn_fe_vs_dense_per_flop"] == pytest.approx(64.0 / 60.0)
    assert row["cudnn_fe_raw_vs_dense_per_flop"] == pytest.approx(1.0)
    assert row["cudnn_fe_speedup_vs_triton"] == pytest.approx(100 / 64) == row["packed_speedup_vs_triton"]
    gqa = bench.add_ratios(_row(65536, 8, {"triton": 60.0, "cudnn_fe": 40.0}, 200.0), flops, dense_flops)
    short = bench.add_ratios(_row(16384, 32, {"triton": 10.0, "cudnn_fe": 6.0}, 14.0), 1.0, 4.0)
    failed = bench.add_ratios({**_row(65536, 32, {}, 240.0, d=64), "fwd_bwd": {"triton": {"error": "no"}}},
                              flops, dense_flops)
    assert failed["best_packed"] is None and failed["packed_vs_dense_per_flop"] is None
    s = bench.summarize([row, gqa, short, failed])
    assert s["packed_vs_dense_per_flop"] == row["packed_vs_dense_per_flop"]
    assert s["best_packed_64k"] == "cudnn_fe"
    assert s["cudnn_fe_vs_dense_per_flop_by_heads"] == {"32/32": pytest.approx(64 / 60),
                                                        "32/8": pytest.approx(40 / 50)}
    assert set(s["per_row"]) == {"65536/32/32/d128", "65536/32/8/d128", "16384/32/32/d128", "65536/32/32/d64"}
    assert s["per_row"]["65536/32/32/d128"]["cudnn_fe_vs_op"] == pytest.approx(64 / 56)
    assert s["cudnn_fe_vs_op_max"] == pytest.approx(64 / 56)


def test_table_plan_puts_the_summary_rows_first(bench):
    args = bench.parse_args(["--seqs", "16384,65536,131072", "--heads", "32/32,32/8"])
    plan = bench.table_plan(args)
    assert plan[:3] == [(65536, 128, 32, 32), (65536, 128, 32, 8), (65536, 64, 32, 32)]
    assert len(plan) == 7 and {p[3] for p in plan} == {32, 8}


def test_stream_summary(bench):
    def record(world, backend, step_ms, builds):
        return {"world": world, "backend": backend, "steps": len(step_ms), "step_ms": step_ms,
                "builds": builds, "total_ms": sum(step_ms), "useful_flops": 4e12, "seq": 1024, "heads": 2,
                "head_dim": 8, "median_step_ms": sorted(step_ms)[len(step_ms) // 2], "step_flops": [1e12] * 4}

    records = [record(2, "cudnn_fe", [20.0, 10.0, 8.0, 10.0], [3, 1, 0, 1]),
               record(2, "triton", [30.0, 20.0, 16.0, 20.0], [0] * 4)]
    s = bench.stream_summary(records, dense_ms=None)
    entry = s["2"]
    assert entry["builds"] == 5 and entry["builds_per_step_last_half"] == 0.5
    assert entry["speedup_vs_triton"] == pytest.approx(86 / 48)
    assert entry["speedup_vs_triton_last_half"] == 2.0
    assert "vs_dense_per_flop" not in entry and entry["mean_step_ms"] == 12.0
    dense_flops = bench.pair_flops(2, 8, 1024 * 1025 // 2, with_bwd=True)
    entry = bench.stream_summary(records, dense_ms=dense_flops / 1e12)["2"]  # dense: 1 ms per 1e12 FLOPs
    assert entry["vs_dense_per_flop"] == pytest.approx(12.0)
    assert entry["vs_dense_per_flop_steps_without_builds"] == pytest.approx(8.0)  # the one step with none


def test_stream_mode_runs_on_the_cpu_with_the_emulated_op(bench, monkeypatch, tmp_path):
    emu = install(monkeypatch.setattr)
    bench.main(["--device", "cpu", "--seqs", "", "--extra-dim-seq", "", "--stream", "4", "--stream-seq",
                "512", "--stream-heads", "4/2", "--dims", "16", "--median", "48", "--max-doc", "256",
                "--stream-backends", "cudnn_fe,reference", "--out", str(tmp_path), "--tag=-smoke"])
    (path,) = tmp_path.glob("packed-kernels-cpu-*-smoke.json")
    result = json.loads(path.read_text())
    records = {(r["world"], r["backend"]): r for r in result["stream"]}
    assert set(records) == {(1, "cudnn_fe"), (1, "reference"), (2, "cudnn_fe"), (2, "reference")}
    fe = records[(2, "cudnn_fe")]
    assert fe["steps"] == 4 and len(fe["step_ms"]) == 4 and fe["builds"][0] > 0
    assert sum(r["builds"][0] for r in result["stream"]) <= emu.builds  # counted from the op's cache
    assert result["summary"]["stream"]["2"]["builds"] == sum(fe["builds"])
    assert result["rows"] == [] and result["summary"]["stream_builds_per_step_last_half"] is not None


def test_the_table_times_one_direct_op_call_and_auto_beside_cudnn_fe(bench, monkeypatch, tmp_path):
    """The table on the CPU with the emulated op: the ``op`` column is one forward and one backward call of
    the op on the row's exact document lengths (no padded sequences, the whole row), ``auto`` is timed
    (never a candidate for "best"), and each row has ``cudnn_fe_vs_op`` and ``auto_vs_fastest``."""
    emu = install(monkeypatch.setattr)
    bench.main(["--device", "cpu", "--seqs", "256", "--dims", "16", "--heads", "4/2", "--extra-dim-seq", "",
                "--flex-seqs", "", "--median", "40", "--max-doc", "100", "--backends", "cudnn_fe,op,auto",
                "--out", str(tmp_path), "--tag=-op"])
    result = json.loads(next(tmp_path.glob("packed-kernels-cpu-*-op.json")).read_text())
    (row,) = result["rows"]
    assert set(row["fwd_bwd"]) == {"cudnn_fe", "op", "auto"} and row["best_packed"] == "cudnn_fe"
    assert row["auto_backend"] == "reference" and "same_as" not in row["fwd_bwd"]["auto"]  # the CPU's
    assert max(row["rel_err"]["op"]) < 1e-5 and max(row["rel_err"]["auto"]) < 1e-5
    ms = {name: r["ms"] for name, r in row["fwd_bwd"].items()}
    assert row["cudnn_fe_vs_op"] == pytest.approx(ms["cudnn_fe"] / ms["op"])
    assert row["auto_vs_fastest"] == pytest.approx(ms["auto"] / ms["cudnn_fe"])
    assert result["summary"]["per_row"]["256/4/2/d16"]["cudnn_fe_vs_op"] == row["cudnn_fe_vs_op"]
    assert result["summary"]["cudnn_fe_vs_op_max"] == row["cudnn_fe_vs_op"]
    exact = [c for c in emu.calls if 0 not in c["q_lens"] and c["rows"] == 256 and sum(c["q_lens"]) == 256]
    assert {c["op"] for c in exact} == {"forward", "backward"}
    assert all(c["causal"] and not c["bottom_right"] and c["max_q"] == max(c["q_lens"]) for c in exact)
    assert len(exact[0]["q_lens"]) == row["docs"]
