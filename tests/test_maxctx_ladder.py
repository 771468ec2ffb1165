"""scripts/maxctx_ladder.py and benchlib/ladder.py: which rungs the longest-context ladder runs, how long
they take, the results' summary, and the whole runner (start, detached, then poll) on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib.ladder import (  # noqa: E402
    OURS_VARIANTS,
    Ladder,
    choose_ours,
    estimate_seconds,
    planned_longest,
    step_flops,
    summarize,
    torch_cp_start,
    with_budget_share,
)
from benchlib.workloads import SHAPES  # noqa: E402

GIB = 2**30


def test_step_flops_and_minutes_of_an_8b_step_at_1m_on_4_gpus():
    """Attention 4 H D per visible pair and layer forward (N^2/2 pairs), 3.5x with remat, 4.5x when the
    layer recompute runs it again; matrix multiplies 8x their weights per token."""
    n = 1 << 20
    attention = 4 * 32 * 128 * 32 * n * n / 2
    matmuls = 32 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336) + 128256 * 4096
    assert step_flops(SHAPES["8b"], n, False) == pytest.approx(3.5 * attention + 8 * matmuls * n)
    assert step_flops(SHAPES["8b"], n, True) == pytest.approx(4.5 * attention + 8 * matmuls * n)
    remat = estimate_seconds("remat+offloadauto+tiled", SHAPES["8b"], n, 4)
    assert 10.5 < remat["step_s"] / 60 < 12.5  # 10.5 min of attention at 400 TFLOP/s per GPU, and more
    assert estimate_seconds("hf+offloadauto+tiled", SHAPES["8b"], n, 4)["step_s"] > 1.25 * remat["step_s"]
    cpu_adam = estimate_seconds("remat+offloadauto+tiled+cpuadam", SHAPES["8b"], n, 4)
    assert cpu_adam["step_s"] > remat["step_s"]
    assert cpu_adam["total_s"] == cpu_adam["setup_s"] + cpu_adam["step_s"]


def test_ours_takes_the_variant_that_reaches_furthest_within_a_rungs_time():
    gpu, host = with_budget_share(79.1, 512, 4)
    assert (gpu / GIB, host / GIB) == pytest.approx((79.1 * 0.95, 512 * 0.9 / 4))
    planned = {v: planned_longest(v, SHAPES["8b"], 4, gpu, host, 8192) for v in OURS_VARIANTS}
    free = choose_ours(SHAPES["8b"], 4, gpu, host, 8192, rung_s=1e9)
    assert free["start"] == free["planned_max"] == max(planned.values()) and not free["time_capped"]
    assert free["variant"] == max(OURS_VARIANTS, key=lambda v: (planned[v], -OURS_VARIANTS.index(v)))
    capped = choose_ours(SHAPES["8b"], 4, gpu, host, 8192, rung_s=7.5 * 60)
    est = estimate_seconds(capped["variant"], SHAPES["8b"], capped["start"], 4)
    longer = estimate_seconds(capped["variant"], SHAPES["8b"], capped["start"] + 8192, 4)
    assert est["total_s"] <= 7.5 * 60 < longer["total_s"] and capped["time_capped"]
    assert capped["start"] % 8192 == 0
    # torch context parallel gets FSDP2's CPU optimizer exactly when ours uses it
    assert torch_cp_start(SHAPES["8b"], 4, gpu, host, 8192, 1e9, cpuadam=True)["variant"] == \
        "torch_cp+offload+cpuadam"
    cp = torch_cp_start(SHAPES["8b"], 4, gpu, host, 8192, 1e9, cpuadam=False)
    assert cp["variant"] == "torch_cp+offload" and cp["start"] == planned_longest(
        "torch_cp+offload", SHAPES["8b"], 4, gpu, host, 8192)


def _row(n, status, **extra):
    row = {"seq": n, "model": "8b", "impl": "ours", "variant": "remat+offloadauto+tiled", **extra}
    if status == "ok":
        row.setdefault("step_s", 100.0)
    elif status == "oom":
        row["error"] = "out of memory"
    elif status == "time":
        row["error"] = "time limit (900 s)"
    else:
        row["error"] = "Traceback ... KeyError"
    return row


def test_next_length_climbs_from_the_measurement_steps_down_and_bisects():
    unit, world, gpu, host = 8192, 4, 75 * GIB, 115 * GIB
    ladder = Ladder("8b", "ours", "v", planned_max=983040, start=983040, unit=unit)
    assert ladder.next_length(gpu, host, world) == 983040
    # a success whose bytes per token say 1.2M fits: the next rung goes there (within 1.5x)
    static, per_token = 20.0, (gpu - 20 * GIB) / (1.2e6 / world)
    ladder.rows.append(_row(983040, "ok", device_static_gib=static, device_bytes_per_token=per_token))
    assert ladder.next_length(gpu, host, world) == int(1.2e6 // unit) * unit
    # the host is the tighter budget: it sets the length (but at least one resolution step up)
    tight = dict(device_static_gib=static, device_bytes_per_token=per_token, host_static_gib=15.0,
                 host_bytes_per_token=(host - 15 * GIB) / (1.0e6 / world))
    ladder.rows[-1].update(tight)
    assert ladder.next_length(gpu, host, world) == int(983040 * 1.125 // unit) * unit
    ladder.rows.append(_row(1228800, "oom"))  # a failure 1/4 above: bisect
    assert ladder.next_length(gpu, host, world) == (983040 + 1228800) // 2 // unit * unit == 1105920
    ladder.rows.append(_row(1105920, "time"))  # a time limit bounds it too; within 1/8: done
    assert ladder.next_length(gpu, host, world) is None
    assert ladder.stopped == "bracketed: 983040 trained, 1105920 did not"

    down = Ladder("8b", "torch_cp", "v", planned_max=720896, start=720896, unit=unit)
    down.rows.append(_row(720896, "oom"))
    assert down.next_length(gpu, host, world) == int(720896 * 0.875 // unit) * unit
    down.rows.append(_row(630784, "error"))  # not a memory bound: the ladder stops, saying why
    assert down.next_length(gpu, host, world) is None and "without running out" in down.stopped

    nothing = Ladder("8b", "ours", "v", planned_max=0, start=0, unit=unit)
    assert nothing.next_length(gpu, host, world) is None and "fits no length" in nothing.stopped


def test_summary_keys_ratio_bytes_per_token_and_rungs():
    rows = [
        _row(983040, "ok", step_s=600.0, device_bytes_per_token=90e3, host_bytes_per_token=280e3,
             peak_gib=[70.0] * 4),
        _row(1105920, "oom", failed_phase="backward"),
        {**_row(655360, "ok", step_s=300.0, device_bytes_per_token=150e3), "impl": "torch_cp",
         "variant": "torch_cp+offload"},
        {**_row(737280, "oom"), "impl": "torch_cp", "variant": "torch_cp+offload"},
        {**_row(524288, "ok", step_s=200.0), "model": "7b"},
    ]
    ladders = {"8b": {"ours": {"planned_max": 991232, "stopped": "bracketed"}, "torch_cp": {}}}
    s = summarize(rows, ladders)
    assert s["headline_model"] == "8b"
    assert (s["max_context_ours"], s["max_context_torch_cp"]) == (983040, 655360)
    assert s["max_context_ratio"] == pytest.approx(1.5)
    assert s["max_context_ratio_at_least"] == pytest.approx(983040 / 737280)
    assert (s["first_failed_context_ours"], s["first_failed_context_torch_cp"]) == (1105920, 737280)
    assert (s["device_bytes_per_token"], s["host_bytes_per_token"]) == (90e3, 280e3)
    assert [r["status"] for r in s["step_s_per_rung"]] == ["ok", "oom", "ok", "oom", "ok"]
    assert s["step_s_per_rung"][0]["step_s"] == 600.0
    assert s["step_s_per_rung"][1]["failed_phase"] == "backward"
    eight = s["per_model"]["8b"]
    assert eight["planned_max_ours"] == 991232 and eight["ladder_end_ours"] == "bracketed"
    assert eight["device_bytes_per_token_torch_cp"] == 150e3 and eight["peak_gib_at_max_ours"] == [70.0] * 4
    seven = s["per_model"]["7b"]
    assert seven["max_context_ours"] == 524288 and seven["max_context_torch_cp"] is None
    assert seven["max_context_ratio"] is None and seven["max_context_ratio_at_least"] is None
    # torch CP failed at its only rung: no ratio of longest contexts, but a bound below it
    bracket = summarize([rows[0], {**_row(688128, "oom"), "impl": "torch_cp", "variant": "torch_cp+offload"}])
    assert bracket["max_context_ratio"] is None
    assert bracket["max_context_ratio_at_least"] == pytest.approx(983040 / 688128)


@pytest.mark.slow
def test_runner_start_poll_on_two_cpu_processes(tmp_path):
    """The whole runner: ``start`` returns at once with the run detached; ``poll`` waits for it; two rungs
    of ours ran as real launches of bench_train.py --rung (a tiny model, gloo), torch context parallel is
    recorded as skipped, and the results file has the summary the README and the lead read."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # bench_train sets its default
        env.pop(name, None)
    # 1.5 GiB of the budget is what the planner puts beside the allocator (CUDA context, NCCL buffers)
    common = ["--out", str(tmp_path), "--device", "cpu", "--gpus", "2", "--models", "tiny",
              "--gpu-gib", "1.6", "--host-gib", "1", "--unit", "512", "--tile", "256", "--max-rungs", "2",
              "--budget-min", "60", "--impls", "ours,torch_cp",
              "--ours-variants", "remat+offloadauto+tiled,hf+offloadauto+tiled"]
    script = [sys.executable, str(ROOT / "scripts" / "maxctx_ladder.py")]
    started = subprocess.run([*script, "start", *common], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "planner's longest" in started.stdout and "started: pid" in started.stdout
    polled = subprocess.run([*script, "poll", "--out", str(tmp_path), "--wait", "400"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=480)
    log = (tmp_path / "maxctx-ladder.log").read_text()
    assert polled.returncode == 0, polled.stdout + polled.stderr + log[-3000:]
    assert "ladder done" in polled.stdout and "summary:" in polled.stdout

    (path,) = tmp_path.glob("maxctx-cpu-x2-*.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "maxctx-ladder" and doc["world"] == 2 and doc["host_gib"] == 1
    assert doc["alloc_conf"] == "expandable_segments:True" and doc["alloc_conf_set_by"] == "bench_train"
    ours = [r for r in doc["rows"] if r["impl"] == "ours"]
    cp = [r for r in doc["rows"] if r["impl"] == "torch_cp"]
    assert len(ours) == 2 and all("step_s" in r for r in ours), ours
    assert ours[1]["seq"] > ours[0]["seq"] == doc["ladders"]["tiny"]["ours"]["first_rung"]
    assert len(cp) == 1 and "skipped" in cp[0]
    for r in ours:  # a full optimizer step with the AdamW state allocated first, measured per rank
        assert r["optimizer_state_preallocated"] and r["tokens_per_gpu"] == r["seq"] // 2
        assert r["host_bytes_per_token"] > 0 and len(r["host_peak_gib"]) == 2 and r["offload_layers"] >= 0
        assert r["cards"] == ["cpu", "cpu"] and r["wall_s"] > r["step_s"] and r["estimated_s"] > 0
        assert Path(tmp_path / r["log"]).is_file()
    s = doc["summary"]
    for key in ("max_context_ours", "max_context_torch_cp", "max_context_ratio", "device_bytes_per_token",
                "host_bytes_per_token", "step_s_per_rung", "per_model", "headline_model"):
        assert key in s, key
    assert s["max_context_ours"] == ours[1]["seq"] and s["max_context_torch_cp"] is None
    assert s["host_bytes_per_token"] == ours[1]["host_bytes_per_token"]
    assert [r["status"] for r in s["step_s_per_rung"]] == ["skipped", "ok", "ok"]
    assert doc["ladders"]["tiny"]["ours"]["stopped"] == "--max-rungs 2 reached"
    state = json.loads((tmp_path / "maxctx-ladder-state.json").read_text())
    assert state["status"] == "done" and state["current"] is None


def _runner():
    import importlib.util

    spec = importlib.util.spec_from_file_location("maxctx_ladder", ROOT / "scripts" / "maxctx_ladder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rung_that_fails_or_runs_out_of_time_is_a_row(tmp_path, monkeypatch):
    """The runner's reading of a launch: a failed rank's own row (out of memory, which rank, which
    phase), a launch killed at its time limit, an exit that names out of memory only in its log."""
    runner = _runner()
    args = runner.parse_args(["run", "--out", str(tmp_path), "--device", "cpu", "--gpus", "2",
                              "--models", "tiny", "--gpu-gib", "1.6", "--host-gib", "1"])
    m = runner.machine(args)
    ladder = Ladder("tiny", "ours", "remat+offloadauto+tiled", 4096, 4096, 512)
    est = {"total_s": 1.0, "setup_s": 0.5, "step_s": 0.5}

    def command(code):
        return lambda args, m, ladder, n, row_out: [sys.executable, "-c", code.replace("ROW", str(row_out))]

    oom = ("import json, sys; json.dump({'seq': 4096, 'variant': 'v', 'error': 'out of memory', "
           "'oom_message': 'CUDA out of memory. Tried to allocate 2.00 GiB', 'failed_phase': 'backward', "
           "'failed_rank': 1}, open('ROW.rank1', 'w')); sys.exit(3)")
    monkeypatch.setattr(runner, "rung_command", command(oom))
    row = runner.run_rung(args, m, ladder, 4096, est)["row"]
    assert (row["error"], row["failed_phase"], row["failed_ranks"]) == ("out of memory", "backward", [1])
    assert row["impl"] == "ours" and row["model"] == "tiny" and row["estimated_s"] == 1.0

    monkeypatch.setattr(runner, "rung_command", command("import time; time.sleep(60)"))
    row = runner.run_rung(args, m, ladder, 4096, est, limit=1.0)["row"]
    assert row["error"] == "time limit (1 s)" and row["wall_s"] < 30

    nccl = "print('RuntimeError: NCCL error: unhandled cuda error, Cuda failure out of memory'); exit(1)"
    monkeypatch.setattr(runner, "rung_command", command(nccl))
    row = runner.run_rung(args, m, ladder, 4096, est)["row"]
    assert row["error"] == "out of memory" and "NCCL error" in row["oom_message"]
    assert runner.time_limit(est) == 61.5


@pytest.mark.slow
def test_a_rank_that_fails_ends_the_rung_at_once(tmp_path):
    """bench_train.py --rung through torchrun on 2 CPU processes whose set-up fails (a tile of 0 tokens):
    each rank writes its own row and the launch ends, no time limit needed."""
    runner = _runner()
    args = runner.parse_args(["run", "--out", str(tmp_path), "--device", "cpu", "--gpus", "2",
                              "--models", "tiny", "--gpu-gib", "1.6", "--host-gib", "1", "--tile", "0"])
    ladder = Ladder("tiny", "ours", "remat+tiled", 1024, 1024, 512)
    found = runner.run_rung(args, runner.machine(args), ladder, 1024, {"total_s": 60.0}, limit=240)
    row = found["row"]
    assert found["meta"] is None and row["failed_ranks"] in ([0], [1], [0, 1]), row  # the first ends it
    assert "tiled_mlp must be a positive number" in row["error"] and row["failed_phase"] == "set-up"
    assert row["wall_s"] < 200
    ladder.rows.append(row)
    assert ladder.next_length(1e9, 1e9, 2) is None and "without running out" in ladder.stopped


def test_a_second_run_the_same_day_adds_to_the_results(tmp_path):
    runner = _runner()
    args = runner.parse_args(["run", "--out", str(tmp_path), "--device", "cpu", "--gpus", "2",
                              "--models", "tiny", "--gpu-gib", "1.6", "--host-gib", "1"])
    m = runner.machine(args)
    path, rows, ladders = runner.results_file(args, m)
    assert path.name.startswith("maxctx-cpu-x2-") and rows == [] and ladders == {}
    earlier = [{"model": "7b", "impl": "ours", "variant": "v", "seq": 8192, "step_s": 1.0}]
    path.write_text(json.dumps({"kind": "maxctx-ladder", "rows": earlier, "ladders": {"7b": {"ours": {}}}}))
    run = runner.Run(args, m, runner.make_ladders(args, m))
    assert run.path == path and run.rows == earlier and set(run.ladders_meta()) == {"7b", "tiny"}
    assert run.meta["models"] == {"7b": "Llama-2-7B", "tiny": "tiny"}
    path.write_text(json.dumps({"rows": [], "summary": {}}))  # a bench_train.py --maxctx file
    assert runner.results_file(args, m)[0].name.endswith("-ladder.json")


def test_run_in_the_foreground_makes_its_results_folder(tmp_path, monkeypatch):
    """``run`` (what ``start`` detaches) writes its results and state into ``--out`` even when that
    folder does not exist yet."""
    runner = _runner()
    out = tmp_path / "new" / "ladder"
    args = runner.parse_args(["run", "--out", str(out), "--device", "cpu", "--gpus", "2",
                              "--models", "tiny", "--gpu-gib", "1.6", "--host-gib", "1"])
    monkeypatch.setattr(runner, "_climb_once", lambda *a: False)
    runner.run(args)
    state = json.loads((out / runner.STATE).read_text())
    assert state["status"] == "done" and Path(state["results"]).parent == out
    assert json.loads(Path(state["results"]).read_text())["kind"] == "maxctx-ladder"


def test_alst_ladder_starts_at_the_planners_estimate_or_says_why_it_is_skipped(monkeypatch):
    """ALST is the third ladder: its reach variant, its first rung at the estimate for what it keeps (the
    terms of torch CP with the optimizer on the host), and a skip row's reason where DeepSpeed is absent;
    its rows enter the summary beside torch CP's."""
    from benchlib.ladder import ALST_VARIANT, alst_start

    runner = _runner()
    plan = ["plan", "--gpus", "4", "--models", "8b", "--gpu-gib", "79.1", "--host-gib", "512"]
    args = runner.parse_args(plan)
    m = runner.machine(args)
    ladders = {ladder.impl: ladder for ladder in runner.make_ladders(args, m)}
    peer = alst_start(SHAPES["8b"], 4, m["gpu_budget_bytes"], m["host_budget_bytes"], 8192, 60 * 15 / 2)
    assert ladders["alst"].variant == ALST_VARIANT and ladders["alst"].start == peer["start"] > 0
    monkeypatch.setattr(runner, "alst_unavailable", lambda: "no DeepSpeed here")
    assert runner.make_ladders(args, m)[-1].stopped == "skipped: no DeepSpeed here"
    args = runner.parse_args([*plan, "--impls", "ours,torch_cp"])
    assert [ladder.impl for ladder in runner.make_ladders(args, m)] == ["ours", "torch_cp"]
    rows = [{"model": "8b", "impl": "ours", "variant": "remat", "seq": 1024, "step_s": 1.0},
            {"model": "8b", "impl": "alst", "variant": ALST_VARIANT, "seq": 512, "step_s": 1.0},
            {"model": "8b", "impl": "alst", "variant": ALST_VARIANT, "seq": 768, "error": "out of memory"}]
    s = summarize(rows)
    assert (s["max_context_alst"], s["max_context_ratio_vs_alst"]) == (512, 2.0)
    assert s["max_context_ratio_vs_alst_at_least"] == pytest.approx(1024 / 768)


def test_a_launch_that_wrote_no_row_says_why():
    from benchlib.ladder import rung_status
    from benchlib.rungs import why_the_launch_failed

    trailer = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "  rank      : 0"]
    killed = why_the_launch_failed([*trailer, "  exitcode  : -9 (pid: 1352)",
                                    "  traceback : Signal 9 (SIGKILL) received by PID 1352"], 1)
    assert rung_status(killed) == "oom" and killed["failed_phase"] == "host"
    missing = why_the_launch_failed(["Traceback (most recent call last):", '  File "x.py", line 1',
                                     "ModuleNotFoundError: No module named 'pydantic'", *trailer], 1)
    assert rung_status(missing) == "error" and "No module named 'pydantic'" in missing["error"]
    nccl = why_the_launch_failed(["NCCL WARN Cuda failure 'out of memory'", *trailer], 1)
    assert rung_status(nccl) == "oom"
