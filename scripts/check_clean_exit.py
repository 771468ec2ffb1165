"""Count clean exits of consecutive multi-process runs of a patched model on the CPU (gloo).

Each run is ``torchrun --nproc_per_node N`` of this script's worker: a tiny Llama patched with
``lightseq_hf.patch``, a few forward/backward steps with remat checkpointing over the sequence-parallel
group, then one of two endings: ``--ending user`` (a barrier, ``destroy_process_group``, a normal return,
as a user's script ends) or ``--ending flush_exit`` (output flushed, then ``os._exit``: how the workers of
``lightseq-finetune`` end, skipping the interpreter finalization during which gloo's threads can abort a
rank). A run is clean when every rank exits 0; anything else (an abort at exit, a hang past the timeout)
is recorded with the lines of its output that say why.

    python scripts/check_clean_exit.py --runs 50 --nproc 3 --out benchmarks/results/clean-exit-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout that was never installed

ROOT = Path(__file__).resolve().parent.parent


def worker(steps: int, ending: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    import lightseq_hf

    dist.init_process_group("gloo")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    model = lightseq_hf.patch(transformers.LlamaForCausalLM(config))
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        lightseq_hf.sync_gradients(model)
    dist.barrier()
    if ending == "flush_exit":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def _why(output: str) -> str:
    """The lines of a failed run's output that say what happened (aborts, signals, errors)."""
    words = ("abort", "terminate", "what()", "Error", "error", "Signal", "exitcode")
    return "\n".join(line for line in output.splitlines() if any(w in line for w in words))[-3000:]


def one_run(nproc: int, steps: int, timeout: float, ending: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", "--steps", str(steps), "--ending", ending]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = "timeout", str(expired.stdout or "")
    seconds = round(time.perf_counter() - start, 1)
    return {"exit": code, "seconds": seconds, "why": "" if code == 0 else _why(output)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--ending", choices=("user", "flush_exit"), default="user")
    parser.add_argument("--out", type=Path, help="results JSON")
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.ending)
        return 0
    import torch
    import transformers

    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.nproc, args.steps, args.timeout, args.ending))
        print(f"run {i + 1}/{args.runs}: exit {runs[-1]['exit']} in {runs[-1]['seconds']} s", flush=True)
    clean = sum(r["exit"] == 0 for r in runs)
    result = {"date": datetime.date.today().isoformat(), "device": f"CPU, {os.cpu_count()} cores (gloo)",
              "load_average_1min_at_end": os.getloadavg()[0], "torch": torch.__version__,
              "transformers": transformers.__version__, "nproc": args.nproc, "steps": args.steps,
              "ending": args.ending,
              "runs": len(runs), "clean": clean, "failures": [r for r in runs if r["exit"] != 0],
              "seconds": [r["seconds"] for r in runs]}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{clean} of {len(runs)} runs exited cleanly on every rank")
    return 0 if clean == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
