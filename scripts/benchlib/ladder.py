"""The longest-context ladder: the planner's inputs for a step variant, which lengths to try, how long a
rung takes, and the results' summary. Pure functions and a small state class; no device, no process group
(``scripts/maxctx_ladder.py`` runs the rungs, ``scripts/bench_train.py --rung`` measures one).

A *ladder* is one model and one implementation (``ours``, ``torch_cp`` or ``alst``) climbing lengths.
Ours starts at the planner's longest context for the variant the planner says reaches furthest (within the
time a rung may take); torch context parallel starts at the planner's estimate for its own options (Hugging
Face checkpointing with Transformers' offload of every layer input: what it keeps per layer, though not its
ring's buffers); ALST at the same estimate with the optimizer on the host (it keeps the same per layer).
After a rung, the next length comes from the previous ones: a success climbs toward the length its measured
bytes per token say fits (at least one resolution step, at most half as long again), a failure steps down,
and a success below a failure bisects until they are within the resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
#: ours: the memory options the planner chooses among, fastest step first
OURS_VARIANTS = ("remat+offloadauto+tiled", "hf+offloadauto+tiled", "remat+offloadauto+tiled+cpuadam",
                 "hf+offloadauto+tiled+cpuadam")
#: torch context parallel at its best: the chunked loss (always), Transformers' checkpoint offload
TORCH_CP_VARIANT = "torch_cp+offload"
#: ALST at its longest: the tiled MLP, checkpoint offload, the optimizer on the host (benchlib/alst.py)
ALST_VARIANT = "alst+tiled+offload+cpuadam"
MODEL_NAMES = {"8b": "Llama-3.1-8B", "7b": "Llama-2-7B", "7b-gqa": "Llama-2-7B, GQA 32/8",
               "7b-33h": "Llama-2-7B, 33 heads", "tiny": "tiny"}


def split_variant(variant: str) -> tuple[str, set[str]]:
    base, *options = variant.split("+")
    return base, set(options)


def offload_spec(options: set[str]) -> bool | int | str:
    """``offload`` -> True, ``offloadN`` -> N, ``offloadauto`` -> ``"auto"``, none -> False."""
    spec = next((o[len("offload"):] for o in options if o.startswith("offload")), None)
    if spec is None:
        return False
    return True if spec == "" else "auto" if spec == "auto" else int(spec)


def planner_inputs(variant: str, shape: tuple[int, ...], n: int, world: int, tile: int = 8192,
                   offload: bool | int | str | None = None):
    """The planner's ``(ModelShape, PlanOptions)`` of a step variant on ``world`` GPUs (FSDP over all,
    sequence parallel over all). torch context parallel is planned as Hugging Face checkpointing, its
    ``+offload`` as every layer's checkpoint offloaded. ``offload`` overrides the variant's."""
    from lightseq_hf.planner import ModelShape, PlanOptions

    base, options = split_variant(variant)
    hidden, inter, layers, heads, kv_heads, vocab = shape
    model = ModelShape(hidden=hidden, intermediate=inter, layers=layers, heads=heads, kv_heads=kv_heads,
                       head_dim=hidden // heads, vocab=vocab)
    ours = base in ("remat", "hf")
    opts = PlanOptions(context=n, sp_size=world, world=world, sharding="fsdp" if world > 1 else "replicated",
                       checkpointing=base if ours else "hf",
                       offload_checkpoints=offload_spec(options) if offload is None else offload,
                       tiled_mlp=tile if "tiled" in options else None, cpu_offload="cpuadam" in options)
    return model, opts


def planned_longest(variant: str, shape, world: int, gpu_bytes: float, host_bytes: float, unit: int,
                    tile: int = 8192) -> int:
    """The planner's longest context of ``variant`` within the per-rank budgets, a multiple of ``unit``."""
    from lightseq_hf.planner import longest_context

    model, opts = planner_inputs(variant, shape, unit * world, world, tile)
    return longest_context(model, opts, gpu_bytes, host_bytes, step=unit)


# ----------------------------------------------------------------------------- time


def _params(shape) -> tuple[float, float]:
    """(weights of the matrix multiplies, head included; all weights)."""
    hidden, inter, layers, heads, kv_heads, vocab = shape
    head_dim = hidden // heads
    layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
    return layers * layer + vocab * hidden, layers * layer + 2 * vocab * hidden


def step_flops(shape, n: int, recompute_attention: bool) -> float:
    """FLOPs of one training step on ``n`` tokens with checkpointing: causal attention (``4 H D`` per
    visible pair and layer forward, ``N^2 / 2`` pairs; backward 2.5x; Hugging Face checkpointing runs the
    forward again) and the matrix multiplies (forward, backward twice, the recompute's forward)."""
    hidden, inter, layers, heads, kv_heads, vocab = shape
    attention_forward = 4 * heads * (hidden // heads) * layers * n * n / 2
    return attention_forward * (4.5 if recompute_attention else 3.5) + 8 * _params(shape)[0] * n


def estimate_seconds(variant: str, shape, n: int, world: int, tflops: float = 400.0) -> dict[str, float]:
    """A rung's ``setup_s`` (start-up, model, sharding, optimizer state), ``step_s`` (the FLOPs at
    ``tflops`` per GPU, 5% for what is not a matrix multiply, and the host's AdamW step under
    ``+cpuadam``) and ``total_s``."""
    base, options = split_variant(variant)
    every = _params(shape)[1]
    step = step_flops(shape, n, recompute_attention=base != "remat") / world / (tflops * 1e12) * 1.05
    if "cpuadam" in options:
        step += every / world * 1e-8  # AdamW on the host: ~10 ns per parameter on a rank's cores
    setup = 40 + 6 * every / 1e9
    return {"setup_s": setup, "step_s": step, "total_s": setup + step}


def longest_within(variant: str, shape, world: int, seconds: float, unit: int, tflops: float = 400.0) -> int:
    """The longest multiple of ``unit`` whose estimated rung takes at most ``seconds``."""
    lo, hi = 0, 1
    while estimate_seconds(variant, shape, hi * unit, world, tflops)["total_s"] <= seconds and hi < 2**16:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate_seconds(variant, shape, mid * unit, world, tflops)["total_s"] \
            <= seconds else (lo, mid)
    return lo * unit


def choose_ours(shape, world: int, gpu_bytes: float, host_bytes: float, unit: int, rung_s: float,
                variants=OURS_VARIANTS, tflops: float = 400.0, tile: int = 8192) -> dict:
    """Ours' ladder: of ``variants``, the one whose reach (the planner's longest context, or the longest
    whose rung takes at most ``rung_s`` when that is shorter) is longest; the first of equals (the faster
    step). ``{"variant", "planned_max", "start", "time_capped"}``."""
    best = None
    for variant in variants:
        planned = planned_longest(variant, shape, world, gpu_bytes, host_bytes, unit, tile)
        reach = min(planned, longest_within(variant, shape, world, rung_s, unit, tflops))
        if best is None or reach > best["start"]:
            best = {"variant": variant, "planned_max": planned, "start": reach,
                    "time_capped": reach < planned}
    return best


def torch_cp_start(shape, world: int, gpu_bytes: float, host_bytes: float, unit: int, rung_s: float,
                   cpuadam: bool, tflops: float = 400.0) -> dict:
    """torch context parallel's ladder: its variant (``+cpuadam`` when ours uses FSDP2's CPU offload
    too), the planner's estimate of its longest context and its first rung."""
    variant = TORCH_CP_VARIANT + ("+cpuadam" if cpuadam else "")
    planned = planned_longest(variant, shape, world, gpu_bytes, host_bytes, unit)
    reach = min(planned, longest_within(variant, shape, world, rung_s, unit, tflops))
    return {"variant": variant, "planned_max": planned, "start": reach, "time_capped": reach < planned}


def alst_start(shape, world: int, gpu_bytes: float, host_bytes: float, unit: int, rung_s: float,
               tflops: float = 400.0) -> dict:
    """ALST's ladder: :data:`ALST_VARIANT`, first rung at the planner's estimate for what it keeps (every
    layer's input offloaded to the host, Hugging Face's recompute of the whole layer, AdamW on the host: the
    same terms as torch context parallel with ``+cpuadam``); its own rungs then measure it."""
    cp = torch_cp_start(shape, world, gpu_bytes, host_bytes, unit, rung_s, True, tflops)
    return {**cp, "variant": ALST_VARIANT}


# ----------------------------------------------------------------------------- the next rung


def rung_status(row: dict) -> str:
    """``ok`` (a step ran), ``oom``, ``time limit``, ``skipped`` or ``error``."""
    if "step_s" in row:
        return "ok"
    if "skipped" in row:
        return "skipped"
    error = str(row.get("error", ""))
    if error == "out of memory":
        return "oom"
    return "time limit" if error.startswith("time limit") else "error"


@dataclass
class Ladder:
    """One model's and implementation's climb: its variant, first length, and the rungs run so far."""

    model: str
    impl: str
    variant: str
    planned_max: int
    start: int
    unit: int
    resolution: float = 0.125
    rows: list = field(default_factory=list)
    stopped: str | None = None

    def _round(self, n: float) -> int:
        return int(n // self.unit) * self.unit

    def _fit_from_measurement(self, row: dict, gpu_bytes: float, host_bytes: float, world: int) -> float:
        """The length a successful row's bytes per token say fits the budgets (inf when not measured)."""
        fits = math.inf
        per_token, static = row.get("device_bytes_per_token"), row.get("device_static_gib")
        if per_token and static is not None:
            fits = min(fits, (gpu_bytes - static * GIB) / per_token * world)
        per_token, start = row.get("host_bytes_per_token"), row.get("host_static_gib")
        if per_token and start is not None:
            fits = min(fits, (host_bytes - start * GIB) / per_token * world)
        return fits

    def next_length(self, gpu_bytes: float, host_bytes: float, world: int) -> int | None:
        """The next length to try, or None (``stopped`` says why)."""
        if self.stopped:
            return None
        if not self.rows:
            if self.start < self.unit:
                self.stopped = "the planner fits no length of this variant"
                return None
            return self.start
        status = {row["seq"]: rung_status(row) for row in self.rows}
        if any(s in ("error", "skipped") for s in status.values()):
            self.stopped = "a rung failed without running out of memory or time (see its log)" \
                if "error" in status.values() else "skipped"
            return None
        ok = [n for n, s in status.items() if s == "ok"]
        lo = max(ok, default=None)
        failed = [n for n, s in status.items() if s != "ok" and (lo is None or n > lo)]
        hi = min(failed, default=None)
        if hi is None:  # climbing
            row = next(r for r in self.rows if r["seq"] == lo and "step_s" in r)
            fits = self._fit_from_measurement(row, gpu_bytes, host_bytes, world)
            n = self._round(min(max(fits, lo * (1 + self.resolution)), lo * 1.5))
        elif lo is None:  # stepping down
            n = self._round(hi * (1 - self.resolution))
        else:
            if hi - lo <= lo * self.resolution:
                self.stopped = f"bracketed: {lo} trained, {hi} did not"
                return None
            n = self._round((lo + hi) / 2)
        if n < self.unit or n in status or (lo is not None and n <= lo):
            self.stopped = f"bracketed: {lo} trained, {hi} did not" if lo and hi else "no length left to try"
            return None
        return n


# ----------------------------------------------------------------------------- the summary


def _entry(rows: list[dict], impl: str) -> dict:
    mine = [r for r in rows if r["impl"] == impl]
    ok = [r for r in mine if "step_s" in r]
    best = max(ok, key=lambda r: r["seq"], default=None)
    failed = [r["seq"] for r in mine if rung_status(r) in ("oom", "time limit")
              and (best is None or r["seq"] > best["seq"])]
    get = (lambda key: best.get(key)) if best else (lambda key: None)
    return {f"max_context_{impl}": best["seq"] if best else None,
            f"first_failed_context_{impl}": min(failed, default=None),
            f"variant_{impl}": best["variant"] if best else (mine[0]["variant"] if mine else None),
            f"step_s_at_max_{impl}": get("step_s"),
            f"device_bytes_per_token_{impl}": get("device_bytes_per_token"),
            f"host_bytes_per_token_{impl}": get("host_bytes_per_token"),
            f"peak_gib_at_max_{impl}": get("peak_gib"), f"host_peak_gib_at_max_{impl}": get("host_peak_gib"),
            f"planned_gpu_gib_at_max_{impl}": get("planned_gpu_gib")}


def rung_record(row: dict) -> dict:
    """A row as the summary lists it: what ran, how it ended, its times."""
    keep = ("model", "impl", "variant", "seq", "step_s", "wall_s", "estimated_s", "offload_layers",
            "device_bytes_per_token", "host_bytes_per_token", "failed_phase")
    return {"status": rung_status(row), **{k: row[k] for k in keep if row.get(k) is not None}}


def summarize(rows: list[dict], ladders: dict | None = None) -> dict:
    """Per model: each implementation's longest context that trained and the shortest that failed past
    it, their ratio (and ``max_context_ratio_at_least``: ours' longest over torch CP's first failure, a
    bound that holds whatever torch CP's longest is, known where torch CP failed), the bytes per token
    measured at ours' longest (device: the phase peak above the weights, gradients and optimizer state;
    host: the step's peak resident memory above its start, per token of the rank), and every rung. The
    top level repeats the first model's (the headline) numbers."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    per_model = {}
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        entry = {**_entry(mine, "ours"), **_entry(mine, "torch_cp"), **_entry(mine, "alst")}
        ours, cp, alst = entry["max_context_ours"], entry["max_context_torch_cp"], entry["max_context_alst"]
        entry["max_context_ratio"] = ours / cp if ours and cp else None
        entry["max_context_ratio_vs_alst"] = ours / alst if ours and alst else None
        cp_failed, alst_failed = entry["first_failed_context_torch_cp"], entry["first_failed_context_alst"]
        entry["max_context_ratio_at_least"] = ours / cp_failed if ours and cp_failed else None
        entry["max_context_ratio_vs_alst_at_least"] = ours / alst_failed if ours and alst_failed else None
        entry["device_bytes_per_token"] = entry["device_bytes_per_token_ours"]
        entry["host_bytes_per_token"] = entry["host_bytes_per_token_ours"]
        for impl in ("ours", "torch_cp", "alst"):
            state = (ladders or {}).get(model, {}).get(impl, {})
            entry[f"planned_max_{impl}"] = state.get("planned_max")
            entry[f"ladder_end_{impl}"] = state.get("stopped")
        entry["rungs"] = [rung_record(r) for r in mine]
        per_model[model] = entry
    summary: dict = {"headline_model": models[0] if models else None}
    keys = ("max_context_ours", "max_context_torch_cp", "max_context_ratio", "max_context_ratio_at_least",
            "max_context_alst", "max_context_ratio_vs_alst", "max_context_ratio_vs_alst_at_least",
            "device_bytes_per_token", "host_bytes_per_token", "first_failed_context_ours",
            "first_failed_context_torch_cp", "first_failed_context_alst")
    head = per_model.get(models[0], {}) if models else {}
    summary.update({k: head.get(k) for k in keys})
    summary["step_s_per_rung"] = [{"model": r["model"], **rung_record(r)} for r in rows]
    summary["per_model"] = per_model
    return summary


def with_budget_share(gpu_gib: float, host_gib: float, world: int, gpu_share: float = 0.95,
                      host_share: float = 0.9) -> tuple[float, float]:
    """Per-rank planning budgets in bytes: ``gpu_share`` of one card (the planner's error and the
    allocator's fragmentation need the rest, as ``lightseq_hf.memory.memory_budget``) and ``host_share``
    of the host's memory split over the ranks."""
    return gpu_gib * GIB * gpu_share, host_gib * GIB * host_share / world

