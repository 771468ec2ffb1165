"""The GPU runs of the benchmark and check scripts: small shapes, each script's GPU path end to end.

``tests/gpu/test_scripts_gpu.py`` runs them and checks their results files; ``tests/test_script_surface.py``
checks on the CPU that every option they pass exists. ``{out}`` in an argument is the run's output folder.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScriptRun:
    script: str  # in scripts/
    gpus: int  # processes, one GPU each (torchrun when more than one)
    args: tuple[str, ...]
    results: str  # glob of the results file under {out}; "stdout": the script prints one JSON object
    timeout: int = 300


RUNS = (
    ScriptRun("bench_dist_attn.py", 2, (
        "--seqs", "8192", "--heads", "32/32,32/8", "--reps", "2", "--backends", "sdpa_cudnn", "--replay",
        "--trace", "--trace-seq", "8192", "--out", "{out}"), "dist-*-x2-*.json"),
    ScriptRun("bench_bytes_per_token.py", 1, (
        "--model", "tiny", "--tokens-per-rank", "2048,4096", "--warmup-tokens", "1024", "--tile", "1024",
        "--out", "{out}"), "bytes-per-token-*.json"),
    ScriptRun("bench_kernels.py", 1, (
        "--seqs", "1024", "--head-dims", "64", "--heads", "4/4", "--warmup", "1", "--rep", "3",
        "--out", "{out}"), "kernels-*.json"),
    ScriptRun("bench_packed.py", 2, (
        "--seqs", "4096", "--check-seq", "2048", "--median", "256", "--max-doc", "1024", "--heads", "8/2",
        "--dim", "64", "--reps", "1", "--out", "{out}"), "packed-*-x2-*.json", timeout=420),
    ScriptRun("bench_packed_kernels.py", 1, (
        "--seqs", "4096", "--dims", "64", "--heads", "8/2", "--extra-dim-seq", "", "--flex-seqs", "",
        "--median", "256", "--max-doc", "1024", "--stream", "3", "--stream-seq", "4096", "--stream-heads",
        "8/2", "--out", "{out}"), "packed-kernels-*.json"),
    ScriptRun("bench_prefill.py", 2, (
        "--seqs", "2048", "--impls", "single,ours,torch_cp", "--reps", "1", "--out", "{out}"),
        "prefill-*-x2-*.json"),
    ScriptRun("bench_train.py", 2, (
        "--model", "7b-gqa", "--seqs", "4096", "--variants", "remat,torch_cp", "--steps", "2",
        "--out", "{out}"), "train-*-x2-*.json", timeout=420),
    ScriptRun("replay_packed.py", 1, (
        "--seqs", "8192", "--worlds", "2", "--layouts", "1", "--heads", "8/2", "--dim", "64",
        "--median", "256", "--max-doc", "1024", "--reps", "1", "--calls", "--out", "{out}/replay.jsonl"),
        "replay.jsonl"),
    ScriptRun("check_finetune_memory.py", 1, (
        "--layers", "2", "--context", "4096", "--steps", "2", "--variants", "library,accum2_no_sync"),
        "stdout", timeout=420),
    ScriptRun("sweep_passkey.py", 1, (
        "--configs", "1", "--steps", "25", "--length", "1024", "--out", "{out}"), "sweep.jsonl"),
)
