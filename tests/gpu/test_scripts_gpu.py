"""The benchmark and check scripts on GPUs, end to end at small shapes (``tests/gpu/script_runs.py``): each
starts as ``scripts/run_gpu_benchmarks.sh`` starts it (torchrun, NVLink multicast off, the caller's
PYTHONPATH extended), finishes, and writes the results its GPU runs report: rows without errors, the peers
and ablations measured, the summary's keys. The CPU suite runs the same scripts on gloo and the
interpreter (tests/test_script_smoke.py); this is their GPU path.

Run on a machine with 1 or more GPUs (the 2-process runs skip on one):
``bash scripts/run_gpu_tests.sh tests/gpu/test_scripts_gpu.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from script_runs import RUNS, ScriptRun  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def launch(run: ScriptRun, out: Path) -> str:
    """Run the script as the GPU runners do; its standard output."""
    args = [a.replace("{out}", str(out)) for a in run.args]
    start = [sys.executable] if run.gpus == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.gpus}"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([*start, str(ROOT / "scripts" / run.script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=run.timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


def results(run: ScriptRun, out: Path, stdout: str):
    """The run's results: one JSON document, or the records of a JSON-lines file."""
    if run.results == "stdout":
        return json.loads(stdout[stdout.index("{"):])
    (path,) = out.glob(run.results)
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def no_errors(rows: list[dict]) -> None:
    failed = [r for r in rows if "error" in r]
    assert not failed, failed[0]["error"]


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_dist_attn(result: dict, out: Path) -> None:
    no_errors(result["rows"])
    assert result["device"] != "cpu" and result["dtype"] == "bfloat16"
    assert all(g and g["cuda_index"] is not None for g in result["rank_gpus"])
    assert isinstance(result["cudnn_backward_fell_back_to_flash"], bool)
    rows = {(r["kv_heads"], r["impl"], r["phase"]): r for r in result["rows"]}
    for phase in ("fwd", "fwd_bwd"):
        for impl in ("ours", "pipelined", "ring", "paper", "no_overlap", "compute_only", "replay"):
            assert finite(rows[(32, f"{impl}_sdpa_cudnn", phase)]["ms"]), (impl, phase)
        for impl in ("torch_cp_allgather_cudnn", "torch_cp_alltoall_cudnn", "single_cudnn"):
            assert finite(rows[(32, impl, phase)]["ms"]) and finite(rows[(8, impl, phase)]["ms"]), impl
        assert len(rows[(32, "compute_only_sdpa_cudnn", phase)]["per_rank_ms"]) == 2
    entry = result["summary"]["per_seq"]["8192"]
    assert finite(entry["vs_torch_cp"]) and finite(entry["efficiency"]) and "comm_overhead" in entry
    assert len(list(out.glob("trace-dist-8k-sdpa_cudnn-balanced-rank*.json.gz"))) == 2


def check_bytes_per_token(result: dict, out: Path) -> None:
    rows = result["rows"]
    assert [r["tokens_per_rank"] for r in rows] == [2048, 4096] and result["world"] == 1
    for row in rows:
        assert math.isfinite(row["loss"]) and {"forward", "backward"} <= set(row["phases"]), row["phases"]
        assert row["phases"]["backward"]["peak"] > 0 and row["outside_allocator"] >= 0
    summary = result["summary"]
    planned, measured = summary["planned"], summary["measured"]
    assert finite(planned["forward"]) and finite(planned["backward"]) and planned["terms_per_token"]
    assert all(math.isfinite(measured[phase]) for phase in ("forward", "backward", "host"))
    assert summary["device_bytes_per_token"] == measured["backward"] and result["backend"] == "sdpa_cudnn"


def check_kernels(result: dict, out: Path) -> None:
    assert [r["causal"] for r in result["rows"]] == [True, False]
    for row in result["rows"]:
        assert row["rel_err_vs_flash"] < 2e-2, row["rel_err_vs_flash"]  # bf16
        for mode in ("fwd", "fwd_bwd"):
            assert finite(row[mode]["ours"]["ms"]) and finite(row[mode]["flash"]["ms"])
            assert finite(row[mode]["floor_ms_matmul"])
            assert finite(row[mode]["auto"]["ms"]) and finite(row[mode]["auto_vs_fastest"])
        assert row["auto_backend"] in ("sdpa_cudnn", "sdpa_flash", "triton")
    assert finite(result["ceilings"]["matmul_bf16_8192_tflops"])
    assert {r["kernel"] for r in result["resources"]} == {"fwd", "dkdv", "dq"}
    assert list(out.glob("kernels-*.png"))


def check_packed(result: dict, out: Path) -> None:
    no_errors(result["rows"])
    assert result["summary"]["exact"] is True, result["exactness_check"]
    impls = {r["impl"] for r in result["rows"] if "ms" in r}
    assert {"packed_ours", "packed_compute_only", "allgather_varlen", "torch_cp"} <= impls, impls


def check_packed_kernels(result: dict, out: Path) -> None:
    (row,) = result["rows"]
    assert finite(row["fwd_bwd"]["triton"]["ms"]) and row["rel_err"]
    assert finite(row["dense_cudnn"]["ms"]) and "gpu_ms" in row["dense_cudnn"]  # None without a profiler
    assert row["best_packed"] in row["fwd_bwd"] and finite(row["packed_vs_dense_per_flop"])
    assert row["auto_backend"] and finite(row["auto_vs_fastest"])
    if "cudnn_fe" in row["fwd_bwd"]:  # nvidia-cudnn-frontend installed: the direct op call beside it
        assert finite(row["fwd_bwd"]["op"]["ms"]) and finite(row["cudnn_fe_vs_op"])
    for record in result["stream"]:  # cudnn_fe and triton over 3 changing layouts, whole rows and 2 ranks
        assert "skipped" in record or (record["steps"] == 3 and all(map(finite, record["step_ms"])))
    assert {r["world"] for r in result["stream"]} == {1, 2}


def check_prefill(result: dict, out: Path) -> None:
    no_errors(result["rows"])
    rows = {r["impl"]: r for r in result["rows"] if r["seq"] == 2048 and "ms" in r}
    assert set(rows) == {"single", "ours", "torch_cp"}, result["rows"]
    assert rows["ours"]["local_tokens"] == 1024 and rows["single"]["local_tokens"] == 2048
    assert rows["ours"]["rel_err_vs_single"] < 0.1  # bf16 through 32 layers (0.03-0.05 at 32K-128K)
    assert finite(result["summary"]["per_seq"]["2048"]["torch_cp_over_ours"])


def check_train(result: dict, out: Path) -> None:
    no_errors(result["rows"])
    assert {r["variant"] for r in result["rows"]} == {"remat", "torch_cp"}
    for row in result["rows"]:
        assert finite(row["step_s"]) and finite(row["mfu"]) and all(finite(p) for p in row["peak_gib"])
        assert row["memory_breakdown"]
    assert result["summary"]["longest_measured_ours"] == 4096 and finite(result["matmul_peak_tflops"])


def check_replay(records: list, out: Path) -> None:
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert finite(r["ms"]) and r["calls"] and all(finite(c["ms"]) for c in r["calls"])


def check_finetune_memory(result: dict, out: Path) -> None:
    for name in ("library", "accum2_no_sync"):
        variant = result["variants"][name]
        assert "error" not in variant, variant["error"]
        assert finite(variant["peak_gib"]) and len(variant["step_s"]) == 2
    assert finite(result["planner_gib"]) and "planner_error" in result


def check_sweep(records: list, out: Path) -> None:
    (record,) = records
    assert list(record["accs"]) == ["25"] and 0 <= record["accs"]["25"] <= 1


CHECKS = {"bench_dist_attn.py": check_dist_attn, "bench_bytes_per_token.py": check_bytes_per_token,
          "bench_kernels.py": check_kernels,
          "bench_packed.py": check_packed, "bench_packed_kernels.py": check_packed_kernels,
          "bench_prefill.py": check_prefill, "bench_train.py": check_train, "replay_packed.py": check_replay,
          "check_finetune_memory.py": check_finetune_memory, "sweep_passkey.py": check_sweep}


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.script)
def test_script_runs_on_gpus(run: ScriptRun, tmp_path: Path) -> None:
    found = torch.cuda.device_count()
    if found < run.gpus:
        pytest.skip(f"needs {run.gpus} CUDA GPUs, found {found}")
    stdout = launch(run, tmp_path)
    CHECKS[run.script](results(run, tmp_path, stdout), tmp_path)


def test_every_run_is_checked() -> None:
    assert sorted(CHECKS) == sorted(r.script for r in RUNS)
