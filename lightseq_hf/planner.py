"""Predicted peak memory per rank of a sequence-parallel training step, before anything is allocated.

An analytic model from the Hugging Face config (no weights, no device): parameters, gradients and
AdamW state under FSDP sharding (or replicated), the tensors checkpointing keeps per layer (on the
device, or in host memory when offloaded), one layer's recompute-and-backward working set (the MLP's
``tokens x intermediate`` activations, or one tile's when tiled; the attention's float32 gradient
accumulators and ring buffers), the chunked loss and the embedding gradient. The peak is the largest
of three moments: the start of backward (every layer's kept tensors alive), its end (every
gradient), and the optimizer step (AdamW's foreach update makes one parameter-sized temporary).

Checked against measured peaks: a tiny model on the CPU in ``tests/test_planner.py`` (process peak
resident memory) and the 7B GPU runs in ``benchmarks/results`` (README, "Memory").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ._values import is_positive_int

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


_POSITIVE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size")
_OPTIONAL_KEYS = ("num_key_value_heads", "head_dim")


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
    offload_checkpoints: bool | int | str = False  # True: every layer; N: the first N; "auto": as needed
    tiled_mlp: int | None = None
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: master weights, gradients, optimizer on the host
    optimizer_state: bool = True  # AdamW moments allocated (every step after the first)
    loss_chunk: int = 2048
    attention_kernel: str = "flash"  # flash (cuDNN/flash/Triton: no score matrix) | reference (blockwise)


@dataclass
class MemoryPlan:
    """Bytes per rank; ``gpu`` and ``host`` name every component of the peak moment."""

    peak_gpu: int
    peak_host: int
    moment: str  # which moment sets the GPU peak
    moments: dict = field(default_factory=dict)  # device bytes at every moment
    gpu: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"peak device memory per rank: {self.peak_gpu / GIB:.2f} GiB ({self.moment})"]
        lines += [f"  {k:<34} {v / GIB:9.3f} GiB" for k, v in self.gpu.items() if v]
        lines.append(f"peak host memory per rank (beyond the process itself): {self.peak_host / GIB:.2f} GiB")
        lines += [f"  {k:<34} {v / GIB:9.3f} GiB" for k, v in self.host.items() if v]
        return "\n".join(lines)


def plan_memory(shape: ModelShape, opts: PlanOptions) -> MemoryPlan:
    """The predicted peak of one training step (see the module docstring)."""
    if opts.context % opts.sp_size:
        raise ValueError(f"context {opts.context} is not divisible by sp_size {opts.sp_size}")
    if opts.offload_checkpoints == "auto":
        raise ValueError("offload_checkpoints='auto': resolve the number of layers with layers_to_offload()")
    m, c = _BYTES[opts.master_dtype], _BYTES[opts.compute_dtype]
    mixed = c != m
    n = opts.batch * opts.context // opts.sp_size  # tokens on this rank
    h, hd = shape.hidden, shape.head_dim
    q_width = shape.heads * hd
    shards = opts.world if opts.sharding == "fsdp" else 1
    sharded = shape.params * m / shards
    weights, grads_all, adam, foreach_temp, unsharded, host = _state_parts(shape, opts, sharded, c, mixed)

    # -- what checkpointing keeps, per layer
    kept_input = n * h * c
    kept_attn = n * (q_width * c + shape.heads * 4)  # remat: out and lse
    if opts.checkpointing == "remat":
        kept = kept_input + kept_attn
    elif opts.checkpointing == "hf":
        kept = kept_input
    else:
        kept = sum(_layer_saved(shape, n, c, opts.tiled_mlp)) + n * h * c
    kept_all = shape.layers * kept
    offloaded = offloaded_layers(shape, opts)
    if offloaded:
        host["offloaded_checkpoints"] = offloaded * kept
        # the layers left on the device, and the offloaded one in backward with the one prefetched
        kept_all = (shape.layers - offloaded + min(offloaded, 2)) * kept

    # -- one layer's recompute + backward
    working = _layer_working_set(shape, n, c, opts)
    if opts.checkpointing == "none":  # nothing is recomputed: the layer's saved tensors are in ``kept``
        working -= sum(_layer_saved(shape, n, c, opts.tiled_mlp))

    # -- loss, embeddings, final norm
    vocab_grad = shape.vocab * h * 4  # the fused loss's float32 head gradient (unsharded)
    loss = (n * h * c  # the hidden gradient the fused loss keeps for backward
            + n * h * (4 + c))  # final norm: float32 upcast and output
    loss_forward = 3 * min(opts.loss_chunk, n) * shape.vocab * 4  # one chunk's float32 logits, exp, dlogits
    embed_out = n * h * c
    # FSDP: the dense embedding gradient, unsharded in the compute dtype, before its reduce-scatter
    # (replicated, it is the parameter's own gradient, counted with the gradients)
    embed_grad = shape.vocab * h * c if opts.sharding == "fsdp" else 0

    common = {"weights (master, this rank's shard)": weights,
              "optimizer state (AdamW)": adam,
              "unsharded layer params + grads": unsharded}
    start = {**common,
             "kept by checkpointing": kept_all,
             "one layer's recompute + backward": working,
             "loss (chunked) + final norm": loss + vocab_grad,
             "embedding output": embed_out}
    end = {**common,
           "gradients (this rank's shard)": grads_all,
           "kept by checkpointing": kept if opts.checkpointing != "none" else kept,
           "one layer's recompute + backward": working,
           "embedding gradient": embed_grad}
    step = {"weights (master, this rank's shard)": weights,
            "gradients (this rank's shard)": grads_all,
            "optimizer state (AdamW)": 2 * sharded if not opts.cpu_offload else 0,
            "optimizer temporaries (foreach)": foreach_temp}
    forward_end = {**common,
                   "kept by checkpointing": kept_all,
                   "loss (chunked) + final norm": loss + loss_forward + vocab_grad,
                   "embedding output": embed_out}
    moments = {"end of forward (loss)": forward_end, "start of backward": start, "end of backward": end,
               "optimizer step": step}
    name, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    return MemoryPlan(peak_gpu=int(sum(parts.values())), peak_host=int(sum(host.values())), moment=name,
                      moments={k: int(sum(v.values())) for k, v in moments.items()},
                      gpu={k: int(v) for k, v in parts.items()}, host={k: int(v) for k, v in host.items()})


def _state_parts(shape: ModelShape, opts: PlanOptions, sharded: float, c: int,
                 mixed: bool) -> tuple[float, float, float, float, float, dict[str, float]]:
    """Device bytes of the weights, gradients, AdamW state, its foreach temporary and the unsharded
    layer copies; and what CPU offload puts in host memory instead."""
    weights = grads_all = sharded
    adam = 2 * sharded if opts.optimizer_state else 0
    foreach_temp = sharded  # AdamW foreach: sqrt(exp_avg_sq) of every parameter at once
    host: dict[str, float] = {}
    if opts.cpu_offload:
        host.update(weights=weights, gradients=grads_all, optimizer_state=2 * sharded,
                    optimizer_temp=foreach_temp)
        weights = grads_all = adam = foreach_temp = 0
    # FSDP unshards a layer (and prefetches the next) in the compute dtype; replicated: nothing extra
    layer_copy = shape.layer_params * c if opts.sharding == "fsdp" else 0
    unsharded = 2 * layer_copy + (layer_copy if mixed or opts.sharding == "fsdp" else 0)  # + its gradient
    if opts.sharding == "fsdp" and mixed:
        unsharded += shape.layer_params * 4  # float32 reduce-scatter input of that gradient
    return weights, grads_all, adam, foreach_temp, unsharded, host


def offloaded_layers(shape: ModelShape, opts: PlanOptions) -> int:
    """How many layers keep their checkpoints in host memory."""
    if opts.checkpointing == "none" or opts.offload_checkpoints is False:
        return 0
    if opts.offload_checkpoints is True:
        return shape.layers
    return min(int(opts.offload_checkpoints), shape.layers)


def layers_to_offload(shape: ModelShape, opts: PlanOptions, gpu_bytes: float,
                      host_bytes: float | None = None) -> int | None:
    """The fewest layers whose checkpoints must go to host memory for the step to fit ``gpu_bytes``
    (0: none need to), or None when no number fits both budgets."""
    for n in range(shape.layers + 1):
        plan = plan_memory(shape, _with(opts, opts.context, offload_checkpoints=n))
        if plan.peak_gpu <= gpu_bytes:
            return n if host_bytes is None or plan.peak_host <= host_bytes else None
    return None


def _layer_saved(shape: ModelShape, n: int, c: int, tile: int | None) -> tuple[float, float, float]:
    """What autograd keeps for one decoder layer's backward (after its recompute): (norms, attention,
    MLP) bytes.

    Each RMSNorm keeps its float32 upcast (the rsqrt too) and its normalized output in the compute
    dtype; the rotary multiplications keep only cos/sin (which need no gradient); the attention op
    keeps the rotated q, k, v and its out, lse; the MLP its gate, up, act(gate) and their product
    (one tile's when tiled, plus the tiled function's input). The projections' inputs are those
    norm outputs and that product; residual sums keep nothing.
    """
    h, hd = shape.hidden, shape.head_dim
    q_width, kv_width = shape.heads * hd, shape.kv_heads * hd
    norms = 2 * n * h * (4 + c)
    attention = n * ((2 * q_width + 2 * kv_width) * c + shape.heads * 4)
    if tile is None:
        mlp = 4 * n * shape.intermediate * c
    else:
        mlp = n * h * c
    return norms, attention, mlp


def _layer_working_set(shape: ModelShape, n: int, c: int, opts: PlanOptions) -> float:
    """The most one layer's recompute and backward hold at once. Backward runs the MLP first (all the
    layer's saved tensors alive, plus about one more ``tokens x intermediate`` gradient: each node
    frees what it saved as it finishes), then the attention (the MLP's and second norm's tensors
    gone; float32 dq/dk/dv accumulators, the ring's remote k/v and their dk/dv partials)."""
    h, hd = shape.hidden, shape.head_dim
    q_width, kv_width = shape.heads * hd, shape.kv_heads * hd
    norms, attention, mlp = _layer_saved(shape, n, c, opts.tiled_mlp)
    if opts.tiled_mlp is None:
        mlp_transient = n * shape.intermediate * c
    else:  # one tile recomputed and differentiated, its weight gradients, their float32 sums
        rows = min(opts.tiled_mlp, n)
        mlp_transient = 5 * rows * shape.intermediate * c + 3 * h * shape.intermediate * (4 + c)
    attn_transient = n * (q_width + 2 * kv_width) * 4
    if opts.sp_size > 1:
        from .parallel.ops import backward_chunks

        attn_transient += 2 * n * 2 * kv_width * c + n * 2 * kv_width * 4
        chunks = backward_chunks(opts.batch * n * q_width, shape.kv_heads)
        if chunks > 1:  # one head group at a time: its slices' copies, and the whole gradients
            attn_transient = ((attn_transient + n * (3 * q_width + 2 * kv_width) * c) / chunks
                              + n * (q_width + 2 * kv_width) * c)
    if opts.attention_kernel == "reference":
        block = min(512, n)
        attn_transient += 4 * opts.batch * shape.heads * block * block * 4  # one block pair's scores etc.
    hidden_grads = 2 * n * h * c  # the incoming and outgoing hidden-state gradients
    mlp_phase = norms + attention + mlp + mlp_transient
    attn_phase = norms / 2 + attention + attn_transient
    return max(mlp_phase, attn_phase) + hidden_grads


def longest_context(shape: ModelShape, opts: PlanOptions, gpu_bytes: float, host_bytes: float | None = None,
                    step: int = 8192) -> int:
    """The longest context (a multiple of ``step`` and of the sp size) whose predicted peaks fit."""
    unit = step * opts.sp_size // math.gcd(step, opts.sp_size)
    if opts.offload_checkpoints == "auto":  # as many layers offloaded as each length needs
        def fits(k: int) -> bool:
            return layers_to_offload(shape, _with(opts, k * unit), gpu_bytes, host_bytes) is not None
    else:
        def fits(k: int) -> bool:
            return _fits(plan_memory(shape, _with(opts, k * unit)), gpu_bytes, host_bytes)
    if not fits(1):
        return 0
    hi = 1
    while fits(hi * 2) and hi < 2**20:
        hi *= 2
    lo, hi = hi, hi * 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def _with(opts: PlanOptions, context: int, **changes: Any) -> PlanOptions:
    from dataclasses import replace

    return replace(opts, context=context, **changes)


def _fits(plan: MemoryPlan, gpu_bytes: float, host_bytes: float | None) -> bool:
    return plan.peak_gpu <= gpu_bytes and (host_bytes is None or plan.peak_host <= host_bytes)
