"""Out of device memory on GPUs, and the allocator the fine-tune's workers start with.

* A process set up as a worker of ``lightseq-finetune`` is (the variable set after torch is imported, before
  the first CUDA allocation) gets a CUDA allocator with expandable segments; a user's setting is kept.
* ``scripts/finetune.py`` through ``accelerate launch`` (FSDP2, 2 GPUs, NCCL) at a context the planner
  puts far past this GPU (2 layers of the 7B widths, twice the longest context the planner fits on this
  card: 1M tokens on an 80 GB card, about 2M on a 141 GB one): every rank ends within seconds with one
  line, the rank that ran out naming the planner's advice for this GPU, the other rank the same line;
  status 1; no worker traceback.

Run on a machine with at least 2 GPUs: ``python -m pytest tests/gpu/test_out_of_memory_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import torch
from lightseq_hf.training.processes.launch import use_expandable_segments
print(use_expandable_segments())  # what a worker does before training: torch imported, CUDA untouched
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
snapshot = torch.cuda.memory._snapshot()
expandable = [s.get("is_expandable") for s in snapshot["segments"]]
settings = snapshot.get("allocator_settings", {})
print("EXPANDABLE", any(expandable) or bool(settings.get("expandable_segments")))
"""


def _probe(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(env_extra, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_workers_allocate_with_expandable_segments_unless_the_user_chose():
    out = _probe({})
    assert "EXPANDABLE True" in out and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out, out
    out = _probe({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert "EXPANDABLE False" in out and "(set by the user)" in out, out


CONFIG = "configs/llama2-7b-32k-2gpu.yaml"
OVERRIDES = ["model.config.num_hidden_layers=2", "training.grad_accum=1", "training.max_steps=2",
             "parity.enabled=false", "logging.eval_every=0", "data.synthetic.eval_samples=0",
             "logging.progress_bar=false", "saving.final=false"]
#: contexts are multiples of this (every rank's share a multiple of the kernels' tiles)
STEP = 65536


def exhausting_context() -> int:
    """Twice the longest context the planner fits in this card's memory (FSDP over 2 GPUs): a step that
    needs about twice what the card has, whatever its size."""
    from dataclasses import replace

    from lightseq_hf.planner import longest_context, plan_memory
    from lightseq_hf.training.config import load_config
    from lightseq_hf.training.planning import plan_inputs

    card = torch.cuda.get_device_properties(0).total_memory
    cfg = load_config(ROOT / CONFIG, [*OVERRIDES, f"context_length={STEP}",
                                      f"model.config.max_position_embeddings={STEP}"])
    shape, opts = plan_inputs(cfg, 2, "fsdp")
    context = 2 * max(longest_context(shape, opts, card, step=STEP), STEP)
    assert plan_memory(shape, replace(opts, context=context)).device_total > 1.5 * card
    return context


def test_out_of_memory_is_one_line_on_every_rank():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    context = exhausting_context()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/accelerate/1node-8gpu-fsdp.yaml"), "--num_processes", "2",
           "scripts/finetune.py", CONFIG, f"context_length={context}",
           f"model.config.max_position_embeddings={context}", *OVERRIDES,
           f"output_dir={ROOT / 'runs' / 'gpu-oom-test'}", "saving.if_output_exists=archive"]
    tic = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - tic
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-6000:]
    lines = [line for line in out.splitlines() if "ran out of memory in" in line]
    assert len(lines) == 2, out[-6000:]
    own = [line for line in lines if line.startswith("lightseq-finetune: stopped: rank ")]
    other = [line for line in lines if line.startswith("lightseq-finetune: stopped on rank ")]
    assert len(own) + len(other) == 2 and own, lines  # both may run out at once: each names itself
    assert all("GiB allocated" in line and "the planner, for" in line and "context_length=" in line
               for line in lines), lines
    assert out.count("Traceback") == out.count("raise ChildFailedError("), out[-6000:]
    print(f"\n{context} tokens, {wall:.0f} s; {lines[0]}")
