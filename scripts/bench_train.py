"""End-to-end training-step benchmark: a Llama-2-7B shape, FSDP2 across the GPUs, AdamW.

Launch with torchrun, one process per GPU::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc_per_node 2 scripts/bench_train.py --out benchmarks/results

Variants, same model shape and data in one run: ``remat`` (ours, rematerialization-aware
checkpointing), ``hf`` (ours with Hugging Face's layer checkpointing, the paper's Table 5
ablation), ``torch_cp`` (torch's ``context_parallel`` ring attention over SDPA cuDNN with
HF checkpointing), ``single`` (the unpatched model with SDPA cuDNN and HF checkpointing; run it
with one process). A variant may add memory options after ``+``: ``offload`` (ours: checkpoint
offload to host memory with prefetch; torch_cp: transformers' ``offload=True``), ``tiled`` (ours:
the sequence-tiled MLP, ``--tile`` tokens), ``cpuadam`` (FSDP2's CPUOffloadPolicy: master weights,
gradients and AdamW on the host), e.g. ``remat+offload+tiled``. torch_cp always uses the same
chunked fused loss as ours, so step ratios measure attention and checkpointing alone. Each row
records the allocator's breakdown of its last step (static components, per-phase peaks) and each
rank's host peak. ``--search-max-context`` tries the lengths of ``--seqs`` in ascending order
until a step fails, per variant (run it under ``timeout``: a rank that runs out of memory
alone would leave its peer waiting); its probes allocate the AdamW state before the first
step, so one step per length holds everything a steady-state step holds. ``--merge OUT IN...``
joins results files of one model into OUT and recomputes its summary. ``--rung`` measures one
variant at one length as one rung of ``scripts/maxctx_ladder.py`` (a search probe, its row written to
``--row-out``; a rank that fails writes its own row beside it and ends at once, so that the launcher ends
its peers instead of leaving them in a collective). bf16 compute, float32 master weights and optimizer
state (FSDP2 mixed precision). Every process starts with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
unless the environment sets the allocator, as the fine-tune's workers do (recorded as ``alloc_conf`` and
``alloc_conf_set_by``). ``--model tiny`` runs a small model on CPU processes (gloo) as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when this file is loaded by path

from benchlib import alst  # noqa: E402
from benchlib.ladder import offload_spec, planner_inputs  # noqa: E402
from benchlib.launch import free_memory, init_distributed  # noqa: E402
from benchlib.peers import torch_context_parallel  # noqa: E402
from benchlib.plots import pyplot, save  # noqa: E402
from benchlib.results import ResultsFile, device_name, failure, results_path, run_meta  # noqa: E402
from benchlib.timing import matmul_peak_flops, slowest, synchronize  # noqa: E402
from benchlib.workloads import SHAPES, build_model, llama_config  # noqa: E402

from lightseq_hf import metrics  # noqa: E402
from lightseq_hf.memory import HostPeak, StepMemory  # noqa: E402
from lightseq_hf.training.processes.launch import use_expandable_segments  # noqa: E402

#: the allocator settings a user may give (torch reads the newer name first)
ALLOC_CONFS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7b", choices=sorted(SHAPES))
    p.add_argument("--seqs", default="32768,65536", help="total tokens per sequence")
    p.add_argument("--variants", default="remat,hf,torch_cp")
    p.add_argument("--steps", type=int, default=3, help="steps per variant; the first is warm-up")
    p.add_argument("--backend", default="sdpa_cudnn", help="our local attention kernel")
    p.add_argument("--matmul-peak", type=float, default=None, help="measured bf16 TFLOP/s (else measured)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    p.add_argument("--plot-from", nargs="+", default=None, help="only draw a PNG from results JSONs")
    p.add_argument("--search-max-context", action="store_true",
                   help="try --seqs in ascending order until a step fails, per variant (the AdamW "
                        "state is allocated before the first step, so --steps 1 is a full probe)")
    p.add_argument("--tile", type=int, default=8192, help="tokens per tile of the +tiled variants")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="search: skip a probe whose step (extrapolated from the last, quadratically in the "
                        "length) would end past S seconds from the start; recorded as not tried")
    p.add_argument("--maxctx", action="store_true",
                   help="write (append) the rows into the day's maxctx-<device>-x<P>-<date>.json, as "
                        "the searches do: timed 128K rows of each memory option beside the longest contexts")
    p.add_argument("--merge", nargs="+", default=None, metavar="PATH",
                   help="OUT IN...: join the rows of results files into OUT, recompute the summary")
    p.add_argument("--rung", action="store_true",
                   help="one variant at one length as a search probe; the row goes to --row-out")
    p.add_argument("--row-out", default=None, help="--rung: where rank 0 writes {meta, row}")
    p.add_argument("--gpu-budget-gib", type=float, default=None,
                   help="+offloadauto: device memory per rank the planner fits (default: 95%% of the GPU)")
    p.add_argument("--host-budget-gib", type=float, default=None,
                   help="+offloadauto: host memory per rank the planner fits (default: 90%% of what "
                        "/proc/meminfo says is available, split over the processes)")
    return p.parse_args(argv)


def model_flops(shape, n: int) -> float:
    """Model FLOPs of one training step on one sequence of n tokens (no recompute counted), as
    ``lightseq_hf.metrics`` counts them for the fine-tune."""
    config = llama_config(shape, n)
    return metrics.model_flops_per_step(config, metrics.matmul_params(config), 1, n)


def shard(model, device, cpu_offload=False):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if cpu_offload else {}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def allocate_adamw_state(opt: torch.optim.AdamW) -> None:
    """Give every parameter the state AdamW's first ``step()`` would create (step 0, zero moments),
    so that a first step already holds a steady-state step's memory. The updates are unchanged
    (tests/test_bench_summaries.py)."""
    for group in opt.param_groups:
        if group["amsgrad"] or group["capturable"] or group["fused"]:
            raise ValueError("allocate_adamw_state covers plain AdamW (no amsgrad/capturable/fused)")
        for p in group["params"]:
            if p.requires_grad and not opt.state[p]:
                opt.state[p] = {"step": torch.tensor(0.0),
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def parse_variant(variant: str) -> tuple[str, set]:
    """``"remat+offload+tiled"`` -> ``("remat", {"offload", "tiled"})``; unknown parts are refused."""
    base, *options = variant.split("+")
    if base not in ("remat", "hf", "torch_cp", "single", "alst"):
        raise SystemExit(f"unknown variant {base!r}: remat, hf, torch_cp, single or alst "
                         "(+offload, +tiled, +cpuadam)")
    if base == "alst":
        alst.options_from_variant(set(options))
        return base, set(options)
    unknown = {o for o in options if not o.startswith("offload")} - {"tiled", "cpuadam"}
    unknown |= {o for o in options if o.startswith("offload") and o[7:] not in ("", "auto")
                and not o[7:].isdigit()}
    if unknown or ("tiled" in options and base not in ("remat", "hf")):
        raise SystemExit(f"variant {variant!r}: options are offload (offloadN: the first N layers, "
                         "offloadauto: as the planner needs; ours only), tiled (ours only) and cpuadam")
    if base not in ("remat", "hf") and any(o.startswith("offload") and o != "offload" for o in options):
        raise SystemExit(f"variant {variant!r}: offloadN/offloadauto are ours only")
    return base, set(options)


def offload_option(options: set, shape, n: int, world: int, device: torch.device, budgets=(None, None),
                   base: str = "remat"):
    """What ``+offload`` / ``+offloadN`` / ``+offloadauto`` ask of ``patch_llama(offload_checkpoints=)``
    (auto: the plan ``training.offload_checkpoints: auto`` takes in finetune.py, the planner's
    ``choose_offload`` for ``budgets`` = (device, host) GiB per rank, each defaulting to this device and
    host: the fewest layers under plain recompute, then the fewest offloaded; every layer offloaded, under
    remat, when no plan fits)."""
    spec = offload_spec(options)
    if spec != "auto":
        return spec
    from lightseq_hf.memory import memory_budget
    from lightseq_hf.planner import OffloadPlan, choose_offload

    model_shape, opts = planner_inputs("+".join([base, *sorted(options)]), shape, n, world, offload=False)
    gpu, host = memory_budget(device, world)
    gpu = gpu if budgets[0] is None else budgets[0] * 2**30
    host = host if budgets[1] is None else budgets[1] * 2**30
    return choose_offload(model_shape, opts, gpu, host) or OffloadPlan(model_shape.layers)


def prepare_variant(variant, shape, n, backend, device, preallocate=False, tile=8192, offload=False):
    """One variant's sharded model (AdamW inside its step; ``preallocate``: the optimizer state allocated
    before the first step), its training step ``step(probe) -> loss`` on one random sequence of ``n``
    tokens, and for ALST its run (``benchlib.alst.prepare``: the configuration and ``close()``)."""
    import lightseq_hf

    base, options = parse_variant(variant)
    if base == "alst":
        lightseq_hf.unpatch_llama()
        run = alst.prepare(shape, n, device, alst.options_from_variant(options))
        return run.engine, run.step, run
    torch.manual_seed(0)
    model = build_model(shape, n, device)
    if base in ("remat", "hf"):
        local_kernel = backend if device.type == "cuda" else "auto"
        lightseq_hf.patch_llama(model, checkpointing=base, backend=local_kernel,
                                offload_checkpoints=offload,
                                tiled_mlp=tile if "tiled" in options else None)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    else:
        lightseq_hf.unpatch_llama()
        # transformers' own offload for the peer (save_on_cpu on the compute stream)
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable(**({"offload": True} if "offload" in options else {}))
        if base == "torch_cp":
            use_chunked_loss(model)
    model = shard(model, device, cpu_offload="cpuadam" in options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if preallocate:
        allocate_adamw_state(opt)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape[5], (1, n), generator=g).to(device)

    def step(probe):
        if base == "torch_cp":
            loss = cp_step(model, ids, device, probe)
        elif base == "single" and device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                loss = model(input_ids=ids, labels=ids).loss
                probe.mark("forward")
                loss.backward()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            probe.mark("forward")
            loss.backward()
        probe.mark("backward", model)
        opt.step()
        probe.mark("optimizer", model, opt)
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step, None


class PhaseProbe(StepMemory):
    """The allocator's marks, and (on any device) the phases a step has finished."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.finished: list[str] = []

    def mark(self, name, model=None, optimizer=None) -> None:
        super().mark(name, model, optimizer)
        self.finished.append(name)

    def running(self) -> str:
        """The phase the step is in: the one after the last finished."""
        order = ("forward", "backward", "optimizer")
        return order[min(len(self.finished), len(order) - 1)]


def run_variant(variant, shape, n, steps, backend, device, world, preallocate=False, tile=8192,
                offload=False) -> dict:
    """One variant: its median step seconds (``step_s``), peak memory (GiB) per rank, loss, the allocator
    breakdown of the last step, and each rank's host peak and its rise over the step's start (GiB)
    (``preallocate``: AdamW state allocated before the first step). An exception carries the phase it
    came from as ``failed_phase``."""
    model, step, peer = prepare_variant(variant, shape, n, backend, device, preallocate, tile, offload)
    try:
        result = _time_steps(model, step, steps, device, world)
    finally:
        if peer is not None:
            peer.close()
    if peer is not None:
        result["peer_config"] = peer.config
    return result


def _time_steps(model, step, steps, device, world) -> dict:
    """Run ``steps`` steps; the median of all but the first (the slowest rank's), peaks and the loss."""
    times, peak_all = [], 0.0
    for i in range(steps):
        synchronize(device)
        dist.barrier()
        probe = PhaseProbe(device)  # resets the peak: each step's phases on their own
        t0 = time.perf_counter()
        try:
            with HostPeak() as host:
                loss = step(probe)
                synchronize(device)
        except Exception as err:
            err.failed_phase = probe.running()
            raise
        if i > 0 or steps == 1:
            times.append(time.perf_counter() - t0)
        if probe.marks:
            peak_all = max(peak_all, max(m["peak"] for m in probe.marks) / 2**30)
    gathered = [None] * world
    dist.all_gather_object(gathered, (peak_all if device.type == "cuda" else None,
                                      host.peak_bytes / 2**30 if host.available else None,
                                      host.start_bytes / 2**30 if host.available else None))
    offloader = model.__dict__.get("lightseq_offloader")
    if offloader is not None:  # unpin this variant's host buffers before the next variant
        offloader.release_host_memory()
    return {"step_s": statistics.median(slowest(times, device)), "peak_gib": [g[0] for g in gathered],
            "loss": float(loss.detach()), "memory_breakdown": probe.breakdown(),
            "host_peak_gib": [g[1] for g in gathered], "host_start_gib": [g[2] for g in gathered]}


def use_chunked_loss(model) -> None:
    """The peer's loss as ours: the base model, then the fused chunked linear + cross-entropy (no
    full-vocabulary logits), the group's token mean. Installed as the instance's forward, so FSDP2's
    root hooks still gather the embedding, final norm and head."""
    import types

    from lightseq_hf.parallel.sharding import IGNORE_INDEX, chunked_loss_sum, group_sum
    from lightseq_hf.patches.forward import LOSS_CHUNK_TOKENS

    def forward(self, input_ids=None, shift_labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        local = chunked_loss_sum(hidden, shift_labels, self.lm_head, self.config.vocab_size,
                                 LOSS_CHUNK_TOKENS)
        count = (shift_labels != IGNORE_INDEX).sum().to(local.dtype)
        if dist.is_initialized():
            dist.all_reduce(count)
        return types.SimpleNamespace(loss=group_sum(local, None) / count)

    model.forward = types.MethodType(forward, model)


def cp_step(model, ids, device, probe):
    """torch context parallel: shards ids/labels head-tail, ring attention inside SDPA."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # shifted globally
    inputs, targets = ids.clone(), labels.clone()
    # No position_ids: head-tail shards would look like packed sequences to Transformers' mask
    # code; RoPE positions do not change the work.
    with torch_context_parallel([inputs, targets], [1, 1], device):
        loss = model(input_ids=inputs, shift_labels=targets).loss
        probe.mark("forward")
        loss.backward()
    return loss


def plot(paths: list[str]) -> None:
    """Step time and peak memory per variant and length, from one or more results files."""
    plt = pyplot()
    results = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    labels, times, mems = [], [], []
    for res in results:
        for r in res["rows"]:
            if "step_s" in r:
                labels.append(f"{res['model']} {r['seq'] // 1024}K {r['variant']}")
                times.append(r["step_s"])
                mems.append(max(m for m in r["peak_gib"] if m is not None))
    axes[0].bar(range(len(times)), times)
    axes[0].set_ylabel("step time (s)")
    axes[1].bar(range(len(mems)), mems, color="tab:orange")
    axes[1].set_ylabel("peak memory per GPU (GiB)")
    for ax in axes:
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=90)
    fig.suptitle(f"training step, {results[0]['device']} x{results[0]['world']}, FSDP2 + AdamW, bf16")
    save(fig, Path(paths[0]).with_suffix(".png"))


def train_meta(args, device: torch.device, world: int, peak_measured: float | None) -> dict:
    peers = ("deepspeed",) if "alst" in args.variants else ()
    meta = run_meta(device_name(device), world, "transformers", *peers,
                    *(("cudnn", "nccl") if device.type == "cuda" else ()))
    meta.update(model=args.model, shape=SHAPES[args.model], backend=args.backend,
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                alloc_conf_set_by=getattr(args, "alloc_conf_set_by", None),
                matmul_peak_tflops=peak_measured / 1e12 if peak_measured else None,
                mfu_peak_tflops=metrics.peak_tflops(device),
                notes="FSDP2 (bf16 params, fp32 reduce and master weights), AdamW, batch 1, gradient "
                      "checkpointing on in every variant; times: median step of the slowest rank after "
                      "one warm-up step")
    return meta


def check_variants(variants: list[str], world: int, cuda: bool) -> None:
    for v in variants:
        parse_variant(v)
    if sum(v.startswith("alst") for v in variants) > 1:
        raise SystemExit("ALST creates its sequence-parallel groups once per process: one alst variant per "
                         "launch (scripts/bench_peers.py launches each on its own)")
    if "single" in variants and world != 1:
        raise SystemExit("the 'single' variant is one GPU without sequence parallelism: launch 1 process")
    if any(v.startswith("torch_cp") for v in variants) and not cuda:
        raise SystemExit("the 'torch_cp' variant needs GPUs: torch's context_parallel shards only the "
                         "flash, efficient and cuDNN SDPA kernels; drop it from --variants on CPU")


def search_max_context(args, variants, seqs, measure_row, record) -> None:
    """Each variant climbs the lengths until a step fails (or, with ``--time-budget``, until the next
    step would end past the budget)."""
    start, last = time.perf_counter(), None
    for variant in variants:
        for n in sorted(seqs):
            if args.time_budget and last is not None:
                guess = last[1] * (n / last[0]) ** 2  # attention-bound: about quadratic
                if time.perf_counter() - start + guess > args.time_budget:
                    record({"seq": n, "variant": variant, "search": True, "skipped":
                            f"time budget: about {guess:.0f} s per step"})
                    break
            t0 = time.perf_counter()
            row = measure_row(variant, n, search=True)
            last = (n, time.perf_counter() - t0)
            record(row)
            if "step_s" not in row:
                break
        last = None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        plot(args.plot_from)
        return
    if args.merge:
        merge(Path(args.merge[0]), [Path(p) for p in args.merge[1:]])
        return
    args.alloc_conf_set_by = "environment" if any(os.environ.get(k) for k in ALLOC_CONFS) else "bench_train"
    use_expandable_segments()  # before this process's first CUDA allocation
    cuda = torch.cuda.is_available() and args.model != "tiny"
    device, _ = init_distributed("cuda" if cuda else "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = SHAPES[args.model]
    if args.rung:
        measure_rung(args, shape, device, world, rank, cuda)
        dist.destroy_process_group()
        return
    kind = "maxctx" if args.search_max_context or args.maxctx else "train"
    path = results_path(args.out, kind, device_name(device), world,
                        args.model if args.model != "7b" else "", args.tag)
    peak_measured = args.matmul_peak * 1e12 if args.matmul_peak else (matmul_peak_flops() if cuda else None)
    rows = []
    if kind == "maxctx" and path.exists():  # several calls (one per time limit) build one file
        rows = json.loads(path.read_text())["rows"]
    results = ResultsFile(path, train_meta(args, device, world, peak_measured),
                          lambda rows: summarize(rows, world), rank=rank, rows=rows)
    seqs = [int(s) for s in args.seqs.split(",")]
    variants = args.variants.split(",")
    check_variants(variants, world, cuda)

    def measure_row(variant, n, search=False):
        return measure(variant, n, args, shape, device, world, peak_measured, search=search)

    if args.search_max_context:
        search_max_context(args, variants, seqs, measure_row, results.record)
    else:
        for n in seqs:
            for variant in variants:
                results.record(measure_row(variant, n))
    if rank == 0:
        print(json.dumps(summarize(results.rows, world), indent=1))
    dist.destroy_process_group()


def measure(variant, n, args, shape, device, world, peak_measured, search=False) -> dict:
    """One variant at one length: a results row (an ``error`` entry when the step failed)."""
    row = {"seq": n, "tokens_per_gpu": n // world, "variant": variant, "search": search}
    try:
        base, options = parse_variant(variant)
        budgets = (args.gpu_budget_gib, args.host_budget_gib)
        offload = offload_option(options, shape, n, world, device, budgets, base) \
            if base in ("remat", "hf") else False
        result = run_variant(variant, shape, n, args.steps, args.backend, device, world,
                             preallocate=search, tile=args.tile, offload=offload)
        sec = result["step_s"]
        flops = model_flops(shape, n)
        row.update(result, timed_steps=max(args.steps - 1, 1), includes_warmup=args.steps == 1,
                   optimizer_state_preallocated=search, tokens_per_s=n / sec,
                   mfu=metrics.mfu(flops, sec, world, metrics.peak_tflops(device)),
                   **bytes_per_token(result, n // world))
        if peak_measured:
            row["mfu_vs_measured_matmul"] = metrics.mfu(flops, sec, world, peak_measured / 1e12)
        if world > 1 and base not in ("single", "alst"):  # the planner's prediction beside the peaks
            row.update(planned(variant, shape, n, world, offload if base in ("remat", "hf") else None,
                               args.tile))
    except alst.UlyssesRefusal as err:
        row["refused"] = str(err)
    except Exception as err:  # noqa: BLE001 - recorded in the results
        # out of memory: the allocator's account (the request, the free and the reserved-but-unused bytes)
        row.update(failure(err, limit=4), failed_phase=getattr(err, "failed_phase", "set-up"))
        free_memory(device)
    free_memory(device)  # free the variant's model and optimizer before the next one
    return row


def bytes_per_token(result: dict, tokens_per_rank: int) -> dict:
    """What the step held per token of a rank: on the device, the largest phase peak above the
    weights, gradients and optimizer state, or above the step's start where the probe cannot see them (and
    that static part, GiB); on the host, the largest rise
    of a rank's resident memory over the step's start (and the largest start, GiB)."""
    out = {}
    phases = list(result["memory_breakdown"].values())
    seen = [p for p in phases if "peak_minus_static_gib" in p]
    if seen:
        top = max(seen, key=lambda p: p["peak_gib"])
        out.update(device_bytes_per_token=top["peak_minus_static_gib"] * 2**30 / tokens_per_rank,
                   device_static_gib=top["peak_gib"] - top["peak_minus_static_gib"])
    elif phases:  # a peer whose state the probe cannot see (ALST's ZeRO-3 partitions): the step's start
        top, static = max(phases, key=lambda p: p["peak_gib"]), phases[0]["start_gib"]
        out.update(device_bytes_per_token=(top["peak_gib"] - static) * 2**30 / tokens_per_rank,
                   device_static_gib=static)
    hosts = [(peak, start) for peak, start in zip(result["host_peak_gib"], result["host_start_gib"])
             if peak is not None and start is not None]
    if hosts:
        out.update(host_bytes_per_token=max(p - s for p, s in hosts) * 2**30 / tokens_per_rank,
                   host_static_gib=max(s for _, s in hosts))
    return out


def planned(variant, shape, n, world, offload, tile) -> dict:
    """The planner's peaks for ours (``planned_*``, ``offload_layers``); for torch context parallel its
    approximation as Hugging Face checkpointing (``estimated_*``)."""
    from lightseq_hf.planner import plan_memory

    model_shape, opts = planner_inputs(variant, shape, n, world, tile, offload)
    plan = plan_memory(model_shape, dataclasses.replace(opts, optimizer_state=True))
    if offload is None:
        return {"estimated_gpu_gib": plan.peak_gpu / 2**30, "estimated_host_gib": plan.peak_host / 2**30}
    layers, recompute = (offload.layers, offload.recompute) if hasattr(offload, "recompute") else (offload, 0)
    return {"offload_layers": layers, "recompute_layers": recompute, "planned_gpu_gib": plan.peak_gpu / 2**30,
            "planned_host_gib": plan.peak_host / 2**30}


def measure_rung(args, shape, device, world, rank, cuda) -> None:
    """``--rung``: one variant at one length, one step with the AdamW state allocated first. Rank 0
    writes ``{meta, row}`` to ``--row-out``; a rank whose step fails writes its row to
    ``<row-out>.rank<r>`` and ends at once (exit status 3): its peers, waiting in a collective, are
    ended by the launcher."""
    (n,) = [int(s) for s in args.seqs.split(",")]
    check_variants([args.variants], world, cuda)
    row = measure(args.variants, n, args, shape, device, world, None, search=True)
    out = Path(args.row_out)
    if "error" in row:
        out.with_name(f"{out.name}.rank{rank}").write_text(json.dumps({**row, "failed_rank": rank}, indent=1))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    cards = [None] * world
    dist.all_gather_object(cards, device_name(device))
    row["cards"] = cards
    if rank == 0:
        out.write_text(json.dumps({"meta": train_meta(args, device, world, None), "row": row}, indent=1))


def merge(out: Path, inputs: list[Path]) -> None:
    """Join the rows of several runs of one model into ``out``; each row keeps its run's date."""
    results = [json.loads(p.read_text()) for p in inputs]
    if len({r["model"] for r in results}) != 1 or len({r["world"] for r in results}) != 1:
        raise SystemExit("--merge joins runs of one model and one world size")
    rows = []
    for p, res in zip(inputs, results):
        rows += [{"run": p.name, **r} for r in res["rows"]]
    meta = {k: v for k, v in results[0].items() if k not in ("rows", "summary")}
    meta["notes"] += ("; rows joined from several runs (the 'run' key); the variants of one length "
                       "ran together")
    out.write_text(json.dumps({**meta, "rows": rows, "summary": summarize(rows, meta["world"])}, indent=1))


def summarize(rows, world) -> dict:
    def step(variant, n):
        found = [r for r in rows if r["variant"] == variant and r["seq"] == n and "step_s" in r]
        found.sort(key=lambda r: bool(r.get("includes_warmup")))  # timed rows before one-step probes
        return found[0]["step_s"] if found else None

    summary = {}
    remat, hf = step("remat", 32768 * world), step("hf", 32768 * world)
    summary["remat_vs_hf_ckpt_32k_per_gpu"] = hf / remat if remat and hf else None
    ours, cp = step("remat", 65536), step("torch_cp", 65536)
    summary["vs_torch_cp_64k"] = cp / ours if ours and cp else None
    for n in (131072, 262144):
        ours, cp = step("remat", n), step("torch_cp", n)
        summary[f"vs_torch_cp_{n // 1024}k"] = cp / ours if ours and cp else None

    bases = {"ours": ("remat", "hf"), "torch_cp": ("torch_cp",), "single": ("single",)}
    for name, names in bases.items():
        mine = [r for r in rows if r["variant"].split("+")[0] in names]
        trained = [r["seq"] for r in mine if "step_s" in r]
        failed = [r["seq"] for r in mine if r.get("error") == "out of memory"]
        if any(r.get("search") for r in mine):
            # the longest length that trained (any memory option), below the shortest that failed
            summary[f"max_context_{name}"] = max(trained, default=None)
            summary[f"first_failed_context_{name}"] = min(failed, default=None)
            per_variant = {}
            for r in mine:
                if "step_s" in r:
                    per_variant[r["variant"]] = max(per_variant.get(r["variant"], 0), r["seq"])
            summary[f"max_context_per_variant_{name}"] = per_variant
        else:
            summary[f"longest_measured_{name}"] = max(trained, default=None)
    if any(r.get("search") and r.get("includes_warmup") and not r.get("optimizer_state_preallocated")
           for r in rows):
        # a one-step probe ran before AdamW allocated its state: steady-state limits may be lower
        summary["max_context_first_step_only"] = True
    ours, cp = summary.get("max_context_ours"), summary.get("max_context_torch_cp")
    summary["max_context_ours_vs_torch_cp"] = ours / cp if ours and cp else None
    summary["max_context_ratio"] = summary["max_context_ours_vs_torch_cp"]
    summary["step_s_128k_default"] = step("remat", 131072)  # ours with the default options
    summary["step_s_128k_per_variant"] = {r["variant"]: step(r["variant"], 131072) for r in rows
                                          if r["seq"] == 131072 and "step_s" in r}
    r128 = [r for r in rows if r["variant"] == "remat" and r["seq"] == 131072 and "mfu" in r]
    summary["mfu_128k"] = r128[0]["mfu"] if r128 else None
    return summary


if __name__ == "__main__":
    main()
