"""Prefill benchmark: first-token latency of a long prompt (BurstAttention's Tables 2-3 measure).

Launch with torchrun, one process per GPU (multicast off on shared machines)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 4 scripts/bench_prefill.py --out benchmarks/results

One forward pass over the whole prompt, no gradient, no optimizer: a randomly initialised Llama-2-7B
shape (``benchlib.workloads.SHAPES``, as ``bench_train.py``; no download) with bf16 weights,
replicated on every GPU. Variants (``--impls``): ``ours`` (the patched model, ``use_cache=False`` so
the sequence-parallel path runs: every rank embeds and runs its contiguous slice of the prompt, the
attention is distributed), ``torch_cp`` (the unpatched model under torch's ``context_parallel`` over
SDPA cuDNN, head-tail load balancing, set up as ``bench_train.py``'s ``torch_cp``), ``single`` (the
unpatched model, SDPA cuDNN, on rank 0 alone). Only the last position's logits are computed
(``logits_to_keep=1``): no sequence-by-vocabulary logits. The latency is the median over ``--reps``
forwards after one warm-up, of the slowest rank. ``--single-from`` adds the one-GPU rows of an
earlier ``prefill-*-x1-*.json`` run, so that the summary has the speedup over one GPU. A length that
runs out of memory is a row with an ``error``; the variant skips longer lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when this file is loaded by path

from benchlib.exactness import any_rank, rel_err  # noqa: E402
from benchlib.launch import finish, free_memory, init_distributed  # noqa: E402
from benchlib.peers import torch_context_parallel  # noqa: E402
from benchlib.results import (  # noqa: E402
    MULTICAST_ENV,
    ResultsFile,
    device_name,
    env_vars,
    failure,
    find,
    results_path,
    run_meta,
)
from benchlib.timing import timed  # noqa: E402
from benchlib.workloads import SHAPES  # noqa: E402
from benchlib.workloads import build_model as build_random_llama  # noqa: E402

IMPLS = ("ours", "torch_cp", "single")
TORCH_CP_CPU_SKIP = ("torch's context_parallel shards only the flash, efficient and cuDNN SDPA kernels "
                     "(CUDA); not run on CPU")
#: logits of the last position kept in each row, to compare runs (e.g. ours on 4 GPUs against one)
LOGITS_HEAD = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7b", choices=sorted(SHAPES))
    p.add_argument("--seqs", default="32768,65536,131072,262144,524288", help="prompt lengths")
    p.add_argument("--impls", default="auto",
                   help=f"comma separated from {', '.join(IMPLS)}; auto: ours,torch_cp on several "
                        "processes, single on one")
    p.add_argument("--reps", type=int, default=3, help="timed forwards per length (after one warm-up)")
    p.add_argument("--backend", default=None, help="our local attention kernel (default: sdpa_cudnn on "
                                                   "CUDA, auto on CPU)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if available")
    p.add_argument("--single-from", default=None, metavar="PATH",
                   help="a prefill results JSON of one GPU: its single rows join this file's summary")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    args = p.parse_args(argv)
    unknown = set(args.impls.split(",")) - set(IMPLS) - {"auto"}
    if unknown:
        p.error(f"unknown --impls {', '.join(sorted(unknown))}: choose from {', '.join(IMPLS)}")
    return args


def build_model(shape, max_len: int, device: torch.device, dtype: torch.dtype):
    """The step benchmark's model (attention SDPA, no cache), same random weights on every rank, in
    ``dtype`` from the start (bf16 weights are never held in float32 on the GPU)."""
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_random_llama(shape, max_len, device)
    finally:
        torch.set_default_dtype(previous)
    if any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    model.eval()
    model.config.use_cache = False
    return model


class LocalLength:
    """Counts the tokens the first decoder layer runs on: the proof that the prompt was split."""

    def __init__(self, model) -> None:
        self.tokens: int | None = None
        layer = model.model.layers[0]
        self._handle = layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.tokens = int(hidden.shape[1])

    def remove(self) -> None:
        self._handle.remove()


def _last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the last position only (``logits_to_keep=1``), float32, ``(batch, vocab)``."""
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
    if logits.shape[1] != 1:
        raise RuntimeError(f"logits_to_keep=1 returned {logits.shape[1]} positions; expected only the last")
    return logits[:, -1].float()


def our_backend(args, device: torch.device) -> str:
    return args.backend or ("sdpa_cudnn" if device.type == "cuda" else "auto")


def run_impl(impl: str, model, ids: torch.Tensor, args, device: torch.device,
             world: int) -> tuple[float, torch.Tensor | None]:
    """Median ms of one variant's forward and its last-token logits (None where not the prompt's)."""
    import lightseq_hf

    if impl == "ours":
        lightseq_hf.patch_llama(model, backend=our_backend(args, device))
        fn = lambda: _last_logits(model, ids)  # noqa: E731
        return timed(fn, args.reps, device), fn()
    lightseq_hf.unpatch_llama()
    if impl == "single":
        return _run_single(model, ids, args, device)
    return _run_torch_cp(model, ids, args, device)


def measure(impl: str, model, ids: torch.Tensor, args, device: torch.device,
            world: int) -> tuple[dict, torch.Tensor | None]:
    """One variant at one length: its row and the last-token logits (on the rank that holds them)."""
    import lightseq_hf

    n = ids.shape[1]
    row: dict = {"seq": n, "impl": impl}
    if impl == "torch_cp" and device.type != "cuda":
        return {**row, "skipped": TORCH_CP_CPU_SKIP}, None
    if impl == "single" and dist.get_rank() != 0:  # rank 0 alone; the others wait
        dist.barrier()
        return {**row, "tokens_per_gpu": n, "world": 1}, None
    counter = LocalLength(model)
    if device.type == "cuda":
        free_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
    error = logits = None
    try:
        with torch.no_grad():
            ms, logits = run_impl(impl, model, ids, args, device, world)
        row.update(ms=ms, tokens_per_gpu=n if impl == "single" else n // world,
                   local_tokens=counter.tokens, world=1 if impl == "single" else world)
        if logits is not None:
            row["last_logits_head"] = [round(x, 5) for x in logits[0, :LOGITS_HEAD].tolist()]
    except Exception as err:  # noqa: BLE001 - recorded in the results
        fields = failure(err, limit=4)
        error = fields.pop("error")
        row.update(fields)
        logits = None
    finally:
        counter.remove()
        lightseq_hf.unpatch_llama()
    error = _agree_on_failure(row, error, impl, device, world)
    if error is not None:
        row = {k: v for k, v in row.items() if k not in ("ms", "last_logits_head")}
        row["error"] = error
        logits = None
    free_memory(device)
    return row, logits


def _agree_on_failure(row: dict, error: str | None, impl: str, device: torch.device,
                      world: int) -> str | None:
    """Peak memory into ``row`` (every rank's, but for ``single``); one failing rank fails the row on all."""
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if impl == "single":
        dist.barrier()
        return error
    if any_rank(error is not None, device) and error is None:
        error = "failed on another rank"
    peaks = [None] * world
    dist.all_gather_object(peaks, row.get("peak_gib"))
    if device.type == "cuda":
        row["peak_gib"] = peaks
    return error


def _run_single(model, ids, args, device):
    """The unpatched model on this GPU alone (SDPA cuDNN)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()
    with cudnn:
        fn = lambda: _last_logits(model, ids)  # noqa: E731
        return timed(fn, args.reps, device, collective=False), fn()


def _run_torch_cp(model, ids, args, device):
    """torch's context parallel, as ``bench_train.py``'s ``torch_cp``: the prompt sharded head-tail
    over the ranks, ring attention inside SDPA cuDNN. No position ids (head-tail shards would look
    like packed sequences to Transformers' mask code; RoPE positions do not change the work), so its
    logits are not those of the prompt and are not kept. The last position lies on rank 0."""
    inputs = ids.clone()
    with torch_context_parallel([inputs], [1], device):
        ms = timed(lambda: _last_logits(model, inputs), args.reps, device)
    return ms, None


def summarize(rows: list[dict], world: int) -> dict:
    """Per length: ours, torch CP and one GPU (ms), torch CP / ours, the speedup over one GPU."""
    def peak(impl, n):
        found = [r for r in rows if r["impl"] == impl and r["seq"] == n and r.get("peak_gib") and "ms" in r]
        if not found:
            return None
        p = found[0]["peak_gib"]
        return max(x for x in p if x is not None) if isinstance(p, list) else p

    per_seq = {}
    for n in sorted({r["seq"] for r in rows}):
        ours, cp, single = (find(rows, "ms", impl=impl, seq=n) for impl in ("ours", "torch_cp", "single"))
        entry = {"ours_ms": ours, "torch_cp_ms": cp, "single_ms": single,
                 "torch_cp_over_ours": cp / ours if ours and cp else None,
                 "speedup_vs_single": single / ours if ours and single else None,
                 "efficiency": single / (world * ours) if ours and single else None,
                 "ours_peak_gib": peak("ours", n), "torch_cp_peak_gib": peak("torch_cp", n),
                 "single_peak_gib": peak("single", n)}
        errors = {r["impl"]: r["error"].splitlines()[-1][:200] for r in rows
                  if r["seq"] == n and "error" in r}
        if errors:
            entry["errors"] = errors
        ours_rows = [r for r in rows if r["impl"] == "ours" and r["seq"] == n and "rel_err_vs_single" in r]
        if ours_rows:
            entry["ours_rel_err_vs_single"] = ours_rows[0]["rel_err_vs_single"]
        heads = {i: r["last_logits_head"] for r in rows if r["seq"] == n and "last_logits_head" in r
                 for i in (r["impl"],)}
        if "ours" in heads and "single" in heads:  # across runs too (--single-from): same weights, prompt
            entry["ours_logits_head_rel_err_vs_single"] = rel_err(torch.tensor(heads["ours"]),
                                                                  torch.tensor(heads["single"]))
        per_seq[str(n)] = entry
    ratios = [e["torch_cp_over_ours"] for e in per_seq.values() if e["torch_cp_over_ours"]]
    longest = [int(n) for n, e in per_seq.items() if e["ours_ms"]]
    return {"per_seq": per_seq, "torch_cp_over_ours_min": min(ratios) if ratios else None,
            "longest_ours": max(longest, default=None),
            "longest_torch_cp": max((int(n) for n, e in per_seq.items() if e["torch_cp_ms"]), default=None)}


def prefill_meta(args, device: torch.device, dtype: torch.dtype, world: int, impls: list[str]) -> dict:
    meta = run_meta(device_name(device), world, "transformers")
    meta.update(model=args.model, shape=SHAPES[args.model], dtype=str(dtype), batch=1, impls=impls,
                backend=our_backend(args, device),
                notes="forward only (torch.no_grad, use_cache=False), logits of the last position only; "
                      "ms: median of the slowest rank over the timed forwards after one warm-up; "
                      "peak_gib: per rank, torch.cuda.max_memory_allocated (weights included)",
                env=env_vars(*MULTICAST_ENV))
    return meta


def single_rows_from(args, impls: list[str]) -> list[dict]:
    """The one-GPU rows of ``--single-from`` (none without it)."""
    if not args.single_from:
        return []
    earlier = json.loads(Path(args.single_from).read_text())
    if tuple(earlier["shape"]) != tuple(SHAPES[args.model]):
        raise SystemExit(f"--single-from {args.single_from}: model {earlier['model']}, not {args.model}")
    if "single" in impls:
        raise SystemExit("--single-from gives the single rows; drop 'single' from --impls")
    return [{**r, "from": Path(args.single_from).name} for r in earlier["rows"] if r["impl"] == "single"]


def choose_impls(args, world: int) -> list[str]:
    impls = (["ours", "torch_cp"] if world > 1 else ["single"]) if args.impls == "auto" else \
        args.impls.split(",")
    if "ours" in impls and world == 1:
        raise SystemExit("'ours' splits the prompt over several processes; launch 2 or more "
                         "(one GPU: --impls single)")
    return impls


def bench_lengths(args, model, impls, device, world, results: ResultsFile) -> None:
    """Every variant at every length; a variant out of memory skips the longer lengths."""
    failed_at: dict[str, int] = {}
    order = [i for i in ("single", "ours", "torch_cp") if i in impls]
    for n in sorted(int(s) for s in args.seqs.split(",")):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, SHAPES[args.model][5], (1, n), generator=g).to(device)
        logits, recorded = {}, {}
        for impl in order:
            if impl in failed_at:
                results.record({"seq": n, "impl": impl, "skipped": f"out of memory at {failed_at[impl]}"})
                continue
            row, logits[impl] = measure(impl, model, ids, args, device, world)
            if row.get("error") in ("out of memory", "failed on another rank"):
                failed_at[impl] = n
            recorded[impl] = row
            results.record(row)
        if logits.get("ours") is not None and logits.get("single") is not None:
            recorded["ours"]["rel_err_vs_single"] = rel_err(logits["ours"], logits["single"])
            results.write()
        del ids


def main(argv=None) -> Path | None:
    args = parse_args(argv)
    device, owns_group = init_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # exact comparisons on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    impls = choose_impls(args, world)
    suffix = args.model if args.model != "7b" else ""
    out_path = results_path(args.out, "prefill", device_name(device), world, suffix, args.tag)
    results = ResultsFile(out_path, prefill_meta(args, device, dtype, world, impls),
                          lambda rows: summarize(rows, world), rank=rank, rows=single_rows_from(args, impls),
                          echo=lambda row: {k: v for k, v in row.items() if k != "last_logits_head"})
    seqs = [int(s) for s in args.seqs.split(",")]
    model = build_model(SHAPES[args.model], max(seqs), device, dtype)
    bench_lengths(args, model, impls, device, world, results)
    if rank == 0:
        print(json.dumps(summarize(results.rows, world), indent=1))
    finish(owns_group)
    return out_path


if __name__ == "__main__":
    main()
