"""scripts/bench_prefill.py: the prefill (first-token latency) benchmark, smoke-run on CPU processes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "scripts" / "bench_prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_smoke(rank, world, out_dir):
    bench = _load()
    bench.main(["--device", "cpu", "--model", "tiny", "--seqs", "64,95", "--impls", "single,ours,torch_cp",
                "--reps", "1", "--out", out_dir, "--tag", "smoke"])
    return []


def test_smoke_run_on_two_cpu_processes(tmp_path):
    failures = [f for r in run_distributed(worker_smoke, 2, str(tmp_path)) for f in r]
    assert not failures, "\n".join(failures)
    (path,) = tmp_path.glob("prefill-cpu-x2-*-tiny-smoke.json")
    result = json.loads(path.read_text())
    rows = {(r["impl"], r["seq"]): r for r in result["rows"]}
    for n in (64, 95):
        ours, single, cp = rows[("ours", n)], rows[("single", n)], rows[("torch_cp", n)]
        assert "error" not in ours and "error" not in single, (ours, single)
        # the patched forward split the prompt: the first layer ran on this rank's half (padded to 2)
        assert ours["local_tokens"] == (n + 1) // 2 and ours["world"] == 2
        assert single["local_tokens"] == n and single["world"] == 1
        # the last position's logits of the split forward are those of the unpatched model
        assert ours["rel_err_vs_single"] < 1e-5, ours
        assert ours["ms"] > 0 and single["ms"] > 0
        assert "context_parallel" in cp["skipped"] and "ms" not in cp
        entry = result["summary"]["per_seq"][str(n)]
        assert entry["speedup_vs_single"] == pytest.approx(single["ms"] / ours["ms"])
        assert entry["torch_cp_ms"] is None and entry["ours_rel_err_vs_single"] == ours["rel_err_vs_single"]
        assert entry["ours_logits_head_rel_err_vs_single"] < 1e-4  # rounded to 5 decimals in the rows
    assert result["world"] == 2 and result["impls"] == ["single", "ours", "torch_cp"]


def test_summary_ratios_errors_and_rows_from_one_gpu(tmp_path):
    bench = _load()
    rows = [
        {"seq": 32768, "impl": "ours", "ms": 100.0, "peak_gib": [20.0, 21.0]},
        {"seq": 32768, "impl": "torch_cp", "ms": 110.0, "peak_gib": [19.0, 19.5]},
        {"seq": 32768, "impl": "single", "ms": 380.0, "peak_gib": 30.0, "from": "prefill-h200-x1.json"},
        {"seq": 65536, "impl": "ours", "ms": 300.0, "peak_gib": [30.0, 30.0]},
        {"seq": 65536, "impl": "torch_cp", "error": "out of memory"},
    ]
    s = bench.summarize(rows, world=4)
    e = s["per_seq"]["32768"]
    assert e["torch_cp_over_ours"] == pytest.approx(1.1) and e["speedup_vs_single"] == pytest.approx(3.8)
    assert e["efficiency"] == pytest.approx(380 / 400) and e["ours_peak_gib"] == 21.0
    assert s["per_seq"]["65536"]["errors"] == {"torch_cp": "out of memory"}
    assert s["torch_cp_over_ours_min"] == pytest.approx(1.1)
    assert s["longest_ours"] == 65536 and s["longest_torch_cp"] == 32768
    with pytest.raises(SystemExit):
        bench.parse_args(["--impls", "ours,ring"])
