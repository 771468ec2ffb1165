"""scripts/trace_exposure.py on a hand-made trace whose breakdown is known."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "trace_exposure.py"


def kernel(name, ts, dur, stream, grid="[1, 1, 1]"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "grid": grid}}


def test_breakdown_of_a_known_timeline(tmp_path):
    events = [
        kernel("cudnn_fmha_fwd", 0, 100, 7),            # beside a transfer: 20 us slower than alone
        kernel("ncclDevKernel_SendRecv", 50, 130, 20),  # covers 100-180 of the gap 100-200
        kernel("cudnn_fmha_fwd", 200, 80, 7),           # the same kernel alone
        kernel("ncclDevKernel_SendRecv", 280, 70, 20),  # after the last attention kernel: 300-350 exposed
        kernel("elementwise_add", 360, 10, 7),          # the merge of the returned result
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5},
    ]
    path = tmp_path / "trace-rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, str(SCRIPT), str(path), "--out", str(out)], check=True,
                   capture_output=True)
    report = json.loads(out.read_text())["trace-rank0.json.gz"]
    assert report["window_ms"] == 0.370
    assert abs(report["compute_ms"] - 0.190) < 1e-9  # 0-100, 200-280, 360-370
    assert abs(report["exposed_comm_ms"]["between"] - 0.080) < 1e-9
    assert abs(report["exposed_comm_ms"]["last"] - 0.070) < 1e-9  # 280-350 after the last attention
    assert report["exposed_comm_ms"]["first"] == 0
    assert abs(report["idle_ms"] - 0.030) < 1e-9  # 180-200 and 350-360
    assert abs(report["contention_ms"] - 0.020) < 1e-9
    assert report["attention_kernels"] == 2


def test_a_trace_without_gpu_kernels_is_refused(tmp_path):
    path = tmp_path / "cpu.json"
    cpu_only = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}
    path.write_text(json.dumps(cpu_only))
    run = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert run.returncode != 0 and "no GPU kernels" in run.stderr
