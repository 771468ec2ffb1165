"""The memory planner against measured peaks: a tiny Llama on the CPU (the process's peak resident
memory over one forward/backward, measured in a fresh process whose C allocator returns freed
memory at once) and the committed 7B GPU runs; and what each memory option moves where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_MEASURE = r"""
import json, sys, torch, transformers, lightseq_hf
from lightseq_hf.memory import HostPeak
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
out = []
for ck, tile, n in json.loads(sys.argv[2]):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="eager"))
    lightseq_hf.patch_model(model, checkpointing="remat" if ck == "none" else ck, tiled_mlp=tile)
    if ck != "none":
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, cfg["vocab_size"], (1, n))
    for _ in range(2):  # the second step is measured (lazy allocations done)
        model.zero_grad(set_to_none=True)
        with HostPeak() as peak:
            model(input_ids=ids, labels=ids).loss.backward()
    out.append(peak.increase_bytes)
print(json.dumps(out))
"""

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
#: (checkpointing, tiled_mlp tokens, context)
CPU_CASES = [("hf", None, 4096), ("remat", None, 4096), ("remat", 512, 4096), ("none", None, 2048)]


def test_planner_against_measured_cpu_peaks():
    from lightseq_hf.planner import ModelShape, PlanOptions, plan_memory

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure peak resident memory")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(TINY), json.dumps(CPU_CASES)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    measured = json.loads(res.stdout.strip().splitlines()[-1])
    shape = ModelShape.from_config(TINY)
    report = []
    for (ck, tile, n), meas in zip(CPU_CASES, measured):
        plan = plan_memory(shape, PlanOptions(context=n, sharding="replicated", compute_dtype="float32",
                                              checkpointing=ck, tiled_mlp=tile, optimizer_state=False,
                                              attention_kernel="reference"))
        # the weights were resident before the measured block; no optimizer step ran
        pred = max(v for k, v in plan.moments.items() if k != "optimizer step") - plan.gpu.get(
            "weights (master, this rank's shard)", 0)
        report.append((ck, tile, n, meas, pred, (pred - meas) / meas))
    assert measured[2] < measured[1]  # tiling the MLP lowers the measured peak
    bad = [r for r in report if abs(r[-1]) > 0.10]
    assert not bad, "\n".join(f"{r[:3]}: measured {r[3]} predicted {r[4]:.0f} ({r[5]:+.1%})" for r in report)


def test_planner_matches_committed_gpu_peaks():
    """Every committed peak of ours (and the unpatched one-GPU runs) on H200s within 5%."""
    from lightseq_hf.planner import GIB, ModelShape, PlanOptions, plan_memory

    checked = 0
    for path in sorted((ROOT / "benchmarks/results").glob("train-h200-*.json")):
        data = json.loads(path.read_text())
        hidden, inter, layers, heads, kv_heads, vocab = data["shape"]
        shape = ModelShape(hidden, inter, layers, heads, kv_heads, hidden // heads, vocab)
        for row in data["rows"]:
            if row["variant"] not in ("remat", "hf", "single") or not row.get("peak_gib"):
                continue
            first_step = bool(row.get("search")) and not row.get("optimizer_state_preallocated")
            plan = plan_memory(shape, PlanOptions(
                context=row["seq"], sp_size=data["world"], world=data["world"],
                checkpointing="hf" if row["variant"] == "single" else row["variant"],
                optimizer_state=not first_step))
            measured = max(row["peak_gib"])
            error = abs(plan.peak_gpu / GIB - measured) / measured
            assert error < 0.05, (path.name, row["seq"], row["variant"], error)
            checked += 1
    assert checked >= 9


def test_memory_options_move_memory():
    from lightseq_hf.planner import GIB, ModelShape, PlanOptions, longest_context, plan_memory

    shape = ModelShape(4096, 11008, 32, 32, 32, 128, 32000)
    base = PlanOptions(context=262144, sp_size=2, world=2)
    plain = plan_memory(shape, base)
    offload = plan_memory(shape, PlanOptions(**{**base.__dict__, "offload_checkpoints": True}))
    tiled = plan_memory(shape, PlanOptions(**{**base.__dict__, "tiled_mlp": 8192}))
    cpu = plan_memory(shape, PlanOptions(**{**base.__dict__, "cpu_offload": True}))
    kept = 32 * 131072 * (4096 * 2 * 2 + 32 * 4)  # input + out (bf16) + lse per layer and token
    assert plain.gpu["kept by checkpointing"] == kept
    assert offload.host["offloaded_checkpoints"] == kept
    assert offload.gpu["kept by checkpointing"] <= kept / 16  # at most two layers on the device
    assert tiled.gpu["one layer's recompute + backward"] < plain.gpu["one layer's recompute + backward"]
    assert cpu.gpu["optimizer state (AdamW)"] == 0 and cpu.host["optimizer_state"] > 25 * GIB
    limits = [longest_context(shape, PlanOptions(**{**base.__dict__, **o}), 139 * GIB)
              for o in ({}, {"offload_checkpoints": True}, {"offload_checkpoints": True, "tiled_mlp": 8192})]
    assert limits[0] < limits[1] < limits[2]
    at = lambda n: plan_memory(shape, PlanOptions(**{**base.__dict__, "context": n})).peak_gpu  # noqa: E731
    assert at(limits[0]) <= 139 * GIB < at(limits[0] + 8192)
    with pytest.raises(ValueError, match="not divisible by sp_size"):
        plan_memory(shape, PlanOptions(context=1001, sp_size=2))


def test_config_keys_and_cli_plan(capsys):
    from lightseq_hf.training.cli import main
    from lightseq_hf.training.config import ConfigError, load_config

    cfg = ROOT / "configs/llama2-7b-32k-2gpu.yaml"
    loaded = load_config(cfg, ["training.offload_checkpoints=true", "training.tiled_mlp=8192"])
    assert loaded.training.offload_checkpoints and loaded.training.tiled_mlp == 8192
    with pytest.raises(ConfigError, match="training.tiled_mlp: input should be greater than 0"):
        load_config(cfg, ["training.tiled_mlp=0"])
    with pytest.raises(ConfigError, match="training.offload_checkpoints needs checkpointing"):
        load_config(cfg, ["training.offload_checkpoints=true", "training.checkpointing=none"])
    argv = [str(cfg), "training.offload_checkpoints=true", "--plan", "--world", "2", "--host-gib", "128"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "peak device memory per rank" in text and "offloaded_checkpoints" in text
    assert "longest context that fits 139 GiB device and 128 GiB host" in text


def test_offload_auto_and_partial_offload(capsys):
    """offload_checkpoints N keeps the last layers on the device; ``auto`` picks the fewest layers that fit
    the device (launch: ``resolve_auto_offload``; ``--plan`` prints it) and refuses a host too small."""
    from lightseq_hf.planner import GIB, ModelShape, PlanOptions, layers_to_offload, plan_memory
    from lightseq_hf.training.cli import main
    from lightseq_hf.training.config import ConfigError, load_config
    from lightseq_hf.training.planning import resolve_auto_offload

    shape = ModelShape(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, head_dim=128,
                       vocab=32000)
    opts = PlanOptions(context=589824, sp_size=2, world=2, tiled_mlp=8192)
    by_layers = [plan_memory(shape, PlanOptions(**{**opts.__dict__, "offload_checkpoints": n}))
                 for n in (0, 8, 24, 32)]
    gpu = [p.peak_gpu for p in by_layers]
    host = [p.peak_host for p in by_layers]
    assert gpu == sorted(gpu, reverse=True) and host == sorted(host) and host[0] == 0
    assert host[3] == 4 * host[1]  # the host holds exactly the offloaded layers' checkpoints
    n = layers_to_offload(shape, opts, 132 * GIB, 110 * GIB)
    assert n == 24  # as measured on 2 x H200 at 576K (benchmarks/results/maxctx-h200-x2-2026-11-22.json)
    def peak(layers):
        return plan_memory(shape, PlanOptions(**{**opts.__dict__, "offload_checkpoints": layers})).peak_gpu

    assert peak(n) <= 132 * GIB < peak(n - 1)

    config = ROOT / "configs/llama2-7b-64k.yaml"
    cfg = load_config(config, ["context_length=589824", "training.tiled_mlp=8192",
                               "training.offload_checkpoints=auto"])
    assert resolve_auto_offload(cfg, 2, "fsdp", 132 * GIB, 110 * GIB) == 24
    with pytest.raises(ConfigError, match="do not fit 50 GiB of host memory per rank"):
        resolve_auto_offload(cfg, 2, "fsdp", 132 * GIB, 50 * GIB)
    argv = [str(config), "context_length=589824", "training.tiled_mlp=8192",
            "training.offload_checkpoints=auto",
            "--plan", "--world", "2", "--gpu-gib", "132", "--host-gib", "110"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "offload_checkpoints auto: 24 of 32 layers offloaded at this context" in text
    assert "longest context that fits 132 GiB device and 110 GiB host memory per rank: 589824" in text
    with pytest.raises(ConfigError, match="offload_checkpoints"):
        load_config(config, ["training.offload_checkpoints=-1"])
