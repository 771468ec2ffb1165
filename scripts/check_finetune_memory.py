"""The fine-tune's peak device memory against the planner and against the two ways it could hold more than
a training step needs, on one GPU. Prints one JSON object.

    python scripts/check_finetune_memory.py [--layers 8] [--context 32768] [--steps 3]

Every variant is a real ``lightseq-finetune`` run of configs/llama2-7b-64k.yaml (Llama-2-7B widths, the
layer count cut to ``--layers``) under the accelerate FSDP2 config (bf16), one process, random weights,
``--steps`` steps; its peak is the largest ``peak_mem_gib_per_rank`` the run logged:

* ``library`` — as shipped;
* ``held_parameter_lists`` — the same, with a list of the model's parameters from before ``prepare`` kept
  alive (what a trainer that builds AdamW's groups in its own frame does): expected higher by the float32
  model (``full_fp32_model_gib``), which FSDP2 has copied into sharded storage;
* ``accum2`` — ``training.grad_accum=2`` as shipped (FSDP reduces every micro-batch): expected as
  ``library``;
* ``accum2_no_sync`` — the same with ``no_sync`` on the first micro-batch: expected higher by the bf16
  model (``bf16_model_gib``), every layer's unsharded gradient kept until the last micro-batch.

``planner_gib`` is ``lightseq_hf.planner``'s prediction for the shipped run; ``planner_error`` its relative
error against ``library``.

``--device cpu`` is the smoke run: configs/tiny.yaml on one CPU process (no FSDP, no device peaks: every
variant runs and reports its step times, ``peak_gib`` is null), e.g.
``python scripts/check_finetune_memory.py --device cpu --layers 2 --context 256 --steps 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
#: device -> (fine-tune config, accelerate config)
CONFIGS = {"cuda": (ROOT / "configs/llama2-7b-64k.yaml", ROOT / "configs/accelerate/1node-8gpu-fsdp.yaml"),
           "cpu": (ROOT / "configs/tiny.yaml", ROOT / "configs/accelerate/cpu-2proc.yaml")}
VARIANTS = ("library", "held_parameter_lists", "accum2", "accum2_no_sync")


def overrides(args: argparse.Namespace, variant: str, out_dir: Path) -> list[str]:
    device = ["training.device=cpu"] if args.device == "cpu" else []
    return [*device, f"model.config.num_hidden_layers={args.layers}", f"context_length={args.context}",
            f"model.config.max_position_embeddings={args.context}", "sp_size=1",
            f"training.max_steps={args.steps}", f"training.grad_accum={2 if 'accum2' in variant else 1}",
            "data.synthetic.eval_samples=0", "saving.final=false", "saving.every=0",
            "logging.progress_bar=false", "logging.plot=false", "logging.eval_every=0",
            f"output_dir={out_dir}"]


def worker(variant: str, argv: list[str]) -> int:
    """One run of the fine-tune in this process, with the variant's change installed."""
    from lightseq_hf._testing.trainer_variants import keep_parameter_lists, no_sync_until_last_micro_batch
    from lightseq_hf.training import cli

    changes = {"held_parameter_lists": keep_parameter_lists, "accum2_no_sync": no_sync_until_last_micro_batch}
    with changes.get(variant, contextlib.nullcontext)():
        return cli.main(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(args: argparse.Namespace, variant: str, tmp: Path) -> dict:
    from lightseq_hf.training.processes.launch import accelerate_env, worker_env

    config, accelerate_config = CONFIGS[args.device]
    out_dir = tmp / variant
    env = worker_env(accelerate_env(str(accelerate_config), 1), 0, 1, free_port())
    cmd = [sys.executable, __file__, "--worker", variant, str(config), *overrides(args, variant, out_dir)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    peaks = [max(r["peak_mem_gib_per_rank"]) for r in train if "peak_mem_gib_per_rank" in r]  # CUDA only
    return {"peak_gib": max(peaks, default=None), "peak_gib_per_step": peaks,
            "step_s": [round(r["step_time_s"], 3) for r in train]}


def planned_gib(args: argparse.Namespace) -> tuple[float, dict]:
    from dataclasses import replace

    from lightseq_hf.planner import GIB, plan_memory
    from lightseq_hf.training.config import load_config
    from lightseq_hf.training.planning import plan_inputs

    config = CONFIGS[args.device][0]
    cfg = load_config(config, overrides(args, "library", Path(tempfile.gettempdir()) / "plan"), world_size=1)
    shape, opts = plan_inputs(cfg, 1, "fsdp")
    plan = plan_memory(shape, replace(opts, sharding="fsdp"))  # accelerate's FSDP2 even on one process
    return plan.peak_gpu / GIB, {"params": shape.params, "moment": plan.moment}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma separated, from the list above")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the smoke run (configs/tiny.yaml, no device peaks)")
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return worker(args.worker, rest)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown --variants {', '.join(sorted(set(variants) - set(VARIANTS)))}; "
                f"choose from {', '.join(VARIANTS)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "needs a CUDA GPU (--device cpu: the smoke run)"}))
        return 1
    planned, shape = planned_gib(args)
    with tempfile.TemporaryDirectory(prefix="finetune-memory-") as tmp:
        results = {v: run_variant(args, v, Path(tmp)) for v in variants}
    gib = 2**30
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    out = {"device": device, "torch": torch.__version__,
           "layers": args.layers, "context": args.context, "steps": args.steps, **shape,
           "full_fp32_model_gib": shape["params"] * 4 / gib, "bf16_model_gib": shape["params"] * 2 / gib,
           "planner_gib": planned, "variants": results}
    peak = {v: results.get(v, {}).get("peak_gib") for v in VARIANTS}
    if peak["library"] is not None:
        out["planner_error"] = (planned - peak["library"]) / peak["library"]
        if peak["held_parameter_lists"] is not None:
            out["held_minus_library_gib"] = peak["held_parameter_lists"] - peak["library"]
        if peak["accum2"] is not None and peak["accum2_no_sync"] is not None:
            out["accum2_minus_library_gib"] = peak["accum2"] - peak["library"]
            out["no_sync_minus_sync_gib"] = peak["accum2_no_sync"] - peak["accum2"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
