"""Fine-tuning configuration: YAML -> dataclasses, validated up front.

Every error names the offending key (``training.lr``, ``data.paths[1]``, ...).
``load_config(path, overrides)`` reads a YAML file and applies command-line
overrides written ``dotted.key=value`` (the value is parsed as YAML, so ``3``,
``1e-4``, ``true``, ``null`` and ``[a, b]`` work).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import CHECKPOINTING_MODES
from ..kernels import BACKENDS


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


@dataclass
class ModelConfig:
    """``path``: a local Hugging Face checkpoint; ``config``: inline config entries (the whole
    architecture for random init, or overrides on top of ``path``'s config)."""

    path: str | None = None
    config: dict | None = None
    random_init: bool = False  # build from path's config.json but do not load its weights
    dtype: str = "float32"  # weights: float32 | bfloat16 | float16


@dataclass
class SyntheticConfig:
    """The on-the-fly passkey task (see lightseq_hf.training.synthetic)."""

    task: str = "passkey"
    num_values: int = 16
    passkey_len: int = 1
    needle_max_frac: float = 0.5
    needle_repeat: int = 1  # the needle states the key this many times in a row
    filler: str = "repeat"  # repeat (one sentence repeated, the classic passkey test) | random
    filler_period: int = 32
    num_samples: int = 1_000_000
    eval_samples: int = 32
    seed: int = 1234


@dataclass
class DataConfig:
    """``type``: ``synthetic`` (generated), ``files`` (local json/jsonl/text/parquet) or ``hub``."""

    type: str = "synthetic"
    paths: list = field(default_factory=list)
    format: str = "auto"  # auto | json | text | parquet (``json`` covers jsonl)
    name: str | None = None  # hub dataset name (type: hub)
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    add_eos: bool = True
    max_documents: int | None = None
    num_proc: int | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class TrainingConfig:
    """Optimization. ``batch_size`` is sequences per data-parallel group per micro-step."""

    max_steps: int | None = None  # optimizer steps; None: run ``epochs`` epochs
    epochs: int = 1
    batch_size: int = 1
    grad_accum: int = 1
    lr: float = 3e-4
    lr_schedule: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float | None = 1.0
    mixed_precision: str | None = None  # no | bf16 | fp16; None: the accelerate config's setting
    checkpointing: str = "remat"  # remat | hf | none
    backend: str = "auto"  # auto | reference | triton | sdpa
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    # memory options (issue 14; README "Memory")
    offload_checkpoints: bool = False  # what checkpointed layers keep -> pinned host memory, prefetched
    tiled_mlp: int | None = None  # MLP tokens per tile (e.g. 8192); null: untiled
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: master weights, gradients, AdamW state on the host


@dataclass
class LoggingConfig:
    """Progress bar, metrics (JSON lines), loss-curve PNG, evaluation cadence."""

    every: int = 1
    eval_every: int = 0  # steps between retrieval evaluations (synthetic data); 0: only at the end
    progress_bar: bool = True
    metrics_file: str = "metrics.jsonl"
    plot: bool = True
    peak_tflops: float | None = None  # for MFU; default: 989 on H100/H200, else unknown


@dataclass
class SavingConfig:
    """Checkpoints under ``output_dir/checkpoint-<step>``; ``resume_from``: a path or ``latest``."""

    every: int = 0  # steps between checkpoints; 0: only at the end
    final: bool = True
    resume_from: str | None = None
    save_optimizer: bool = True


@dataclass
class FinetuneConfig:
    """The whole run."""

    context_length: int = 4096
    sp_size: int | None = None  # ranks per sequence; None: every rank
    output_dir: str = "runs/finetune"
    tokenizer: str | None = None  # path, ``bytes``, or None (model.path's, if it has one)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    saving: SavingConfig = field(default_factory=SavingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "data.type": ("synthetic", "files", "hub"),
    "data.format": ("auto", "json", "text", "parquet", "csv"),
    "data.synthetic.task": ("passkey",),
    "data.synthetic.filler": ("repeat", "random"),
    "training.lr_schedule": ("cosine", "linear", "constant"),
    "training.mixed_precision": (None, "no", "bf16", "fp16"),
    "training.checkpointing": (*CHECKPOINTING_MODES, "none"),
    "training.backend": BACKENDS,
    "training.device": ("auto", "cpu", "cuda"),
}


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a mapping, checking keys and types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]} (in {where}; known keys: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} may not be null")
    base = next((a for a in args if a is not type(None)), hint) if isinstance(hint, types.UnionType) or \
        typing.get_origin(hint) is typing.Union else hint
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if base is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    if base is list:
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return value
    if base is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return value
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=1", ...]`` -> ``[("a.b", 1), ...]`` (values parsed as YAML)."""
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out


def config_from_dict(data: dict, overrides: list[str] | None = None, base_dir: str | Path | None = None,
                     world_size: int | None = None) -> FinetuneConfig:
    """Build and validate a config from a mapping plus dotted overrides.

    Relative paths in the config are resolved against ``base_dir`` when they do not
    exist relative to the working directory. ``world_size``, when given, is checked
    against ``sp_size``.
    """
    data = dict(data or {})
    for key, value in parse_overrides(overrides or []):
        _set_dotted(data, key, value)
    cfg = _build(FinetuneConfig, data, "")
    validate(cfg, base_dir=base_dir, world_size=world_size)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None,
                world_size: int | None = None) -> FinetuneConfig:
    """Read a YAML file, apply ``key.sub=value`` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
    return config_from_dict(data, overrides, base_dir=path.parent, world_size=world_size)


def _resolve(value: str, base_dir: Path | None) -> str:
    p = Path(os.path.expanduser(value))
    if p.exists() or p.is_absolute() or base_dir is None:
        return str(p)
    for root in (base_dir, base_dir.parent):  # configs/x.yaml may name paths relative to the repo
        if (root / p).exists():
            return str(root / p)
    return str(p)


def _need_path(value: str, key: str, what: str = "path") -> None:
    if not Path(value).exists():
        raise ConfigError(f"{key}: {what} {value!r} does not exist")


def validate(cfg: FinetuneConfig, base_dir: str | Path | None = None, world_size: int | None = None) -> None:
    """Check values, choices, divisibility and paths; raise ConfigError naming the key."""
    base = Path(base_dir) if base_dir is not None else None
    d = cfg.to_dict()
    for dotted, choices in _CHOICES.items():
        node: Any = d
        for part in dotted.split("."):
            node = node[part]
        if node not in choices:
            shown = ", ".join("null" if c is None else c for c in choices)
            raise ConfigError(f"{dotted} must be one of {shown}; got {node!r}")

    def positive(key: str, value: Any, allow_zero: bool = False) -> None:
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}; got {value}")

    positive("context_length", cfg.context_length)
    positive("sp_size", cfg.sp_size)
    t = cfg.training
    for key in ("max_steps", "epochs", "batch_size", "grad_accum", "lr"):
        positive(f"training.{key}", getattr(t, key))
    for key in ("warmup_steps", "weight_decay"):
        positive(f"training.{key}", getattr(t, key), allow_zero=True)
    positive("training.max_grad_norm", t.max_grad_norm)
    positive("training.tiled_mlp", t.tiled_mlp)
    if t.offload_checkpoints and t.checkpointing == "none":
        raise ConfigError("training.offload_checkpoints needs checkpointing (training.checkpointing remat or "
                          "hf): it offloads what checkpointed layers keep")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"training.min_lr_ratio must be in [0, 1]; got {t.min_lr_ratio}")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas):
        raise ConfigError(f"training.betas must be two numbers in [0, 1); got {t.betas}")
    positive("logging.every", cfg.logging.every)
    positive("logging.eval_every", cfg.logging.eval_every, allow_zero=True)
    positive("saving.every", cfg.saving.every, allow_zero=True)
    s = cfg.data.synthetic
    for key in ("num_values", "passkey_len", "num_samples", "needle_repeat", "filler_period"):
        positive(f"data.synthetic.{key}", getattr(s, key))
    positive("data.synthetic.eval_samples", s.eval_samples, allow_zero=True)
    if not 0.0 < s.needle_max_frac < 1.0:
        raise ConfigError(f"data.synthetic.needle_max_frac must be in (0, 1); got {s.needle_max_frac}")

    sp = cfg.sp_size or world_size  # None: not launched yet and no sp_size given
    if world_size is not None and world_size % sp:
        raise ConfigError(
            f"sp_size {sp} does not divide the world size {world_size} (launched processes); choose "
            f"one of {', '.join(str(k) for k in range(1, world_size + 1) if world_size % k == 0)}"
        )
    if sp is not None and cfg.context_length % sp:
        raise ConfigError(
            f"context_length {cfg.context_length} is not divisible by sp_size {sp}: every rank "
            f"of a sequence-parallel group holds context_length / sp_size tokens"
        )

    m = cfg.model
    if m.path is None and not m.config:
        raise ConfigError("model: give model.path (a Hugging Face checkpoint) or model.config (inline)")
    if m.path is not None:
        m.path = _resolve(m.path, base)
        _need_path(m.path, "model.path", "model directory")
    elif m.random_init:
        raise ConfigError("model.random_init needs model.path (a directory with config.json)")
    if m.config is not None and m.path is None and "model_type" not in m.config:
        m.config.setdefault("model_type", "llama")
    if cfg.tokenizer not in (None, "bytes"):
        cfg.tokenizer = _resolve(cfg.tokenizer, base)
        _need_path(cfg.tokenizer, "tokenizer", "tokenizer directory")

    dc = cfg.data
    if dc.type == "files":
        if not dc.paths:
            raise ConfigError("data.paths: data.type is 'files' but no paths are given")
        for i, p in enumerate(dc.paths):
            dc.paths[i] = _resolve(str(p), base)
            _need_path(dc.paths[i], f"data.paths[{i}]", "data file")
        if cfg.tokenizer is None and m.path is None:
            raise ConfigError("tokenizer: text data needs a tokenizer (a path, 'bytes', or model.path's)")
    if dc.type == "hub" and not dc.name:
        raise ConfigError("data.name: data.type is 'hub' but no dataset name is given")
    if dc.type == "synthetic":
        vocab = (m.config or {}).get("vocab_size")
        need = 4 + s.num_values * s.passkey_len
        if vocab is not None and vocab < need:
            raise ConfigError(
                f"model.config.vocab_size {vocab} is too small for the passkey task: it needs at least "
                f"{need} (3 special tokens, num_values * passkey_len key tokens, filler)"
            )

    r = cfg.saving.resume_from
    if r is not None and r != "latest":
        cfg.saving.resume_from = _resolve(r, base)
        _need_path(cfg.saving.resume_from, "saving.resume_from", "checkpoint directory")
