"""The planner for a fine-tune config: its model shape and options, ``offload_checkpoints: auto``, and
the ``--plan`` report (lightseq_hf.planner does the arithmetic)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .shape import RunShape, run_shape

__all__ = ["describe_offload", "memory_advice", "offload_value", "plan_inputs", "plan_text",
           "resolve_auto_offload"]


def plan_inputs(cfg: Any, world: int, sharding: str) -> tuple[Any, Any]:
    """The planner's ``(ModelShape, PlanOptions)`` for a config run on ``world`` processes."""
    return _inputs(cfg, run_shape(cfg, world), sharding)


def _inputs(cfg: Any, run: RunShape, sharding: str) -> tuple[Any, Any]:
    """The planner's ``(ModelShape, PlanOptions)`` for a config run in the shape ``run``."""
    from ..planner import ModelShape, PlanOptions

    entries = {}
    if cfg.model.path is not None:
        config_file = Path(cfg.model.path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model.path: {config_file} does not exist (the planner reads the "
                              "architecture from it)")
        entries.update(json.loads(config_file.read_text()))
    entries.update(cfg.model.config or {})
    shape = ModelShape.from_config(entries)
    t = cfg.training
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(t.mixed_precision or "", cfg.model.dtype)
    opts = PlanOptions(context=run.context_length, sp_size=run.sp_size, world=run.world_size,
                       batch=run.batch_size, sharding=sharding if run.world_size > 1 else "replicated",
                       master_dtype=cfg.model.dtype, compute_dtype=compute, checkpointing=t.checkpointing,
                       offload_checkpoints=offload_value(t.offload_checkpoints), tiled_mlp=t.tiled_mlp,
                       cpu_offload=t.cpu_offload,
                       attention_kernel=_planned_backend(cfg, shape.head_dim, compute))
    return shape, opts


def _planned_backend(cfg: Any, head_dim: int, compute_dtype: str) -> str:
    """The backend whose declared backward memory the plan counts: ``training.backend``; for ``auto``, the
    one ``auto`` picks for the run's attention (packed documents or one causal sequence per row) on this
    machine's GPU, or, planned where no GPU is visible, the vendor kernel of the mask (cuDNN attention;
    for packed documents cuDNN's variable-length op when nvidia-cudnn-frontend is installed, else
    FlashAttention-2's); the reference kernel for runs on the CPU."""
    import torch

    from ..kernels import KernelRequest, MaskKind, device_class, select_backend

    backend = cfg.training.backend
    if backend != "auto":
        return backend
    if cfg.training.device == "cpu":
        return "reference"
    packed = cfg.data.type != "synthetic" and cfg.data.packing == "documents"
    if not torch.cuda.is_available():
        if not packed:
            return "sdpa_cudnn"
        return "cudnn_fe" if "nvidia-cudnn-frontend" in device_class(torch.device("cuda")).packages \
            else "flash_varlen"
    request = KernelRequest(torch.device("cuda"), getattr(torch, compute_dtype), head_dim, head_dim,
                            MaskKind.DOCUMENTS if packed else MaskKind.CAUSAL)
    return select_backend("auto", request)


def offload_value(value: Any) -> Any:
    """``training.offload_checkpoints`` as the patch and the planner take it (a mapping for a layer plan)."""
    return value.model_dump() if hasattr(value, "model_dump") else value


def resolve_auto_offload(cfg: Any, run: RunShape, sharding: str, gpu_bytes: float, host_bytes: float) -> Any:
    """``training.offload_checkpoints: auto``: the planner's :class:`~lightseq_hf.planner.OffloadPlan` for
    the step to fit ``gpu_bytes`` and ``host_bytes`` per rank (:func:`~lightseq_hf.planner.choose_offload`:
    the fewest layers under plain recompute, then the fewest offloaded); every layer offloaded when even
    that does not fit the device (the run then shows where memory ends). Raises ConfigError when the
    host cannot hold what must go there."""
    from ..planner import GIB, OffloadPlan, choose_offload

    shape, opts = _inputs(cfg, run, sharding)
    plan = choose_offload(shape, opts, gpu_bytes, host_bytes)
    if plan is None:
        if choose_offload(shape, opts, gpu_bytes) is not None:
            raise ConfigError(
                f"training.offload_checkpoints=auto: at context_length {run.context_length} the checkpoints "
                f"the device cannot keep do not fit {host_bytes / GIB:.0f} GiB of host memory per rank "
                "either, even under plain recompute; shorten the context, use more GPUs, or add "
                "training.tiled_mlp (see lightseq-finetune CONFIG --plan)")
        return OffloadPlan(shape.layers)
    return plan


def describe_offload(cfg: Any, run: RunShape, sharding: str, plan: Any) -> str:
    """What ``offload_checkpoints: auto`` chose, and what its plain recompute costs per step."""
    from ..planner import recompute_cost

    shape, opts = _inputs(cfg, run, sharding)
    text = f"{min(plan.layers, shape.layers)} of {shape.layers} layers offloaded"
    if plan.recompute:
        text += (f"; the first {plan.recompute} keep only their input (plain recompute: {plan.recompute} "
                 f"more attention forwards per step, about {recompute_cost(shape, opts, plan.recompute):.1%} "
                 "of its FLOPs)")
    return text


def plan_text(cfg: Any, run: RunShape, sharding: str, gpu_gib: float | None, host_gib: float | None) -> str:
    """The ``--plan`` report: predicted peaks at the config's context and the longest that fits."""
    from dataclasses import replace

    from ..planner import GIB, choose_offload, longest_context, plan_memory

    world = run.world_size
    shape, opts = _inputs(cfg, run, sharding)
    t = cfg.training
    if gpu_gib is None:
        import torch

        cuda = torch.cuda.is_available()
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else 139.0
    if host_gib is None:
        host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / world
    offload_note = ""
    if t.offload_checkpoints == "auto":
        chosen = choose_offload(shape, opts, gpu_gib * GIB, host_gib * GIB)
        offload_note = ("offload_checkpoints auto at this context: "
                        f"{describe_offload(cfg, run, sharding, chosen)}" if chosen is not None else
                        "offload_checkpoints auto: no number of offloaded layers fits at this context")
        plan = plan_memory(shape, replace(opts, offload_checkpoints=chosen or True))
    else:
        plan = plan_memory(shape, opts)
    longest = longest_context(shape, opts, gpu_gib * GIB, host_gib * GIB)
    options = (f"checkpointing {t.checkpointing}, offload_checkpoints {t.offload_checkpoints}, tiled_mlp "
               f"{t.tiled_mlp}, cpu_offload {t.cpu_offload}, {opts.sharding} over {world} ranks, sp "
               f"{run.sp_size}, {opts.compute_dtype} activations, {cfg.model.dtype} master weights, AdamW")
    return "\n".join([
        f"plan for {run.context_length} tokens ({run.tokens_per_rank} per rank), "
        f"{shape.params / 1e9:.2f}B parameters; {options}",
        *([offload_note] if offload_note else []),
        plan.describe(),
        f"longest context that fits {gpu_gib:.0f} GiB device and {host_gib:.0f} GiB host memory per rank: "
        f"{longest} tokens ({longest // 1024}K)" if longest else
        f"nothing fits {gpu_gib:.0f} GiB device / {host_gib:.0f} GiB host memory per rank",
    ])


#: tokens per tile of the tiled MLP the out-of-memory advice proposes
_ADVICE_TILE = 8192


def _memory_options(cfg: Any, run: RunShape, sharding: str) -> list[tuple[str, dict]]:
    """The memory options a config has left to turn on, cheapest in step time first: ``(the setting to
    write, the planner's changes)``."""
    t = cfg.training
    out: list[tuple[str, dict]] = []
    if t.checkpointing == "none":
        out.append(("training.checkpointing=remat", {"checkpointing": "remat"}))
    if t.offload_checkpoints is not True and t.offload_checkpoints != "auto":  # none, or some layers
        out.append(("training.offload_checkpoints=auto", {"offload_checkpoints": "auto"}))
    if t.tiled_mlp is None:
        out.append((f"training.tiled_mlp={_ADVICE_TILE}", {"tiled_mlp": _ADVICE_TILE}))
    if run.sp_size < run.world_size:
        out.append((f"sp_size={run.world_size}", {"sp_size": run.world_size}))
    if not t.cpu_offload and sharding == "fsdp" and run.world_size > 1:
        out.append(("training.cpu_offload=true", {"cpu_offload": True}))
    return out


def memory_advice(cfg: Any, run: RunShape, sharding: str, gpu_bytes: float, host_bytes: float) -> str:
    """What to change when a step of ``cfg`` runs out of memory, in one sentence: the cheapest memory
    option the planner says makes the context fit ``gpu_bytes`` of device and ``host_bytes`` of host
    memory per rank (or all of them, and how far they reach), and the longest context as configured.
    Never raises: a planner that cannot read the config makes the sentence point at ``--plan``."""
    try:
        return _advice(cfg, run, sharding, gpu_bytes, host_bytes)
    except Exception as e:  # noqa: BLE001 - the out-of-memory line must come whatever the planner says
        return f"lightseq-finetune CONFIG --plan shows what fits (the planner could not advise: {e})"


def _advice(cfg: Any, run: RunShape, sharding: str, gpu_bytes: float, host_bytes: float) -> str:
    from dataclasses import replace

    from ..planner import GIB, longest_context

    shape, opts = _inputs(cfg, run, sharding)
    context = run.context_length

    def reach(changes: dict) -> int:
        return longest_context(shape, replace(opts, **changes), gpu_bytes, host_bytes)

    as_is = reach({})
    head = f"the planner, for {gpu_bytes / GIB:.0f} GiB of device and {host_bytes / GIB:.0f} GiB of host " \
           "memory per rank, "
    if as_is >= context:
        head += (f"expected {context} tokens to fit (up to {as_is} as configured), so the allocator's "
                 "fragmentation or memory outside the plan took the rest: ")
        unit = opts.sp_size * 64
        shorter = context * 7 // 8 // unit * unit  # a margin below the plan
    else:
        head += f"fits up to {as_is} tokens as configured: " if as_is else "fits no context as configured: "
        shorter = as_is
    options = [(name, changes, reach(changes)) for name, changes in _memory_options(cfg, run, sharding)]
    fitting = [o for o in options if o[2] >= context]
    if fitting:
        tip = f"turn on {fitting[0][0]} (fits up to {fitting[0][2]} tokens)"
    elif options:
        together = reach({k: v for _, changes, _ in options for k, v in changes.items()})
        tip = f"turn on {' and '.join(name for name, _, _ in options)} (together up to {together} tokens)"
    else:
        tip = "every memory option is on; use more GPUs"
    tail = f", or set context_length={shorter}" if shorter > 0 else ""
    return head + tip + tail + " (lightseq-finetune CONFIG --plan shows the breakdown)"
