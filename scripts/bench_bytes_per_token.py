"""Device and host bytes per token of a training step, measured, beside the planner's prediction.

One process per GPU (``torchrun --nproc_per_node P``, or plain ``python`` for one GPU), every memory
option on: checkpoint offload of every layer (or ``--offload``), the tiled MLP and norms (``--tile``),
the final norm inside the chunked loss, the head-chunked attention backward. Random bf16 weights
(``--model``, default the Llama-3.1-8B shape) held whole on every rank, no optimizer: the parameters,
their gradients and every other fixed allocation cancel out, because each phase's peak is measured at
several lengths (tokens per rank, ``--tokens-per-rank``) and its growth per token is the slope of a
straight line through them (:class:`lightseq_hf.memory.StepMemory` marks the forward and the backward;
the host's from :class:`lightseq_hf.memory.HostPeak`, the offload's pinned buffers released between
lengths). One short step first takes the lazy allocations (cuBLAS, cuDNN graphs) out of the measured
ones. The results file (``OUT/bytes-per-token-<device>-x<P>-<date>-<model>.json``) holds every phase's
peaks, the fits and the planner's bytes per token for the same run; the device memory outside the
caching allocator (CUDA context, NCCL) is recorded too. ``--device cpu --model tiny`` is the smoke run
(the host's peak only: the CPU has no allocator statistics).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when this file is loaded by path

from benchlib.alloc_trace import peak_sites, recording  # noqa: E402
from benchlib.launch import finish, free_memory, init_distributed  # noqa: E402
from benchlib.results import device_name, results_path, run_meta  # noqa: E402
from benchlib.workloads import SHAPES, build_model  # noqa: E402

KIB = 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the model's): the device's bytes per token are one "
                        "layer's backward and do not depend on the count when every checkpoint is offloaded, "
                        "so fewer layers measure long lengths in less time")
    p.add_argument("--tokens-per-rank", default="98304,131072",
                   help="two or more lengths, tokens per rank, best with the same head groups in the "
                        "attention backward (each length's count is in its row)")
    p.add_argument("--warmup-tokens", type=int, default=4096, help="tokens per rank of the unmeasured step")
    p.add_argument("--tile", type=int, default=8192, help="tokens per tile of the MLP and the norms")
    p.add_argument("--offload", default="all", help="checkpoint offload: all, none, N (the first N layers)")
    p.add_argument("--recompute", type=int, default=0, help="of the first R layers keep only the input")
    p.add_argument("--backend", default=None, help="local attention kernel (default: sdpa_cudnn on CUDA)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda if available")
    p.add_argument("--trace-peaks", action="store_true",
                   help="CUDA: record the allocator's history over the forward and write, per length, the "
                        "allocation sites alive at its peak (rows' peak_sites; not the backward: recording "
                        "Python stacks inside the checkpointed backward failed in torch 2.11)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    args = p.parse_args(argv)
    args.lengths = sorted(int(n) for n in args.tokens_per_rank.split(","))
    if args.trace_peaks and args.device == "cpu":
        p.error("--trace-peaks reads the CUDA caching allocator's history: run it on a GPU")
    if len(set(args.lengths)) < 2:
        p.error("--tokens-per-rank needs two or more different lengths (the fit is a straight line)")
    return args


def model_shape(args: argparse.Namespace) -> tuple[int, ...]:
    """``(hidden, intermediate, layers, heads, kv_heads, vocab)`` of ``--model`` with ``--layers``."""
    hidden, inter, layers, heads, kv_heads, vocab = SHAPES[args.model]
    return hidden, inter, args.layers or layers, heads, kv_heads, vocab


def offload_value(args: argparse.Namespace, layers: int) -> dict:
    """The ``offload_checkpoints`` plan of ``--offload`` and ``--recompute``."""
    count = {"all": layers, "none": 0}.get(args.offload)
    if count is None:
        count = int(args.offload)
    return {"layers": count, "recompute": args.recompute}


def prepare(args: argparse.Namespace, device: torch.device, world: int):
    """The patched model with every memory option on, and its dtype."""
    import lightseq_hf

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = model_shape(args)
    torch.manual_seed(0)
    model = build_model(shape, max(args.lengths) * world, device, dtype)
    from lightseq_hf.kernels import KernelRequest, select_backend

    asked = args.backend or ("sdpa_cudnn" if device.type == "cuda" else "auto")
    head_dim = shape[0] // shape[3]
    backend = select_backend(asked, KernelRequest(device, dtype, head_dim, head_dim))  # auto: this device's
    lightseq_hf.patch_model(model, backend=backend, offload_checkpoints=offload_value(args, shape[2]),
                            tiled_mlp=args.tile)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, dtype, backend


def measure_step(model, tokens: int, world: int, device: torch.device, trace: bool = False) -> dict:
    """One forward and backward over ``tokens`` per rank: each phase's allocator marks, the host's
    peak increase and (CUDA) what the device holds outside the caching allocator; with ``trace``, the
    allocation sites alive at the forward's peak (``benchlib.alloc_trace``)."""
    from lightseq_hf.memory import HostPeak, StepMemory

    offloader = model.__dict__.get("lightseq_offloader")
    if offloader is not None:
        offloader.release_host_memory()  # this length's pinned buffers only
    free_memory(device)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens * world), generator=g).to(device)
    dist.barrier()
    probe = StepMemory(device)
    with HostPeak() as host:
        with recording(device) if trace else contextlib.nullcontext([]) as forward_events:
            loss = model(input_ids=ids, labels=ids).loss
        probe.mark("forward")
        loss.backward()
        probe.mark("backward")
    model.zero_grad(set_to_none=True)
    from lightseq_hf.parallel.ops import backward_chunks

    config = model.config
    query = tokens * config.num_attention_heads * config.head_dim
    groups = backward_chunks(query, config.num_key_value_heads)
    row = {"tokens_per_rank": tokens, "head_groups": groups, "loss": loss.item(),
           "host_increase": host.increase_bytes,
           "phases": {m["phase"]: {k: m[k] for k in ("start", "peak", "allocated", "reserved")}
                      for m in probe.marks}}
    if trace:
        row["peak_sites"] = {"forward": peak_sites(forward_events, tokens)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        row["outside_allocator"] = total - free - torch.cuda.memory_reserved(device)
        row["max_reserved"] = torch.cuda.max_memory_reserved(device)
    return row


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(slope, intercept)`` of the least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def planned(args: argparse.Namespace, world: int, dtype: torch.dtype, backend: str, tokens: int):
    """The planner's plan of this run at ``tokens`` per rank (replicated bf16 weights, no optimizer), with
    the backward memory ``backend`` declares."""
    from lightseq_hf.planner import ModelShape, PlanOptions, plan_memory

    hidden, inter, layers, heads, kv_heads, vocab = model_shape(args)
    shape = ModelShape(hidden, inter, layers, heads, kv_heads, hidden // heads, vocab)
    name = str(dtype).removeprefix("torch.")
    opts = PlanOptions(context=tokens * world, sp_size=world, world=world, sharding="replicated",
                       master_dtype=name, compute_dtype=name, offload_checkpoints=offload_value(args, layers),
                       tiled_mlp=args.tile, optimizer_state=False, optimizer=False, attention_kernel=backend)
    return plan_memory(shape, opts)


def summarize(args, rows: list[dict], world: int, dtype: torch.dtype, backend: str) -> dict:
    """Per phase: the measured bytes per token (the slope of the phase's peak) and the planner's."""
    xs = [r["tokens_per_rank"] for r in rows]
    plans = [planned(args, world, dtype, backend, n) for n in xs]
    forward = [p.phase_peak("forward") for p in plans]
    backward = [p.phase_peak("backward") for p in plans]
    summary = {"planned": {"forward": fit(xs, forward)[0], "backward": fit(xs, backward)[0],
                           "host": plans[-1].host_bytes_per_token,
                           "peak_moment": plans[-1].moment, "peak_gib": [p.peak_gpu / 2**30 for p in plans],
                           "terms_per_token": plans[-1].gpu_per_token}}
    measured = {"host": fit(xs, [r["host_increase"] for r in rows])[0]}
    for phase in ("forward", "backward"):
        peaks = [r["phases"].get(phase, {}).get("peak") for r in rows]
        if all(p is not None for p in peaks):
            slope, intercept = fit(xs, peaks)
            measured[phase] = slope
            measured[f"{phase}_fixed_gib"] = intercept / 2**30
            measured[f"{phase}_peak_gib"] = [p / 2**30 for p in peaks]
    summary["measured"] = measured
    summary["device_bytes_per_token"] = measured.get("backward")
    summary["host_bytes_per_token"] = measured["host"]
    return summary


def report(summary: dict) -> str:
    lines = ["bytes per token of this rank      measured   planned"]
    for phase in ("forward", "backward", "host"):
        got = summary["measured"].get(phase)
        shown = f"{got / KIB:8.1f} KB" if got is not None else "       n/a"
        lines.append(f"  {phase:<30} {shown} {summary['planned'][phase] / KIB:8.1f} KB")
    return "\n".join(lines)


def report_sites(rows: list[dict], top: int = 8) -> str:
    """Per length, the forward's peak above its start and its largest allocation sites."""
    lines = []
    for row in rows:
        found = row["peak_sites"]["forward"]
        lines.append(f"{row['tokens_per_rank']} tokens, forward peak above its start: "
                     f"{found['bytes_per_token'] / KIB:.1f} KB per token")
        lines += [f"  {s['bytes_per_token'] / KIB:8.2f} KB/token  x{s['tensors']:<3} {s['site']}"
                  for s in found["sites"][:top]]
    return "\n".join(lines)


def main(argv=None) -> Path | None:
    args = parse_args(argv)
    if "RANK" not in os.environ and not dist.is_initialized():  # plain python: a group of one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    device, owns_group = init_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, dtype, backend = prepare(args, device, world)
    measure_step(model, args.warmup_tokens, world, device)  # lazy allocations, not measured
    rows = [measure_step(model, n, world, device, args.trace_peaks) for n in args.lengths]
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    summary = summarize(args, rows, world, dtype, backend)
    path = None
    if rank == 0:
        meta = run_meta(device_name(device), world, "transformers",
                        *(("cudnn", "nccl") if device.type == "cuda" else ()))
        meta.update(model=args.model, shape=model_shape(args), backend=backend, tile=args.tile,
                    offload=offload_value(args, model_shape(args)[2]), dtype=str(dtype),
                    alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    notes="one forward and backward per length after one unmeasured step; weights held "
                          "whole in the compute dtype on every rank, no optimizer; bytes per token are "
                          "the slopes of each phase's peak over the lengths (rank 0's; every rank's rows "
                          "in rows_per_rank)")
        path = results_path(args.out, "bytes-per-token", device_name(device), world, args.model, args.tag)
        path.write_text(json.dumps({**meta, "rows": rows, "rows_per_rank": everyone, "summary": summary},
                                   indent=1))
        print(report(summary))
        if args.trace_peaks:
            print(report_sites(rows))
        print(f"wrote {path}")
    finish(owns_group)
    return path


if __name__ == "__main__":
    main()
