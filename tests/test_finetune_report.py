"""scripts/finetune_report.py: runs of scripts/finetune.py joined into one results file, with the speedup of
one run's tokens per second over another's (the same job with another training.backend)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("finetune_report", ROOT / "scripts" / "finetune_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_dir(tmp_path: Path, name: str, tokens_per_s: list[float]) -> Path:
    run = tmp_path / name
    run.mkdir()
    steps = [{"kind": "train", "step": i + 1, "loss": 10.0 - i, "step_time_s": 65536 / t, "tokens_per_s": t,
              "peak_mem_gib_per_rank": [60.0, 61.0]} for i, t in enumerate(tokens_per_s)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "config.json").write_text(json.dumps({"context_length": 65536, "model": {"config": {}},
                                                 "training": {"checkpointing": "remat", "grad_accum": 1}}))
    (run / "summary.json").write_text(json.dumps({"world_size": 2, "sp_size": 2, "device": "NVIDIA H100"}))
    return run


def test_speedup_of_one_backend_over_another(tmp_path):
    report = _load()
    out = tmp_path / "finetune-packed.json"
    triton = _run_dir(tmp_path, "triton", [1000.0, 8000.0, 8200.0, 8100.0])
    fe = _run_dir(tmp_path, "fe", [900.0, 9900.0, 10000.0, 10100.0])
    report.main(["--out", str(out), "--run", "triton", str(triton), "cmd a", "--run", "cudnn_fe", str(fe),
                 "cmd b", "--speedup", "cudnn_fe", "triton", "--note", "2 GPUs"])
    result = json.loads(out.read_text())
    assert result["summary"]["tokens_per_s"] == {"triton": 8100.0, "cudnn_fe": 10000.0}  # after the first
    assert result["summary"]["speedup_vs_triton"] == pytest.approx(10000 / 8100)
    assert result["device"] == "NVIDIA H100" and result["note"] == "2 GPUs"
    with pytest.raises(SystemExit, match="--speedup cudnn_fe flash: runs are triton, cudnn_fe"):
        report.main(["--out", str(out), "--run", "triton", str(tmp_path / "triton"), "a",
                     "--run", "cudnn_fe", str(tmp_path / "fe"), "b", "--speedup", "cudnn_fe", "flash"])
