"""scripts/bench_packed.py on the CPU: the length mix, the summary, and a 2-process smoke run whose
exactness check (ours and the all-gather baseline against a per-document reference) must pass."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_packed", ROOT / "scripts" / "bench_packed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lognormal_length_mix():
    bench = _load()
    docs = bench.lognormal_docs(1 << 20, median=2048, sigma=1.0, max_len=32768, seed=1)
    lengths = [b - a for a, b in docs]
    assert docs[0][0] == 0 and docs[-1][1] == 1 << 20
    assert all(a[1] == b[0] for a, b in zip(docs, docs[1:]))
    assert max(lengths) <= 32768 and min(lengths) >= 1
    assert 1500 < statistics.median(lengths[:-1]) < 2800
    assert docs == bench.lognormal_docs(1 << 20, median=2048, sigma=1.0, max_len=32768, seed=1)


def test_summary():
    bench = _load()
    rows = [
        {"seq": 65536, "impl": "packed_ours", "ms": 10.0},
        {"seq": 65536, "impl": "packed_compute_only", "ms": 9.0, "per_rank_ms": [9.0, 8.6]},
        {"seq": 65536, "impl": "unpacked_ours_sdpa_cudnn", "ms": 30.0},
        {"seq": 65536, "impl": "unpacked_ours_triton", "ms": 40.0},
        {"seq": 65536, "impl": "torch_cp", "ms": 33.0},
        {"seq": 131072, "impl": "packed_compute_only", "ms": 9.0, "per_rank_ms": [9.0, 9.9]},
        {"seq": 131072, "impl": "torch_cp", "error": "oom"},
    ]
    s = bench.summarize(rows, {"passed": True})
    assert abs(s["busy_spread_max"] - 0.1) < 1e-9
    assert s["packed_vs_unpacked_64k"] == 3.0 and s["per_seq"]["65536"]["torch_cp_over_packed"] == 3.3
    assert s["exact"] is True
    assert bench.summarize(rows, {"passed": False})["exact"] is False
    assert bench.summarize(rows, None)["exact"] is False
    # two packed backends: the summary's keys are the fastest one's, with the other's ratio
    tagged = [
        {"seq": 65536, "impl": "packed_ours", "backend": "triton", "ms": 12.0},
        {"seq": 65536, "impl": "packed_ours", "backend": "flash_varlen", "ms": 8.0},
        {"seq": 65536, "impl": "packed_compute_only", "backend": "triton", "per_rank_ms": [9.0, 9.9]},
        {"seq": 65536, "impl": "packed_compute_only", "backend": "flash_varlen", "per_rank_ms": [6.0, 6.3]},
        {"seq": 65536, "impl": "unpacked_ours_sdpa_cudnn", "ms": 24.0},
    ]
    s = bench.summarize(tagged, {"passed": True})
    entry = s["per_seq"]["65536"]
    assert entry["packed_backend"] == "flash_varlen" and entry["packed_triton_over_packed"] == 1.5
    assert abs(s["busy_spread_max"] - 0.05) < 1e-9 and s["packed_vs_unpacked_64k"] == 3.0
    assert entry["ring_speedup_vs_triton"] == {"flash_varlen": 1.5}
    assert s["ring_speedup_vs_triton_64k"] == 1.5  # no cudnn_fe ring: the fastest other backend's
    with_fe = tagged + [{"seq": 65536, "impl": "packed_ours", "backend": "cudnn_fe", "ms": 9.6}]
    s = bench.summarize(with_fe, {"passed": True})
    assert s["ring_speedup_vs_triton_64k"] == 1.25  # cudnn_fe's, though flash_varlen was fastest
    assert bench.summarize(rows, {"passed": True})["ring_speedup_vs_triton_64k"] is None  # one backend


def worker_smoke(rank, world, out_dir):
    bench = _load()
    bench.main(["--device", "cpu", "--seqs", "256", "--check-seq", "128", "--median", "16", "--max-doc", "64",
                "--heads", "4/2", "--dim", "16", "--reps", "1", "--out", out_dir, "--tag", "smoke"])
    return []


def test_smoke_run_on_two_cpu_processes(tmp_path):
    failures = [f for r in run_distributed(worker_smoke, 2, str(tmp_path)) for f in r]
    assert not failures, "\n".join(failures)
    (path,) = tmp_path.glob("packed-cpu-x2-*-smoke.json")
    result = json.loads(path.read_text())
    assert result["summary"]["exact"] is True, result["exactness_check"]
    for name in ("out", "dq", "dk", "dv"):
        assert max(result["exactness_check"][name]["allgather_varlen_rel_err_per_rank"]) < 1e-5
    assert result["exactness_check"]["backends"] == ["reference"]
    assert result["exactness_check"]["per_backend"]["reference"]["passed"] is True
    impls = {r["impl"] for r in result["rows"] if "ms" in r}
    assert {"packed_ours", "packed_compute_only", "unpacked_ours_reference", "allgather_varlen",
            "padded_docs"} <= impls, result["rows"]
    (busy,) = [r for r in result["rows"] if r["impl"] == "packed_compute_only"]
    assert len(busy["per_rank_ms"]) == 2 and len(busy["modeled_cost_per_rank"]) == 2
    assert result["summary"]["busy_spread_max"] is not None
    # the recorded schedule is the one the model check rebuilds from the results
    spec = importlib.util.spec_from_file_location("schedule_table", ROOT / "scripts" / "schedule_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    from lightseq_hf.parallel.segment_schedule import build_segment_schedule
    from lightseq_hf.parallel.segments import Segments

    docs = _load().lognormal_docs(256, median=16, sigma=1.0, max_len=64, seed=1000 + 256)
    recorded, how = table.measured_schedule(result, busy, Segments(256, (docs,)))
    assert how == "recorded in the results"
    assert recorded.steps == build_segment_schedule(2, Segments(256, (docs,)), True, None).steps
    assert any(r["impl"] == "wall" and r["wall_s"] > 0 for r in result["rows"])
