"""What a run is made of: the model (built, checked against the tokenizer, patched), its memory options,
the optimizer and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from .config import FinetuneConfig
from .errors import ConfigError
from .log import logger
from .planning import offload_value
from .shape import RunShape

__all__ = ["apply_patch", "build_model", "build_model_or_explain", "build_optimizer", "check_backend_device",
           "check_tokenizer_fits", "count_steps", "lr_lambda", "model_config", "offload_setting",
           "rank_memory_budget", "run_sharding", "use_fsdp_cpu_offload"]


def model_config(cfg: FinetuneConfig) -> Any:
    """The model's Transformers config: ``model.path``'s with the ``model.config`` entries over it, or
    ``model.config`` alone."""
    from transformers import AutoConfig

    entries = dict(cfg.model.config or {})
    if cfg.model.path is None:
        return AutoConfig.for_model(entries.pop("model_type"), **entries)
    hf_cfg = AutoConfig.from_pretrained(cfg.model.path)
    hf_cfg.update({k: v for k, v in entries.items() if k != "model_type"})
    return hf_cfg


def build_model(cfg: FinetuneConfig, device: torch.device | None = None) -> torch.nn.Module:
    """Load ``model.path`` (``model.config`` entries override its config; a ``vocab_size`` resizes the
    loaded embeddings) or build ``model.config`` with random weights."""
    from transformers import AutoModelForCausalLM

    from .architecture import model_vocab_size

    dtype = getattr(torch, cfg.model.dtype)
    hf_cfg = model_config(cfg)
    if cfg.model.path is not None and not cfg.model.random_init:
        wanted = hf_cfg.vocab_size
        hf_cfg.vocab_size = model_vocab_size(None, cfg.model.path) or wanted  # the checkpoint's rows
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, config=hf_cfg, dtype=dtype)
        if wanted != model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(wanted)  # model.config.vocab_size given: rows added (or cut)
        return model
    ctx = torch.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
    with ctx:  # random init straight on the GPU: a 7B model initializes in seconds there
        return AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)


def build_model_or_explain(cfg: FinetuneConfig, device: torch.device) -> torch.nn.Module:
    """:func:`build_model`; transformers refusing the architecture entries becomes a ConfigError."""
    try:
        return build_model(cfg, device)
    except Exception as e:
        refused = isinstance(e, (ValueError, TypeError, KeyError)) or \
            type(e).__module__.split(".")[0] in ("transformers", "huggingface_hub")
        if not refused:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model: transformers could not build the model from model.path/model.config: "
                          f"{msg}") from e


def count_steps(t: Any, num_samples: int, dp_size: int) -> int:
    """The run's optimizer steps: ``training.max_steps``, else the epochs over ``num_samples`` samples shared
    by ``dp_size`` data-parallel groups (``t``: the config's ``training`` section). ConfigError when a group
    has fewer samples than one batch."""
    per_group = math.ceil(num_samples / dp_size)
    if t.batch_size > per_group:
        raise ConfigError(f"training.batch_size {t.batch_size} exceeds the {per_group} samples each of the "
                          f"{dp_size} data-parallel groups has; lower training.batch_size or add data")
    if t.max_steps is not None:
        return t.max_steps
    return math.ceil(math.ceil(per_group / t.batch_size) / t.grad_accum) * t.epochs


def _tokenizer_size(tokenizer: Any) -> int | None:
    """The number of ids ``tokenizer`` can produce (added tokens included), when it says."""
    if tokenizer is None:
        return None
    with contextlib.suppress(TypeError):
        return len(tokenizer)
    return getattr(tokenizer, "vocab_size", None)


def check_tokenizer_fits(cfg: FinetuneConfig, tokenizer: Any, vocab_size: int) -> None:
    """ConfigError when text data would be tokenized into ids the model's embedding table lacks."""
    if cfg.data.type == "synthetic":
        return  # the synthetic task draws ids from the model's vocabulary itself
    n = _tokenizer_size(tokenizer)
    if n is not None and n > vocab_size:
        which = "model.config.vocab_size" if cfg.model.config and "vocab_size" in cfg.model.config \
            else "the model's vocab_size"
        raise ConfigError(
            f"tokenizer: {cfg.tokenizer or cfg.model.path} produces {n} ids but {which} is {vocab_size}; "
            f"set model.config.vocab_size={n} (or more), or use the model's own tokenizer"
        )


def run_sharding(accelerator: Any) -> str:
    """The planner's name for how ``accelerator`` holds the model: ``fsdp`` or ``replicated``."""
    from accelerate.utils import DistributedType

    return "fsdp" if accelerator.distributed_type == DistributedType.FSDP else "replicated"


def rank_memory_budget(accelerator: Any) -> tuple[float, float]:
    """``(device bytes, host bytes)`` this rank may plan for (``memory.memory_budget``: its share of the
    GPU and of the host memory available now, split over this host's processes). On the CPU the device
    is host memory: both are the host share."""
    from ..memory import memory_budget

    gpu, host = memory_budget(accelerator.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return (host, host) if accelerator.device.type != "cuda" else (gpu, host)


def offload_setting(cfg: FinetuneConfig, run: RunShape, accelerator: Any) -> Any:
    """``training.offload_checkpoints``, with ``auto`` resolved by the planner for a run in the shape
    ``run`` against this rank's device memory and its share of the host's available memory."""
    offload = cfg.training.offload_checkpoints
    if offload != "auto":
        return offload
    if accelerator.device.type != "cuda":
        return False  # nothing to gain: the "device" is host memory
    from .planning import describe_offload, resolve_auto_offload

    sharding = run_sharding(accelerator)
    gpu, host = rank_memory_budget(accelerator)
    plan = resolve_auto_offload(cfg, run, sharding, gpu, host)
    if accelerator.is_main_process:
        logger.info(f"training.offload_checkpoints=auto: {describe_offload(cfg, run, sharding, plan)} "
                    f"(planner; {gpu / 2**30:.0f} GiB device, {host / 2**30:.0f} GiB host per rank)")
    return plan


def check_backend_device(backend: str, model: torch.nn.Module) -> None:
    """ConfigError when ``training.backend`` cannot run on the model's device: found at set-up, in one
    line, instead of as a traceback from the first attention call. The dtype is left out: under mixed
    precision the attention sees another dtype than the weights."""
    from ..kernels.autoselect import refusal
    from ..kernels.base import KernelRequest

    weight = next(model.parameters(), None)
    if backend == "auto" or weight is None:
        return
    reason = refusal(backend, KernelRequest(weight.device))
    if reason is not None:
        raise ConfigError(f"training.backend: {backend!r} {reason}; set training.backend=auto (or reference)")


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Transformers' activation checkpointing (routed to the patch's ``checkpointing`` mode), under its
    current name: ``activation_checkpointing_enable``, which deprecates ``gradient_checkpointing_enable``
    (the only name of older releases)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_patch(model: torch.nn.Module, cfg: FinetuneConfig, sp_group: Any,
                offload: Any = None) -> torch.nn.Module:
    """Patch the model for sequence parallelism and set up checkpointing (``offload``: the resolved
    ``training.offload_checkpoints``)."""
    import lightseq_hf
    from lightseq_hf.patches.architectures import UnsupportedModel

    ckpt = cfg.training.checkpointing
    offload = offload_value(cfg.training.offload_checkpoints) if offload is None else offload
    check_backend_device(cfg.training.backend, model)
    try:
        model = lightseq_hf.patch_model(model, sp_group=sp_group, backend=cfg.training.backend,
                                        checkpointing="remat" if ckpt == "none" else ckpt,
                                        offload_checkpoints=offload, tiled_mlp=cfg.training.tiled_mlp)
    except UnsupportedModel as e:  # the same refusal on every rank: one line, whole, from rank 0
        raise ConfigError(f"model: {e}") from None
    if ckpt != "none":
        _enable_checkpointing(model)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def use_fsdp_cpu_offload(accelerator: Any) -> None:
    """``training.cpu_offload``: FSDP2's CPUOffloadPolicy (master weights, gradients and the optimizer
    step on the host, pinned); only under an FSDP2 accelerate config."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        raise ConfigError(
            "training.cpu_offload needs FSDP2: launch with an accelerate config that has distributed_type: "
            "FSDP and fsdp_version: 2 (e.g. configs/accelerate/1node-8gpu-fsdp.yaml)"
        )
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin.cpu_offload = CPUOffloadPolicy(pin_memory=True)


def lr_lambda(t: Any, total_steps: int) -> Callable[[int], float]:
    """Warmup then cosine, linear or constant decay to ``min_lr_ratio`` (multiplier of ``lr``) over
    ``total_steps``; ``t``: the config's ``training`` section."""

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay

    return f


def build_optimizer(model: torch.nn.Module, cfg: FinetuneConfig, total_steps: int) -> tuple[Any, Any]:
    """AdamW (no weight decay on norms and biases) and its warmup + decay schedule."""
    t = cfg.training
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr, betas=tuple(t.betas), fused=False,
    )
    if t.warmup_steps > total_steps:
        logger.warning(f"training.warmup_steps={t.warmup_steps} exceeds the run's {total_steps} steps: the "
                       f"learning rate peaks at {t.lr * total_steps / t.warmup_steps:.3g}, not training.lr="
                       f"{t.lr:g}; lower warmup_steps to reach it")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t, total_steps))
    return optimizer, scheduler
