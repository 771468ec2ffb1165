"""The GPU tests in shards (``tests/gpu/shards.py``, ``tests/gpu/durations.tsv``, ``tests/gpu/conftest.py``,
``scripts/run_gpu_tests.sh --shard I/N`` and ``--list``), on the CPU: the table lists every GPU test once
with a source for its seconds, each plan puts every test in exactly one shard and every shard within its
budget on 1, 2 and 4 GPUs, a log's durations come back into the table, and the runner and the conftest run
one shard."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "tests" / "gpu"
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


shards = _load("shards")


def _gpu_tests() -> set[str]:
    """Every test function of tests/gpu, and each script run of the parametrized script test."""
    runs = _load("script_runs").RUNS
    found = set()
    for path in sorted(GPU.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found.add(f"tests/gpu/{path.name}::{node.name}")
    scripts = "tests/gpu/test_scripts_gpu.py::test_script_runs_on_gpus"
    found.remove(scripts)
    return found | {f"{scripts}[{run.script}]" for run in runs}


def test_the_table_lists_every_gpu_test_once_with_its_source():
    table = shards.load()
    nodes = [t.node for t in table]
    assert len(nodes) == len(set(nodes)) and set(nodes) == _gpu_tests()
    runs = {run.script: run.gpus for run in _load("script_runs").RUNS}
    for test in table:
        assert test.gpus in (1, 2) and 0 <= test.seconds <= test.seconds_4 < shards.BUDGET_S, test
        if "[" in test.node:
            assert test.gpus == runs[test.node.split("[")[1].rstrip("]")], test
        logs = [part.strip() for part in test.source.split(";") if part.strip().endswith(".log")]
        assert test.source.startswith("estimate") or logs, test
        for log in logs:
            assert (RESULTS / log.split()[-1].strip("()")).is_file(), log


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_every_shard_of_a_plan_fits_its_call(gpus):
    table = shards.load()
    fewest = shards.fewest_shards(table, gpus)
    for n in (fewest, fewest + 1, fewest + 3):
        plan = shards.plan(table, n, gpus)
        assert plan == shards.plan(table, n, gpus)  # the same shards at every call
        assert sorted(t.node for shard in plan for t in shard) == sorted(t.node for t in table)
        assert all(shards.expected(shard, gpus) <= shards.BUDGET_S for shard in plan), n
    if fewest > 1:  # one shard fewer would not fit
        assert max(shards.expected(s, gpus) for s in shards.plan(table, fewest - 1, gpus)) > shards.BUDGET_S
    one = [t for t in table if t.gpus == 1]
    assert sum(t.expected(1) for t in table) < sum(t.expected(1) for t in one) + len(table)  # 2-GPU ones skip


def test_a_logs_durations_come_back_into_the_table(tmp_path):
    """Setup, call and teardown add up, a function's parameters add up, the log's GPU count picks the
    column, and a measurement replaces an estimate."""
    log = tmp_path / "gpu-tests-example.log"
    sdpa = "tests/gpu/test_sdpa_gpu.py::test_gqa_backward_holds_no_expanded_keys_values"
    triton = "tests/gpu/test_triton_gpu.py::test_fwd_bwd_vs_sdpa_error"
    script = "tests/gpu/test_scripts_gpu.py::test_script_runs_on_gpus[bench_kernels.py]"
    log.write_text(f"python 3.12.3, torch 2.11.0; 4 CUDA GPUs\n3.00s call     {sdpa}\n"
                   f"0.50s setup    {sdpa}\n2.00s call     {triton}[a-bf16]\n"
                   f"41.00s call     {triton}[b-fp16]\n9.00s call     {script}\n")
    before = {t.node: t for t in shards.load()}
    after = {t.node: t for t in shards.update(list(before.values()), [log])}
    assert after[sdpa].seconds_4 == 3.5 and after[sdpa].seconds == before[sdpa].seconds
    assert after[sdpa].source.endswith("gpu-tests-example.log")
    assert after[triton].seconds_4 == 43.0 and after[triton].source == "gpu-tests-example.log"
    assert after[script].seconds_4 == 9.0  # measured: replaces the estimate even when shorter
    committed = shards.durations((RESULTS / "gpu-tests-finetune-oom-h100-x2-2026-11-26.log").read_text())
    finetune = "tests/gpu/test_finetune_gpu.py::test_fsdp2_sequence_parallel_matches_one_gpu_and_resumes"
    assert before[finetune].seconds == pytest.approx(committed[finetune], abs=0.1)


def _runner(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", "scripts/run_gpu_tests.sh", *args, "--log", str(tmp_path / "run.log")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_runner_lists_the_shards_and_runs_one(tmp_path):
    listed = _runner("--list", "--gpus", "2", tmp_path=tmp_path)
    fewest = shards.fewest_shards(shards.load(), 2)
    assert listed.returncode == 0 and listed.stdout.startswith(f"{fewest} shards for 2 GPUs"), listed.stderr
    assert listed.stdout.count("\nshard ") == fewest
    assert "shard 1/3:" in _runner("--list", "--shards", "3", "--gpus", "4", tmp_path=tmp_path).stdout
    dry = _runner("--shard", f"2/{fewest}", "--gpus", "2", "--dry-run", tmp_path=tmp_path)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr
    assert f"GPU_TESTS_SHARD=2/{fewest}" in dry.stdout and "-m pytest tests/gpu -v" in dry.stdout
    wrong = _runner("--shard", "0/2", tmp_path=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "--shard takes I/N with 1 <= I <= N (shard I of N); got '0/2'"]
    both = _runner("--shard", "1/2", "tests/gpu/test_dist_gpu.py", tmp_path=tmp_path)
    assert both.returncode == 2 and "pass test paths or --shard, not both" in both.stderr


def test_the_conftest_keeps_one_shards_tests(monkeypatch):
    """Every listed test (each parameter of a function) is kept by exactly one shard; a test the table
    does not list by the last."""
    conftest = _load("conftest")
    table = shards.load()
    ids = sorted({t.node if "[" in t.node else f"{t.node}[{p}]" for t in table for p in "ab"})
    items = [SimpleNamespace(nodeid=node) for node in ids]
    items.append(SimpleNamespace(nodeid="tests/gpu/test_new_gpu.py::test_unlisted"))
    dropped = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    monkeypatch.setenv("GPU_TESTS_GPUS", "2")
    kept = []
    for i in (1, 2, 3):
        monkeypatch.setenv("GPU_TESTS_SHARD", f"{i}/3")
        shard = list(items)
        conftest.pytest_collection_modifyitems(config, shard)
        kept.append([item.nodeid for item in shard])
        plan = {t.node for t in shards.plan(table, 3, 2)[i - 1]}
        assert {n if n in plan else n.split("[")[0] for n in kept[-1]} - plan <= (
            {"tests/gpu/test_new_gpu.py::test_unlisted"} if i == 3 else set())
    every = [n for shard in kept for n in shard]
    assert sorted(every) == sorted(item.nodeid for item in items) and len(dropped) == 2 * len(items)
    assert "tests/gpu/test_new_gpu.py::test_unlisted" in kept[2]
    monkeypatch.delenv("GPU_TESTS_SHARD")
    whole = list(items)
    conftest.pytest_collection_modifyitems(config, whole)
    assert whole == items  # no shard asked for: every test
