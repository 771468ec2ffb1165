"""Predicted peak memory per rank of a sequence-parallel training step, before anything is allocated.

An analytic model from the Hugging Face config (no weights, no device). Bytes per token are the design
currency: every tensor of a step that grows with the tokens is a named term with its bytes per token on
this rank (:mod:`lightseq_hf.step_bytes` lists them and says why each is alive), beside the fixed ones
(parameters, gradients and AdamW state under FSDP sharding or replicated, one layer's unsharded copy,
one chunk of the loss's logits). Terms are added up at the moments of a step:

* the forward of the last layer (the kept tensors of the layers below, and the layer's own at the
  queries' rotary embedding or its attention);
* the end of the forward (every checkpointed layer's kept tensors alive, and the loss's);
* the start of backward (the loss's and the final norm's backward);
* the backward of a layer: the kept tensors of the layers not yet reached that stay on the device, the
  offload's next input in flight, and this layer's needs at its largest point (what its recompute saved
  and the MLP's, the second norm's or the attention's backward temporaries);
* the end of backward (every gradient) and the optimizer step (AdamW's foreach temporary).

The peak is the largest; :attr:`MemoryPlan.gpu_per_token` and :attr:`MemoryPlan.host_per_token` give
each of its terms per token. What the caching allocator does not report is planned beside it
(:attr:`MemoryPlan.beside_gpu`): the allocator's reserve, the CUDA context, NCCL's buffers.

Checked against measured peaks: a tiny model on the CPU in ``tests/test_planner.py`` (process peak
resident memory, and its growth per token) and the 7B GPU runs in ``benchmarks/results``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ._values import is_positive_int
from .offload import OffloadPlan, offload_plan
from .step_bytes import (
    _BYTES,
    Bytes,
    Dims,
    fixed,
    kept,
    layer_backward_moment,
    layer_forward_moment,
    layer_saved,
    loss_forward,
    mlp_backward,
    per_token,
    step_inputs,
    total,
)

__all__ = ["ALLOCATOR_RESERVE", "GIB", "MemoryPlan", "ModelShape", "OffloadPlan", "PlanOptions",
           "choose_offload", "fits", "layers_to_offload", "longest_context", "plan_memory", "recompute_cost"]

GIB = 2**30
_KIB = 2**10

_POSITIVE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size")
_OPTIONAL_KEYS = ("num_key_value_heads", "head_dim")

#: the caching allocator's reserve, as a share of the allocated peak: with expandable segments, pages of
#: 2 MiB and size rounding (a 576K-token step on 2 x H200 trained at 120.9 GiB allocated on 139.8 GiB
#: cards); with the default allocator, blocks split and cached by size (at an out-of-memory on 4 x H100,
#: 2026-11-26, it held 22.3 GiB reserved but unallocated beside 52.4 GiB allocated)
ALLOCATOR_RESERVE = {"expandable": 0.02, "default": 0.40}
#: how the names of the forward's moments begin
_FORWARD_MOMENTS = ("forward of layer", "end of forward")
#: device memory outside the caching allocator, estimated: the CUDA context with cuBLAS/cuDNN handles
_CUDA_CONTEXT_BYTES = GIB // 2
#: NCCL's buffers per rank, estimated: 4 MiB (NCCL_BUFFSIZE) per channel, protocol and peer, for the
#: collectives of FSDP and the ring's point-to-point neighbours
_NCCL_BYTES = GIB


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a Llama-family config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config or a mapping of its entries."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        for key in _POSITIVE_KEYS:
            value = get(key)
            if value is None and key in _OPTIONAL_KEYS:
                continue
            if not is_positive_int(value):
                raise ValueError(f"model config {key} must be a positive integer; got {value!r}")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        if get("head_dim") is None and hidden % heads:
            raise ValueError(f"model config hidden_size {hidden} is not divisible by num_attention_heads "
                             f"{heads}; set head_dim")
        return cls(hidden=hidden, intermediate=get("intermediate_size"), layers=get("num_hidden_layers"),
                   heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or hidden // heads, vocab=get("vocab_size"),
                   tied=bool(get("tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embed + self.hidden


@dataclass(frozen=True)
class PlanOptions:
    """The run: lengths, parallelism, precision and the memory options."""

    context: int
    sp_size: int = 1
    world: int = 1
    batch: int = 1
    sharding: str = "fsdp"  # fsdp (parameters, gradients, optimizer state sharded over world) | replicated
    master_dtype: str = "float32"  # weights, gradients and AdamW state
    compute_dtype: str = "bfloat16"  # activations (mixed precision); float32 without it
    checkpointing: str = "remat"  # remat | hf | none
    # True: every layer; N: the first N; an OffloadPlan (or its mapping); "auto": as choose_offload says
    offload_checkpoints: bool | int | str | Mapping | OffloadPlan = False
    tiled_mlp: int | None = None
    tiled_norms: bool | None = None  # norms tiled, keeping only their inputs; None: with tiled_mlp
    final_norm_in_loss: bool = True  # the final norm runs per chunk inside the fused loss
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: master weights, gradients, optimizer on the host
    optimizer_state: bool = True  # AdamW moments allocated (every step after the first)
    optimizer: bool = True  # the step ends with AdamW's update (False: forward and backward only)
    loss_chunk: int = 2048
    # the registered backend whose declared backward memory is planned (lightseq_hf.kernels.backward_memory)
    attention_kernel: str = "sdpa"
    allocator: str = "expandable"  # the CUDA caching allocator: expandable segments | default

    @property
    def norms_tiled(self) -> bool:
        """Whether the layers' norms keep only their inputs."""
        return self.tiled_norms if self.tiled_norms is not None else self.tiled_mlp is not None


@dataclass
class MemoryPlan:
    """Bytes per rank; ``gpu`` and ``host`` name every component of the peak moment, ``gpu_per_token`` and
    ``host_per_token`` the same components' bytes per token of this rank."""

    peak_gpu: int  # allocated bytes at the peak (what the allocator's max_memory_allocated reads)
    peak_host: int
    moment: str  # which moment sets the GPU peak
    tokens: int = 0  # tokens on this rank
    moments: dict = field(default_factory=dict)  # device bytes at every moment
    moment_per_token: dict = field(default_factory=dict)  # device bytes per token of this rank, every moment
    gpu: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    gpu_per_token: dict = field(default_factory=dict)
    host_per_token: dict = field(default_factory=dict)
    beside_gpu: dict = field(default_factory=dict)  # device bytes the allocator does not count as allocated

    @property
    def device_bytes_per_token(self) -> float:
        """Growth of the device peak per token of this rank (activations, every term)."""
        return sum(self.gpu_per_token.values())

    @property
    def host_bytes_per_token(self) -> float:
        """Growth of the host memory per token of this rank (offloaded checkpoints)."""
        return sum(self.host_per_token.values())

    def phase_peak(self, phase: str) -> int:
        """The largest moment of the forward (``"forward"``) or of the rest of the step (``"backward"``)."""
        if phase not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', not {phase!r}")
        forward = phase == "forward"
        return max(v for k, v in self.moments.items() if k.startswith(_FORWARD_MOMENTS) == forward)

    @property
    def device_total(self) -> int:
        """What the card must hold: the allocated peak and what is planned beside it."""
        return self.peak_gpu + int(sum(self.beside_gpu.values()))

    def describe(self) -> str:
        def rows(parts: dict, per: dict) -> list[str]:
            return [f"  {k:<52} {v / GIB:9.3f} GiB {per.get(k, 0) / _KIB:8.2f} KB/token"
                    for k, v in parts.items() if v]

        lines = [f"peak device memory per rank: {self.peak_gpu / GIB:.2f} GiB allocated ({self.moment}); "
                 f"{self.device_bytes_per_token / _KIB:.1f} KB per token of this rank ({self.tokens} tokens)"]
        lines += rows(self.gpu, self.gpu_per_token)
        lines.append(f"beside it on the device: {sum(self.beside_gpu.values()) / GIB:.2f} GiB; the card must "
                     f"hold {self.device_total / GIB:.2f} GiB")
        lines += [f"  {k:<52} {v / GIB:9.3f} GiB" for k, v in self.beside_gpu.items() if v]
        lines.append(f"peak host memory per rank (beyond the process itself): {self.peak_host / GIB:.2f} "
                     f"GiB; {self.host_bytes_per_token / _KIB:.1f} KB per token of this rank")
        lines += rows(self.host, self.host_per_token)
        return "\n".join(lines)


def plan_memory(shape: ModelShape, opts: PlanOptions) -> MemoryPlan:
    """The predicted peak of one training step (see the module docstring)."""
    if opts.context % opts.sp_size:
        raise ValueError(f"context {opts.context} is not divisible by sp_size {opts.sp_size}")
    if opts.offload_checkpoints == "auto":
        raise ValueError("offload_checkpoints='auto': resolve it with choose_offload()")
    n = opts.batch * opts.context // opts.sp_size  # tokens on this rank
    d = Dims.of(shape, opts.compute_dtype)
    state, host = _state_parts(shape, opts)
    modes = _layer_modes(shape, opts)
    host.update(_offloaded(d, modes))
    moments = _moments(shape, opts, d, n, state, modes)
    name, parts = max(moments.items(), key=lambda kv: total(kv[1]).at(n))
    peak = total(parts).at(n)
    beside = {"allocator reserve": peak * ALLOCATOR_RESERVE[opts.allocator],
              "CUDA context and libraries": _CUDA_CONTEXT_BYTES,
              "NCCL buffers": _NCCL_BYTES if opts.world > 1 else 0}
    return MemoryPlan(
        peak_gpu=int(peak), peak_host=int(total(host).at(n)), moment=name, tokens=n,
        moments={k: int(total(v).at(n)) for k, v in moments.items()},
        moment_per_token={k: total(v).per_token for k, v in moments.items()},
        gpu={k: int(v.at(n)) for k, v in parts.items()}, host={k: int(v.at(n)) for k, v in host.items()},
        gpu_per_token={k: v.per_token for k, v in parts.items()},
        host_per_token={k: v.per_token for k, v in host.items()},
        beside_gpu={k: int(v) for k, v in beside.items()})


def _layer_modes(shape: ModelShape, opts: PlanOptions) -> list[tuple[bool, bool]]:
    """``(offloaded, remat)`` of every layer: the first ``_offloaded_layers`` keep their checkpoints in
    host memory, the plan's first ``recompute`` are under plain recompute."""
    offloaded = _offloaded_layers(shape, opts)
    plain = 0 if opts.checkpointing == "none" else offload_plan(opts.offload_checkpoints).recompute
    remat = opts.checkpointing == "remat"
    return [(i < offloaded, remat and i >= plain) for i in range(shape.layers)]


def _offloaded(d: Dims, modes: list[tuple[bool, bool]]) -> dict[str, Bytes]:
    parts = Bytes()
    for offloaded, remat in modes:
        if offloaded:
            parts = parts + total(kept(d, remat))
    return {"offloaded checkpoints": parts} if parts.per_token else {}


def _moments(shape: ModelShape, opts: PlanOptions, d: Dims, n: int, state: dict[str, Bytes],
             modes: list[tuple[bool, bool]]) -> dict[str, dict[str, Bytes]]:
    """Every moment of the step, as its named terms."""
    common = {k: state[k] for k in ("weights (master, this rank's shard)", "optimizer state (AdamW)",
                                    "unsharded layer params + grads", "root params (embedding, head)")}
    common.update(step_inputs(d, sp_size=opts.sp_size, head_dim=shape.head_dim))
    fsdp = opts.sharding == "fsdp"
    head_grad = {"head gradient (until the end of backward)":
                 fixed(shape.vocab * shape.hidden * (d.c if fsdp else _BYTES[opts.master_dtype]))}
    if opts.checkpointing == "none":
        every = {"kept by the layers (no checkpointing)": shape.layers * (
            total(kept(d, True)) + total(layer_saved(d, remat=True, tiled_mlp=opts.tiled_mlp is not None,
                                                     tiled_norms=opts.norms_tiled)))}
        transients = mlp_backward(d, n, opts.tiled_mlp)
        return {"end of forward (loss)": {**common, **every, **_loss(d, n, opts)},
                "backward": {**common, **every, **head_grad, **transients},
                **({"optimizer step": _optimizer_moment(state)} if opts.optimizer else {})}
    device_kept = _kept_on_device(d, modes)
    last = len(modes) - 1
    moments = {f"forward of layer {last} (rotary embedding or attention)": {
                   **common, "kept by checkpointing (layers below)": _kept_on_device(d, modes[:-1]),
                   **layer_forward_moment(d, n, sp_size=opts.sp_size, embedding_held=last > 0)},
               "end of forward (loss)": {**common, "kept by checkpointing": device_kept, **_loss(d, n, opts)},
               "start of backward (loss, final norm)": {**common, "kept by checkpointing": device_kept,
                                                        **head_grad, **_loss_backward(d, opts)}}
    for j in _representative_layers(modes):
        offloaded, remat = modes[j]
        parts = {**common, **head_grad, "kept by checkpointing (layers below)": _kept_on_device(d, modes[:j])}
        if offloaded and j > 0 and modes[j - 1][0]:  # its input only: the cache comes at its own turn
            parts["offload: the layer below's input, prefetched"] = per_token(d.h * d.c)
        parts.update(_layer_moment(shape, opts, d, n, remat))
        where, how = "host" if offloaded else "device", "remat" if remat else "recompute"
        moments[f"backward of layer {j} (checkpoint on the {where}, {how})"] = parts
    first = _layer_moment(shape, opts, d, n, modes[0][1])
    moments["end of backward"] = {**common, **first,
                                  "gradients (this rank's shard)": state["gradients (this rank's shard)"],
                                  "embedding gradient": state["embedding gradient"]}
    if opts.optimizer:
        moments["optimizer step"] = _optimizer_moment(state)
    return moments


def _kept_on_device(d: Dims, modes: list[tuple[bool, bool]]) -> Bytes:
    """What checkpointing keeps on the device for ``modes``' layers (those not offloaded)."""
    out = Bytes()
    for offloaded, remat in modes:
        if not offloaded:
            out = out + total(kept(d, remat))
    return out


def _representative_layers(modes: list[tuple[bool, bool]]) -> list[int]:
    """The last layer of every run of layers with the same mode: within a run the kept tensors below
    only shrink toward its first layer, so its last one holds the most."""
    return [j for j in range(len(modes)) if j == len(modes) - 1 or modes[j + 1] != modes[j]]


def _layer_moment(shape: ModelShape, opts: PlanOptions, d: Dims, n: int, remat: bool) -> dict[str, Bytes]:
    from .parallel.ops import backward_chunks

    chunks = backward_chunks(n * d.q, shape.kv_heads)
    return layer_backward_moment(d, n, opts, remat=remat, chunks=chunks)


def _loss(d: Dims, n: int, opts: PlanOptions) -> dict[str, Bytes]:
    return loss_forward(d, n, chunk=opts.loss_chunk, norm_in_loss=opts.final_norm_in_loss)


def _loss_backward(d: Dims, opts: PlanOptions) -> dict[str, Bytes]:
    """The loss's backward and the final norm's: the stored hidden-state gradient scaled into a new one,
    and, when the norm ran on the whole shard, its kept float32 copy and normalized output with its
    float32 backward temporaries."""
    parts = {"hidden-state gradient (fused loss) and its scaled copy": per_token(2 * d.h * d.c)}
    if not opts.final_norm_in_loss:
        parts["final norm: float32 copy, normalized, backward temporaries"] = per_token(
            d.h * (d.upcast + d.c + 3 * 4))
    return parts


def _optimizer_moment(state: dict[str, Bytes]) -> dict[str, Bytes]:
    return {k: state[k] for k in ("weights (master, this rank's shard)", "gradients (this rank's shard)",
                                  "optimizer state (AdamW) in the step", "optimizer temporaries (foreach)")}


def _state_parts(shape: ModelShape, opts: PlanOptions) -> tuple[dict[str, Bytes], dict[str, Bytes]]:
    """Device bytes of the weights, gradients, AdamW state and its foreach temporary, the unsharded
    copies FSDP makes, and the dense embedding gradient; and what CPU offload puts in host memory."""
    m, c = _BYTES[opts.master_dtype], _BYTES[opts.compute_dtype]
    mixed = c != m
    fsdp = opts.sharding == "fsdp"
    sharded = shape.params * m / (opts.world if fsdp else 1)
    weights = grads = sharded
    adam = 2 * sharded if opts.optimizer_state else 0
    foreach_temp = sharded  # AdamW foreach: sqrt(exp_avg_sq) of every parameter at once
    host: dict[str, Bytes] = {}
    step_adam = 2 * sharded
    if opts.cpu_offload:
        host.update({"weights": fixed(weights), "gradients": fixed(grads),
                     "optimizer state": fixed(2 * sharded), "optimizer temporaries": fixed(foreach_temp)})
        weights = grads = adam = foreach_temp = step_adam = 0
    # FSDP unshards a layer (and prefetches the next) in the compute dtype; replicated: nothing extra
    layer_copy = shape.layer_params * c if fsdp else 0
    unsharded = 2 * layer_copy + (layer_copy if mixed or fsdp else 0)  # + its gradient
    if fsdp and mixed:
        unsharded += shape.layer_params * 4  # float32 reduce-scatter input of that gradient
    # the root unit (embedding, final norm, head) stays unsharded from the forward through the backward
    root = (shape.params - shape.layers * shape.layer_params) * c if fsdp else 0
    state = {"weights (master, this rank's shard)": fixed(weights), "optimizer state (AdamW)": fixed(adam),
             "optimizer state (AdamW) in the step": fixed(step_adam),
             "optimizer temporaries (foreach)": fixed(foreach_temp),
             "gradients (this rank's shard)": fixed(grads),
             "unsharded layer params + grads": fixed(unsharded),
             "root params (embedding, head)": fixed(root),
             # FSDP: the dense embedding gradient, unsharded in the compute dtype, before its reduce-scatter
             # (replicated, it is the parameter's own gradient, counted with the gradients)
             "embedding gradient": fixed(shape.vocab * shape.hidden * c if fsdp else 0)}
    return state, host


def _offloaded_layers(shape: ModelShape, opts: PlanOptions) -> int:
    """How many layers keep their checkpoints in host memory."""
    if opts.checkpointing == "none":
        return 0
    return min(offload_plan(opts.offload_checkpoints).layers, shape.layers)


def fits(plan: MemoryPlan, gpu_bytes: float, host_bytes: float | None = None) -> bool:
    """Whether the card holds the plan (its allocated peak and what is planned beside it) in
    ``gpu_bytes`` and the host its share in ``host_bytes`` (None: any)."""
    return plan.device_total <= gpu_bytes and (host_bytes is None or plan.peak_host <= host_bytes)


def layers_to_offload(shape: ModelShape, opts: PlanOptions, gpu_bytes: float,
                      host_bytes: float | None = None) -> int | None:
    """The fewest layers whose checkpoints must go to host memory for the step to fit ``gpu_bytes``
    (0: none need to), or None when no number fits both budgets."""
    for n in range(shape.layers + 1):
        plan = plan_memory(shape, replace(opts, offload_checkpoints=n))
        if fits(plan, gpu_bytes):
            return n if host_bytes is None or plan.peak_host <= host_bytes else None
    return None


def choose_offload(shape: ModelShape, opts: PlanOptions, gpu_bytes: float,
                   host_bytes: float | None = None) -> OffloadPlan | None:
    """``offload_checkpoints: auto``: the plan that fits ``gpu_bytes`` and ``host_bytes`` for the least
    step time: the fewest layers under plain recompute (each runs its attention forward again; see
    :func:`recompute_cost`), and for that the fewest offloaded layers (their copies overlap the compute);
    None when no plan fits. Plain recompute goes to the first layers (offloaded first: on the host it
    halves the bytes per token). Under ``checkpointing: hf`` every layer is plain already."""
    most = shape.layers if opts.checkpointing == "remat" else 0
    for recompute in range(most + 1):
        # the device's need falls and the host's grows with the offloaded layers: the fewest that fit the
        # device, if the host holds them
        if not _fits_device(shape, opts, gpu_bytes, OffloadPlan(shape.layers, recompute)):
            continue
        lo, hi = 0, shape.layers
        while lo < hi:
            mid = (lo + hi) // 2
            fits_mid = _fits_device(shape, opts, gpu_bytes, OffloadPlan(mid, recompute))
            lo, hi = (lo, mid) if fits_mid else (mid + 1, hi)
        chosen = OffloadPlan(lo, recompute)
        if fits(plan_memory(shape, replace(opts, offload_checkpoints=chosen)), gpu_bytes, host_bytes):
            return chosen
    return None


def _fits_device(shape: ModelShape, opts: PlanOptions, gpu_bytes: float, plan: OffloadPlan) -> bool:
    return fits(plan_memory(shape, replace(opts, offload_checkpoints=plan)), gpu_bytes)


def recompute_cost(shape: ModelShape, opts: PlanOptions, recompute: int) -> float:
    """Estimated share of a step's FLOPs that ``recompute`` layers under plain recompute add: one more
    causal attention forward each (``2 x heads x head dim x tokens^2`` over the whole sequence, half of
    the dense count) against the step's matmuls (forward, recompute and backward: 8 x parameters x
    tokens) and attention (forward and backward: 3.5 forwards per layer)."""
    tokens = opts.batch * opts.context
    attention = 2 * opts.batch * shape.heads * shape.head_dim * opts.context ** 2
    matmul_params = shape.layers * shape.layer_params + shape.vocab * shape.hidden
    step = 8 * matmul_params * tokens + 3.5 * shape.layers * attention
    return recompute * attention / step


def longest_context(shape: ModelShape, opts: PlanOptions, gpu_bytes: float, host_bytes: float | None = None,
                    step: int = 8192) -> int:
    """The longest context (a multiple of ``step`` and of the sp size) whose predicted peaks fit."""
    unit = step * opts.sp_size // math.gcd(step, opts.sp_size)
    if opts.offload_checkpoints == "auto":  # the plan each length needs
        def fits_at(k: int) -> bool:
            at = replace(opts, context=k * unit)
            return choose_offload(shape, at, gpu_bytes, host_bytes) is not None
    else:
        def fits_at(k: int) -> bool:
            return fits(plan_memory(shape, replace(opts, context=k * unit)), gpu_bytes, host_bytes)
    if not fits_at(1):
        return 0
    hi = 1
    while fits_at(hi * 2) and hi < 2**20:
        hi *= 2
    lo, hi = hi, hi * 2  # fits_at(lo), not fits_at(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo * unit
