"""Every entry point of ``scripts/`` runs end to end on the CPU, and its results file has the fields the
GPU runs fill: gloo processes, tiny shapes, the reference kernel or Triton's interpreter.

:data:`SMOKE` names, for each ``scripts/*.py``, the test that runs it; a script without one fails
:func:`test_every_script_has_a_cpu_smoke_test`. ``tests/gpu/test_scripts_gpu.py`` runs the GPU side.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
HERE = "tests/test_script_smoke.py"
#: every entry point of scripts/ -> the test that runs it end to end on the CPU ("path::function")
SMOKE = {
    "bench_dist_attn.py": f"{HERE}::test_bench_dist_attn_on_two_cpu_processes",
    "bench_kernels.py": f"{HERE}::test_bench_kernels_in_the_interpreter",
    "bench_packed.py": "tests/test_bench_packed.py::test_smoke_run_on_two_cpu_processes",
    "bench_packed_kernels.py": f"{HERE}::test_bench_packed_kernels_in_the_interpreter",
    "bench_peers.py": "tests/test_alst_peer.py::test_bench_peers_on_two_cpu_processes",
    "bench_bytes_per_token.py": "tests/test_bench_bytes_per_token.py::test_smoke_run_on_two_cpu_processes",
    "bench_prefill.py": "tests/test_bench_prefill.py::test_smoke_run_on_two_cpu_processes",
    "bench_train.py": f"{HERE}::test_bench_train_then_finetune_report",
    "check_clean_exit.py": f"{HERE}::test_check_clean_exit_counts_a_clean_run",
    "check_finetune_memory.py": f"{HERE}::test_check_finetune_memory_runs_its_variants",
    "check_triton_compile.py": "tests/test_triton_compile.py::test_kernels_compile_for_hopper_and_ampere",
    "finetune.py": "tests/test_finetune_e2e.py::test_tiny_default_runs_saves_and_resumes",
    "finetune_report.py": f"{HERE}::test_bench_train_then_finetune_report",
    "fit_tile_cost.py": f"{HERE}::test_replay_packed_then_fit_tile_cost",
    "gen_config_reference.py": "tests/test_docs.py::test_config_reference_is_generated_from_the_schema",
    "maxctx_ladder.py": "tests/test_maxctx_ladder.py::test_runner_start_poll_on_two_cpu_processes",
    "plot_headline.py": f"{HERE}::test_plot_headline_draws_the_figure",
    "replay_packed.py": f"{HERE}::test_replay_packed_then_fit_tile_cost",
    "schedule_table.py": "tests/test_docs.py::test_design_schedule_table_is_the_scripts_output",
    "support_table.py": f"{HERE}::test_support_table_for_two_model_types",
    "sweep_passkey.py": f"{HERE}::test_sweep_passkey_first_configuration",
    "trace_exposure.py": "tests/test_trace_exposure.py::test_breakdown_of_a_known_timeline",
}
#: scripts with no GPU path of their own: tools that read results or traces, compile without a GPU, run on
#: gloo, or launch another script (maxctx_ladder.py and bench_peers.py: bench_train.py's rungs)
CPU_ONLY = {"bench_peers.py", "check_clean_exit.py", "check_triton_compile.py", "finetune_report.py",
            "fit_tile_cost.py", "gen_config_reference.py", "maxctx_ladder.py", "plot_headline.py",
            "schedule_table.py", "support_table.py", "trace_exposure.py"}
#: scripts whose GPU path a GPU test other than tests/gpu/test_scripts_gpu.py runs
GPU_ELSEWHERE = {"finetune.py": "tests/gpu/test_finetune_gpu.py"}


def load_script(name: str):
    """``scripts/<name>.py`` as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=path)


def run_command(args: list, timeout: int = 300) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def one(folder: Path, pattern: str) -> Path:
    (path,) = folder.glob(pattern)
    return path


def test_every_script_has_a_cpu_smoke_test():
    scripts = {p.name for p in (ROOT / "scripts").glob("*.py")}
    assert set(SMOKE) == scripts, f"a CPU smoke test for each script: {sorted(scripts ^ set(SMOKE))}"
    for script, where in SMOKE.items():
        path, function = where.split("::")
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{script}: {where} does not exist"


def test_every_script_with_a_gpu_path_has_a_gpu_run():
    """tests/gpu/test_scripts_gpu.py runs each GPU path (its runs: tests/gpu/script_runs.py)."""
    runs = {run.script for run in gpu_script_runs()}
    assert runs.isdisjoint(CPU_ONLY | set(GPU_ELSEWHERE))
    assert runs | CPU_ONLY | set(GPU_ELSEWHERE) == set(SMOKE), sorted(set(SMOKE) - runs - CPU_ONLY)
    assert all((ROOT / path).is_file() for path in GPU_ELSEWHERE.values())


def gpu_script_runs() -> tuple:
    """The runs of tests/gpu/script_runs.py (that folder is not on the CPU suite's path)."""
    spec = importlib.util.spec_from_file_location("script_runs", ROOT / "tests" / "gpu" / "script_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("script_runs", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.RUNS


def test_run_gpu_tests_dry_run_keeps_the_environment_and_logs(tmp_path):
    """scripts/run_gpu_tests.sh --dry-run: the caller's PYTHONPATH extended, multicast off, every GPU
    test module collected, and what this machine cannot run listed as skipped with the reason."""
    import torch

    log = tmp_path / "gpu-tests.log"
    env = dict(cpu_env(), PYTHONPATH="/caller/site", PYTHON=sys.executable, NCCL_NVLS_ENABLE="1")
    proc = subprocess.run(["bash", "scripts/run_gpu_tests.sh", "--dry-run", "--log", str(log)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    text = log.read_text()
    assert text == proc.stdout
    assert f"PYTHONPATH={ROOT}:/caller/site" in text and "CUDA_VISIBLE_DEVICES=\n" in text
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        assert f"\n{name}={value}\n" in text
    assert "0 CUDA GPUs" in text and f"torch {torch.__version__}" in text
    assert "-m pytest tests/gpu -v -rs" in text and "--collect-only" in text
    for module in (ROOT / "tests" / "gpu").glob("test_*.py"):
        skipped = rf"SKIPPED \[1\] tests/gpu/{module.name}:\d+: needs (a CUDA GPU|2 CUDA GPUs)"
        assert re.search(skipped, text), module.name
    assert text.rstrip().endswith(f"exit 0; log: {log}")


# ----------------------------------------------------------------------------- distributed attention


def worker_dist_attn(rank, world, out_dir):
    load_script("bench_dist_attn").main(
        ["--device", "cpu", "--seqs", "64,96", "--heads", "4/4,4/2", "--dim", "16", "--reps", "1", "--replay",
         "--trace", "--trace-seq", "64", "--trace-schedules", "balanced,pipelined", "--out", out_dir])
    return []


@pytest.mark.slow
def test_bench_dist_attn_on_two_cpu_processes(tmp_path):
    failures = [f for r in run_distributed(worker_dist_attn, 2, str(tmp_path)) for f in r]
    assert not failures, "\n".join(failures)
    result = json.loads(one(tmp_path, "dist-cpu-x2-*.json").read_text())
    assert result["world"] == 2 and result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["backends"] == ["reference"] and result["rank_gpus"] == [None, None]
    assert result["cudnn_backward_fell_back_to_flash"] is False
    assert set(result["env"]) == {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                  "NVSHMEM_DISABLE_NVLS"}
    assert not [r for r in result["rows"] if "error" in r], result["rows"]
    rows = {(r["seq"], r["kv_heads"], r["impl"], r.get("phase")): r for r in result["rows"]}
    for seq in (64, 96):
        for phase in ("fwd", "fwd_bwd"):
            impls = ["ours", "pipelined", "compute_only", "single", "ring", "paper", "no_overlap", "replay"]
            for impl in impls:  # the ablations and the replay on the main layout (kv heads = heads) only
                assert rows[(seq, 4, f"{impl}_reference", phase)]["ms"] > 0
            assert (seq, 2, "ring_reference", phase) not in rows
            assert rows[(seq, 2, "ours_reference", phase)] and rows[(seq, 2, "pipelined_reference", phase)]
            assert rows[(seq, 4, "single_math", phase)]["ms"] > 0  # torch's SDPA on one process
            for impl in ("compute_only", "replay"):
                assert len(rows[(seq, 4, f"{impl}_reference", phase)]["per_rank_ms"]) == 2
            assert rows[(seq, 4, "ours_reference", phase)]["tflops_per_gpu"] > 0
        assert "skipped" in rows[(seq, 4, "torch_cp_cudnn", None)]
    assert set(result["summary"]) >= {"per_seq", "vs_torch_cp_min", "efficiency_64k", "comm_overhead_64k",
                                      "compute_spread_256k"}
    assert sorted(p.name for p in tmp_path.glob("trace-*")) == [
        f"trace-dist-0k-reference-{schedule}-rank{rank}.json.gz" for schedule in ("balanced", "pipelined")
        for rank in (0, 1)]
    assert one(tmp_path, "dist-cpu-x2-*.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- local kernels

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the CPU runs of the Triton kernels need Triton's interpreter")


@interpreter
@pytest.mark.slow
def test_bench_kernels_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    path = load_script("bench_kernels").main(["--device", "cpu", "--seqs", "128", "--head-dims", "64",
                                              "--heads", "2/1", "--out", str(tmp_path)])
    result = json.loads(path.read_text())
    assert path.name.startswith("kernels-cpu-") and result["config"]["dtype"] == "float32"
    assert [(r["causal"], r["heads"], r["kv_heads"]) for r in result["rows"]] == [(True, 2, 1), (False, 2, 1)]
    for row in result["rows"]:
        assert row["rel_err_vs_math"] < 1e-5, row
        assert row["ours_bwd_only_ms"] > 0
        for mode in ("fwd", "fwd_bwd"):
            assert row[mode]["ours"]["ms"] > 0 and row[mode]["cudnn"] is None and row[mode]["flash"] is None
    assert set(result["summary"]) >= {"fwd_bwd_vs_sdpa_flash_min", "fwd_vs_cudnn_min"}
    assert {r["kernel"] for r in result["resources"]} == {"fwd", "dkdv", "dq"}  # through _testing's handles
    assert path.with_suffix(".png").stat().st_size > 1000


@interpreter
@pytest.mark.slow
def test_bench_packed_kernels_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    load_script("bench_packed_kernels").main(
        ["--device", "cpu", "--seqs", "128", "--dims", "64", "--heads", "2/1", "--extra-dim-seq", "",
         "--flex-seqs", "", "--median", "24", "--max-doc", "64", "--out", str(tmp_path)])
    result = json.loads(one(tmp_path, "packed-kernels-cpu-*.json").read_text())
    (row,) = result["rows"]
    assert row["seq"] == 128 and row["docs"] > 1 and row["useful_pairs"] < 128 * 129 // 2
    assert row["fwd_bwd"]["triton"]["ms"] > 0 and row["dense_cudnn"]["ms"] > 0
    assert row["best_packed"] == "triton" and row["packed_vs_dense_per_flop"] > 0
    assert result["summary"]["per_row"]["128/2/1/d64"]["best_packed"] == "triton"


# ----------------------------------------------------------------------------- training step and report


@pytest.mark.slow
def test_bench_train_then_finetune_report(tmp_path):
    """bench_train.py's tiny model on 2 processes, a fine-tune of the same length, and the report that
    joins them (what run_gpu_finetune.sh does on GPUs)."""
    run_command([*torchrun(2), "scripts/bench_train.py", "--model", "tiny", "--seqs", "128", "--variants",
                 "remat,hf", "--steps", "2", "--out", tmp_path])
    bench_path = one(tmp_path, "train-cpu-x2-*-tiny.json")
    bench = json.loads(bench_path.read_text())
    assert bench["model"] == "tiny" and bench["world"] == 2
    for row in bench["rows"]:
        assert "error" not in row, row["error"]
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["tokens_per_gpu"] == 64
        assert set(row) >= {"loss", "memory_breakdown", "host_peak_gib", "peak_gib", "mfu",
                            "planned_gpu_gib"}
    assert {r["variant"] for r in bench["rows"]} == {"remat", "hf"}
    assert set(bench["summary"]) >= {"remat_vs_hf_ckpt_32k_per_gpu", "vs_torch_cp_64k",
                                     "longest_measured_ours"}

    run = tmp_path / "run"
    run_command([sys.executable, "scripts/finetune.py", "--nproc", "2", "configs/tiny.yaml",
                 "training.device=cpu", "context_length=128", "training.max_steps=3",
                 "data.synthetic.eval_samples=0", "logging.progress_bar=false", "saving.final=false",
                 f"output_dir={run}"])
    report = tmp_path / "finetune-cpu-x2.json"
    run_command([sys.executable, "scripts/finetune_report.py", "--out", report, "--run", "tiny-128", run,
                 "scripts/finetune.py configs/tiny.yaml", "--bench", "tiny-128", bench_path, "128", "remat"])
    result = json.loads(report.read_text())
    (row,) = result["rows"]
    assert row["steps"] == 3 and row["timed_steps"] == 2 and row["context_length"] == 128
    assert row["sp_size"] == 2 and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
    assert result["summary"]["vs_bench_train"]["tiny-128"] == pytest.approx(
        row["tokens_per_s"] / row["bench_train_tokens_per_s"])


@pytest.mark.slow
def test_check_clean_exit_counts_a_clean_run(tmp_path):
    out = tmp_path / "clean-exit.json"
    run_command([sys.executable, "scripts/check_clean_exit.py", "--runs", "1", "--nproc", "2", "--steps", "1",
                 "--out", out])
    result = json.loads(out.read_text())
    assert (result["runs"], result["clean"], result["failures"], result["nproc"]) == (1, 1, [], 2)
    assert len(result["seconds"]) == 1 and result["ending"] == "user"


@pytest.mark.slow
def test_check_finetune_memory_runs_its_variants():
    """The two variants that change the trainer (through lightseq_hf._testing.trainer_variants) run a real
    fine-tune each; on the CPU there are no device peaks to compare."""
    out = run_command([sys.executable, "scripts/check_finetune_memory.py", "--device", "cpu", "--layers", "2",
                       "--context", "128", "--steps", "2",
                       "--variants", "held_parameter_lists,accum2_no_sync"], timeout=600)
    result = json.loads(out[out.index("{"):])
    assert result["device"] == "cpu" and result["planner_gib"] > 0 and result["params"] > 0
    assert set(result["variants"]) == {"held_parameter_lists", "accum2_no_sync"}
    for variant in result["variants"].values():
        assert "error" not in variant, variant["error"]
        assert len(variant["step_s"]) == 2 and variant["peak_gib"] is None


# ----------------------------------------------------------------------------- packed schedule cost model


def test_replay_packed_then_fit_tile_cost(tmp_path, capsys):
    replay = tmp_path / "replay.jsonl"
    load_script("replay_packed").main(
        ["--device", "cpu", "--backend", "reference", "--seqs", "192", "--worlds", "2,3", "--layouts", "3",
         "--heads", "2/1", "--dim", "16", "--median", "32", "--max-doc", "96", "--reps", "1", "--calls",
         "--out", str(replay)])
    rows = [json.loads(line) for line in replay.read_text().splitlines()]
    assert len(rows) == 3 * (2 + 3)
    for row in rows:
        assert row["ms"] > 0 and row["tasks"] and row["calls"] and row["modeled"] > 0
        assert {c["kind"] for c in row["calls"]} == {"fwd", "bwd"}
    capsys.readouterr()
    load_script("fit_tile_cost").main([str(replay), "--tile", "16x16"])
    printed = capsys.readouterr().out
    assert "15 ranks of 6 layouts" in printed and "leave-one-layout-out" in printed
    assert "TileCost(tile_m=16, tile_n=16" in printed


# ----------------------------------------------------------------------------- figures and tables


def test_plot_headline_draws_the_figure(tmp_path, capsys):
    load_script("plot_headline").main(["--out", str(tmp_path / "headline.png")])
    assert (tmp_path / "headline.png").stat().st_size > 10_000
    assert capsys.readouterr().out.count("training ") == len(load_script("plot_headline").TRAIN)


@pytest.mark.slow
def test_sweep_passkey_first_configuration(tmp_path):
    load_script("sweep_passkey").main(["--device", "cpu", "--configs", "1", "--steps", "25",
                                       "--length", "256", "--out", str(tmp_path)])
    (record,) = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert (record["rep"], record["bs"], record["layers"], record["filler"]) == (1, 2, 2, "repeat")
    assert list(record["accs"]) == ["25"] and 0 <= record["accs"]["25"] <= 1


@pytest.mark.slow
def test_support_table_for_two_model_types(tmp_path):
    run_command([sys.executable, "scripts/support_table.py", "--types", "llama,bart", "--out", tmp_path],
                timeout=600)
    rows = json.loads((tmp_path / "architectures.json").read_text())["rows"]
    assert set(rows) == {"llama", "bart"}
    assert rows["llama"]["status"] == "works" and rows["llama"]["numbers"]["loss"] < 1e-10
    assert rows["bart"]["status"] == "refused"
    for page in ("models.md", "README.md"):
        text = (tmp_path / page).read_text()
        assert "`llama`" in text and "support-table:start" in text
