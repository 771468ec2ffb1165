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


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_peak_sites_replay_the_allocator_history():
    """The replay of recorded events: the peak is the largest total alive at once within the block
    (frees of blocks allocated before it are ignored), the live tensors there are grouped by their
    innermost lightseq_hf or Transformers frames, with bytes per token."""
    import torch

    _load()  # puts scripts/ (benchlib) on sys.path
    from benchlib.alloc_trace import live_at_peak, peak_sites, recording, site

    rotary = [_frame("/venv/lib/torch/nn/functional.py", 1, "op"),
              _frame("/venv/lib/transformers/models/llama/modeling_llama.py", 158, "apply_rotary_pos_emb"),
              _frame("/repo/lightseq_hf/checkpoint.py", 120, "__call__")]
    loss = [_frame("/repo/lightseq_hf/parallel/fused_loss.py", 91, "forward")]
    events = [{"action": "free_requested", "addr": 99, "size": 7},  # allocated before the block
              {"action": "alloc", "addr": 1, "size": 4 << 20, "frames": rotary},
              {"action": "alloc", "addr": 2, "size": 4 << 20, "frames": rotary},
              {"action": "alloc", "addr": 3, "size": 2 << 20, "frames": loss},
              {"action": "free_requested", "addr": 1, "size": 4 << 20},
              {"action": "free_completed", "addr": 1, "size": 4 << 20},
              {"action": "alloc", "addr": 4, "size": 1 << 20, "frames": loss}]
    peak, live = live_at_peak(events)
    assert peak == 10 << 20 and set(live) == {1, 2, 3}
    assert site(rotary) == ("llama/modeling_llama.py:158:apply_rotary_pos_emb <- "
                            "lightseq_hf/checkpoint.py:120:__call__")
    assert site([_frame("/x/torch/a.py", 3, "f")]) == "torch/a.py:3:f" and site([]) == "unknown"
    found = peak_sites(events, tokens=1024)
    assert found["peak_bytes"] == 10 << 20 and found["bytes_per_token"] == (10 << 20) / 1024
    assert [(s["bytes"], s["tensors"]) for s in found["sites"]] == [(8 << 20, 2), (2 << 20, 1)]
    assert found["sites"][1]["site"] == "parallel/fused_loss.py:91:forward"
    assert peak_sites(events, tokens=1024, min_bytes=4 << 20)["sites"][0]["bytes"] == 8 << 20
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        with recording(torch.device("cpu")):
            pass


def test_trace_peaks_on_the_cpu_is_refused():
    bench = _load()
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--trace-peaks", "--tokens-per-rank", "16,32"])


def test_report_sites_of_the_traced_run():
    bench = _load()
    path = ROOT / "benchmarks/results/bytes-per-token-h100-x1-2026-11-26-8b-4-layers-traced.json"
    text = bench.report_sites(json.loads(path.read_text())["rows"], top=2)
    assert "262144 tokens, forward peak above its start: 60.5 KB per token" in text
    assert "apply_rotary_pos_emb" in text and len(text.splitlines()) == 6
