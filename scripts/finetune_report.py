"""Join ``scripts/finetune.py`` runs and ``scripts/bench_train.py`` results of one GPU call into one JSON.

    python scripts/finetune_report.py --out benchmarks/results/finetune-h200-x2-2026-11-22.json \\
        --run 7b-64k RUN_DIR "COMMAND" --bench 7b-64k BENCH.json 65536 remat

Per run: the median of the steps after the first (warm-up) for step time, tokens/s and MFU, every
rank's peak memory, the losses. The summary holds ``tokens_per_s`` per run and ``vs_bench_train``:
the run's tokens/s over ``bench_train.py``'s for the same shape, length and checkpointing; ``--speedup RUN
BASE`` adds ``speedup_vs_<BASE>``: RUN's tokens/s over BASE's (the same job with another
``training.backend``, say ``--speedup cudnn_fe triton``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def run_row(name: str, run_dir: Path, command: str) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in recs if r.get("kind") == "train"]
    if not train:
        raise SystemExit(f"{run_dir}: no training steps in metrics.jsonl")
    timed = train[1:] or train
    config = json.loads((run_dir / "config.json").read_text())
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    row = {
        "name": name, "command": command, "context_length": config["context_length"],
        "world_size": summary.get("world_size"), "sp_size": summary.get("sp_size"),
        "checkpointing": config["training"]["checkpointing"], "grad_accum": config["training"]["grad_accum"],
        "model": config["model"]["config"], "steps": len(train), "timed_steps": len(timed),
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "losses": [r["loss"] for r in train],
        "peak_mem_gib_per_rank": [max(r["peak_mem_gib_per_rank"][i] for r in train)
                                  for i in range(len(train[0].get("peak_mem_gib_per_rank", [])))],
    }
    if "mfu" in train[0]:
        row["mfu"] = statistics.median(r["mfu"] for r in timed)
        row["tflops_per_gpu"] = statistics.median(r["tflops_per_gpu"] for r in timed)
    row["device"] = summary.get("device")
    return row


def bench_tokens_per_s(path: Path, seq: int, variant: str) -> float:
    data = json.loads(path.read_text())
    for row in data["rows"]:
        if row["seq"] == seq and row["variant"] == variant and "tokens_per_s" in row:
            return row["tokens_per_s"]
    raise SystemExit(f"{path}: no {variant} row at {seq} tokens")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--run", nargs=3, action="append", default=[], metavar=("NAME", "DIR", "COMMAND"))
    p.add_argument("--bench", nargs=4, action="append", default=[],
                   metavar=("NAME", "JSON", "SEQ", "VARIANT"))
    p.add_argument("--speedup", nargs=2, action="append", default=[], metavar=("RUN", "BASE"))
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    rows = [run_row(name, Path(d), cmd) for name, d, cmd in args.run]
    result = report(rows, [(name, Path(path), int(seq), variant) for name, path, seq, variant in args.bench],
                    args.speedup, args.note)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


def report(rows: list[dict], benches: list[tuple[str, Path, int, str]], speedups: list[tuple[str, str]],
           note: str = "") -> dict:
    """The results file: the runs' rows and the summary (tokens/s, ``vs_bench_train``, ``speedup_vs_*``)."""
    summary: dict = {"tokens_per_s": {r["name"]: r["tokens_per_s"] for r in rows}, "vs_bench_train": {}}
    for name, path, seq, variant in benches:
        bench = bench_tokens_per_s(path, seq, variant)
        row = next(r for r in rows if r["name"] == name)
        row["bench_train_tokens_per_s"] = bench
        summary["vs_bench_train"][name] = row["tokens_per_s"] / bench
    for name, base in speedups:
        tokens = summary["tokens_per_s"]
        if name not in tokens or base not in tokens:
            raise SystemExit(f"--speedup {name} {base}: runs are {', '.join(tokens)}")
        summary[f"speedup_vs_{base}"] = tokens[name] / tokens[base]
    return {"device": rows[0]["device"] if rows else None, "note": note, "rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
