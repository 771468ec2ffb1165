"""The benchmark scripts' summaries: the README's headline numbers are computed by these functions."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_train():
    return _load("bench_train")


def _row(variant, seq, step_s=None, error=None, search=False, warmup=False):
    row = {"variant": variant, "seq": seq, "search": search, "includes_warmup": warmup}
    if step_s is not None:
        row.update(step_s=step_s, mfu=0.5)
    else:
        row["error"] = error
    return row


def test_train_summary_ratios_and_search(bench_train):
    rows = [
        _row("remat", 65536, 8.0), _row("hf", 65536, 10.0), _row("torch_cp", 65536, 9.0),
        _row("remat", 131072, 20.0), _row("torch_cp", 131072, 25.0),
        _row("remat", 262144, 70.0, search=True), _row("remat", 294912, error="out of memory", search=True),
        _row("torch_cp", 262144, 90.0, search=True),
        _row("torch_cp", 294912, error="Traceback: some bug", search=True),  # not a memory limit
    ]
    s = bench_train.summarize(rows, world=2)
    assert s["remat_vs_hf_ckpt_32k_per_gpu"] == pytest.approx(10 / 8)
    assert s["vs_torch_cp_64k"] == pytest.approx(9 / 8)
    assert s["vs_torch_cp_128k"] == pytest.approx(25 / 20)
    assert s["vs_torch_cp_256k"] == pytest.approx(90 / 70)
    assert s["max_context_ours"] == 262144 and s["first_failed_context_ours"] == 294912
    # a crash is not an out-of-memory bound: no first failure is claimed
    assert s["max_context_torch_cp"] == 262144 and s["first_failed_context_torch_cp"] is None
    assert s["max_context_ours_vs_torch_cp"] == 1.0
    assert s["mfu_128k"] == 0.5
    assert "max_context_first_step_only" not in s
    # a one-step probe holds a steady-state step's memory only if the AdamW state came first
    probe = {**_row("remat", 327680, 90.0, search=True, warmup=True), "optimizer_state_preallocated": True}
    assert "max_context_first_step_only" not in bench_train.summarize(rows + [probe], world=2)
    rows.append(_row("remat", 327680, error="out of memory", search=True, warmup=True))
    assert bench_train.summarize(rows, world=2)["max_context_first_step_only"] is True


def test_preallocated_adamw_state_gives_identical_updates(bench_train):
    """The search's probes allocate AdamW's state up front: same memory as a later step, same
    parameters after every step as the lazily allocated state."""
    torch.manual_seed(0)
    lazy_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    eager_model = copy.deepcopy(lazy_model)
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    eager = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    bench_train.allocate_adamw_state(eager)
    assert all(len(eager.state[p]) == 3 for p in eager_model.parameters())
    for _ in range(3):
        x = torch.randn(5, 8)
        for model, opt in ((lazy_model, lazy), (eager_model, eager)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for a, b in zip(lazy_model.parameters(), eager_model.parameters()):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="amsgrad"):
        bench_train.allocate_adamw_state(torch.optim.AdamW(lazy_model.parameters(), amsgrad=True))


def test_train_merge_keeps_rows_and_refuses_mixed_models(bench_train, tmp_path):
    meta = {"model": "7b", "world": 2, "notes": "n"}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({**meta, "rows": [_row("remat", 65536, 8.0)]}))
    b.write_text(json.dumps({**meta, "rows": [_row("torch_cp", 65536, 9.0)]}))
    out = tmp_path / "out.json"
    bench_train.merge(out, [a, b])
    merged = json.loads(out.read_text())
    assert [r["run"] for r in merged["rows"]] == ["a.json", "b.json"]
    assert merged["summary"]["vs_torch_cp_64k"] == pytest.approx(9 / 8)
    b.write_text(json.dumps({**meta, "model": "7b-gqa", "rows": []}))
    with pytest.raises(SystemExit, match="one model"):
        bench_train.merge(out, [a, b])


def test_dist_summary_uses_fastest_torch_cp_and_lengths_from_64k():
    bench = _load("bench_dist_attn")

    def row(impl, seq, ms, phase="fwd_bwd"):
        return {"impl": impl, "seq": seq, "heads": 32, "kv_heads": 32, "phase": phase, "ms": ms}

    rows = []
    for seq, ours, ag, a2a, single, compute in ((32768, 40, 30, 35, 60, 38), (65536, 100, 110, 105, 190, 98),
                                                (131072, 400, 420, 410, 760, 390)):
        rows += [row("ours_sdpa_cudnn", seq, ours), row("torch_cp_allgather_cudnn", seq, ag),
                 row("torch_cp_alltoall_cudnn", seq, a2a), row("single_cudnn", seq, single),
                 row("compute_only_sdpa_cudnn", seq, compute)]
    s = bench.summarize(rows, world=2)
    assert s["vs_torch_cp_min"] == pytest.approx(410 / 400)  # 32K (0.75) is not counted
    assert s["efficiency_128k"] == pytest.approx(760 / 800)
    assert s["efficiency_32k"] == pytest.approx(60 / 80)
    assert s["comm_overhead_64k"] == pytest.approx(100 / 98 - 1)


def test_dist_summary_p4_keys_efficiency_and_compute_spread():
    """The P = 4 keys: efficiency at 64K and 256K, and the spread of the per-rank compute-only
    forward+backward at 256K (slowest over fastest rank, minus 1)."""
    bench = _load("bench_dist_attn")

    def row(impl, seq, ms, phase="fwd_bwd", **extra):
        return {"impl": impl, "seq": seq, "heads": 32, "kv_heads": 32, "phase": phase, "ms": ms, **extra}

    rows = []
    for seq, ours, single, busy in ((65536, 66.0, 220.0, [60.0, 61.0, 59.0, 60.5]),
                                    (262144, 950.0, 3720.0, [886.0, 903.0, 818.0, 832.0]),
                                    (524288, 3700.0, None, [3500.0, 3510.0, 3490.0, 3505.0])):
        rows += [row("ours_sdpa_cudnn", seq, ours), row("torch_cp_allgather_cudnn", seq, ours * 1.01),
                 row("compute_only_sdpa_cudnn", seq, max(busy), per_rank_ms=busy),
                 row("compute_only_sdpa_cudnn", seq, max(busy) / 3, phase="fwd",
                     per_rank_ms=[x / 3 for x in busy[::-1]])]
        if single:
            rows.append(row("single_cudnn", seq, single))
    # a GQA compute-only row at 256K must not be taken for the 32/32 one
    rows.insert(0, {**row("compute_only_sdpa_cudnn", 262144, 1.0, per_rank_ms=[1.0, 2.0, 1.0, 1.0]),
                    "kv_heads": 8})
    s = bench.summarize(rows, world=4)
    assert s["efficiency_64k"] == pytest.approx(220 / (4 * 66))
    assert s["efficiency_256k"] == pytest.approx(3720 / (4 * 950))
    assert s["compute_spread_256k"] == pytest.approx(903 / 818 - 1)
    assert s["per_seq"]["262144"]["compute_spread_fwd"] == pytest.approx(903 / 818 - 1)
    assert s["per_seq"]["524288"]["compute_spread"] == pytest.approx(3510 / 3490 - 1)
    assert "efficiency" not in s["per_seq"]["524288"]  # no one-GPU row at 512K
    # a failed compute-only row (error, no per-rank times) gives no spread rather than a wrong one
    failed = [r for r in rows if not (r["seq"] == 262144 and r["impl"].startswith("compute_only"))]
    failed.append({"impl": "compute_only_sdpa_cudnn", "seq": 262144, "heads": 32, "kv_heads": 32,
                   "phase": "fwd_bwd", "error": "out of memory"})
    assert bench.summarize(failed, world=4)["compute_spread_256k"] is None



def test_dist_replay_runs_each_ranks_own_tasks():
    """--replay: rank r's tasks of the balanced schedule, forward then backward, one kernel call each."""
    bench = _load("bench_dist_attn")
    from lightseq_hf.kernels import get_kernel

    tasks = [(t.q_owner, t.kv_owner, t.parts) for t in bench.rank_tasks(4, 1)]
    assert tasks == [(1, 1, 1), (1, 0, 1), (3, 1, 2)]
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(1, 16, 4, 16, generator=g), torch.randn(1, 16, 4, 16, generator=g)
    k, v = torch.randn(1, 16, 2, 16, generator=g), torch.randn(1, 16, 2, 16, generator=g)
    run, calls = bench.make_replay(q, k, v, dout, get_kernel("reference", q.device), bench.rank_tasks(4, 0),
                                   True, 0.25)
    run()
    assert calls == [3, 3]
    run, calls = bench.make_replay(q, k, v, dout, get_kernel("reference", q.device), bench.rank_tasks(2, 1),
                                   False, 0.25)
    run()
    assert calls == [2, 0]


def test_offloadauto_rungs_take_the_plan_finetune_takes(bench_train):
    """``+offloadauto`` resolves as ``training.offload_checkpoints: auto`` does (the planner's
    ``choose_offload``, plain recompute included), so a rung runs the plan that chose its length: the
    8B shape at 504K on 2 x 80 GB with 115 GiB of host memory per rank needs plain recompute."""
    from benchlib.ladder import planner_inputs
    from benchlib.workloads import SHAPES

    from lightseq_hf.planner import choose_offload

    gpu_gib, host_gib, n = 75.7, 115.2, 516096
    got = bench_train.offload_option({"offloadauto", "tiled", "cpuadam"}, SHAPES["8b"], n, 2,
                                     torch.device("cpu"), (gpu_gib, host_gib), "remat")
    model, opts = planner_inputs("remat+offloadauto+tiled+cpuadam", SHAPES["8b"], n, 2)
    assert got == choose_offload(model, opts, gpu_gib * 2**30, host_gib * 2**30)
    assert got.recompute > 0 and got.layers >= got.recompute
    row = bench_train.planned("remat+offloadauto+tiled+cpuadam", SHAPES["8b"], n, 2, got, 8192)
    assert (row["offload_layers"], row["recompute_layers"]) == (got.layers, got.recompute)
    assert row["planned_host_gib"] <= host_gib
