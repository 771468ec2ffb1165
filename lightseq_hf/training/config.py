"""Fine-tuning configuration: YAML -> pydantic models, validated up front.

Every error names the offending key (``training.lr``, ``data.paths[1]``, ...). Types, choices,
ranges, finiteness (NaN/Inf are refused) and unknown keys are checked by the schema below;
:func:`validate` adds what depends on several keys, the world size or the file system.
``load_config(path, overrides)`` reads a YAML file and applies command-line overrides written
``dotted.key=value`` (the value is parsed as YAML, so ``3``, ``1e-4``, ``true``, ``null`` and
``[a, b]`` work).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from ..checkpoint import CHECKPOINTING_MODES
from ..kernels import BACKENDS
from .architecture import check_model_config, model_vocab_size
from .data import FILE_FORMATS, detect_format
from .errors import ConfigError
from .keys import meant_key
from .shape import check_sizes

__all__ = ["ConfigError", "FinetuneConfig", "OffloadLayers", "RESUME_LATEST", "RESUME_LATEST_OR_FRESH",
           "config_from_dict", "load_config", "parse_overrides", "validate"]


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value


def _no_as_string(value: Any) -> Any:
    return "no" if value is False else value  # YAML 1.1 reads an unquoted `no` as false


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic would read true as 1: a number key given a switch is a mistake
        raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
    return value


def _number(kind: type, **bounds: Any) -> Any:
    return Annotated[kind, BeforeValidator(_not_bool), Field(**bounds)]


_PosInt = _number(int, gt=0)
_NonNegInt = _number(int, ge=0)
_PosFloat = _number(float, gt=0)
_NonNegFloat = _number(float, ge=0)
_Fraction = _number(float, ge=0, le=1)
_OpenFraction = _number(float, gt=0, lt=1)
_Beta = _number(float, ge=0, lt=1)
_Seed = _number(int, ge=0, lt=2**32)  # numpy's seeds are 32-bit
_MAX_TIMEOUT_S = 30 * 24 * 3600
#: a shorter bound fails healthy start-ups: each process waits for the others to start and connect (seconds)
_MIN_TIMEOUT_S = 1.0
_StrList = Annotated[list[str], BeforeValidator(_as_list)]

#: top-level keys starting with this are ignored (anchors for YAML merge keys, ``<<: *name``)
_EXTENSION_PREFIX = "x-"
RESUME_LATEST = "latest"  # newest complete checkpoint in output_dir; an error when there is none
RESUME_LATEST_OR_FRESH = "latest_or_fresh"  # ... or start from step 0 when there is none


class _Section(BaseModel):
    """Shared settings: unknown keys, NaN and Inf are errors; numbers may stand for strings."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, coerce_numbers_to_str=True,
                              protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _empty_section(cls, data: Any) -> Any:
        return {} if data is None else data  # `training:` with nothing under it

    def to_dict(self) -> dict:
        return self.model_dump()


class _ModelConfig(_Section):
    """``path``: a local Hugging Face checkpoint; ``config``: inline config entries (the whole
    architecture for random init, or overrides on top of ``path``'s config)."""

    path: str | None = None
    config: dict | None = None
    random_init: StrictBool = False  # build from path's config.json but do not load its weights
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights


class _SyntheticConfig(_Section):
    """The on-the-fly passkey task (see lightseq_hf.training.synthetic)."""

    task: Literal["passkey"] = "passkey"
    num_values: _PosInt = 16
    passkey_len: _PosInt = 1
    needle_max_frac: _OpenFraction = 0.5
    needle_repeat: _PosInt = 1  # the needle states the key this many times in a row
    filler: Literal["repeat", "random"] = "repeat"  # repeat: one sentence repeated (classic passkey test)
    filler_period: _PosInt = 32
    num_samples: _PosInt = 1_000_000
    eval_samples: _NonNegInt = 32
    seed: _Seed = 1234


class _DataConfig(_Section):
    """``type``: ``synthetic`` (generated), ``files`` (local json/jsonl/text/parquet) or ``hub``."""

    type: Literal["synthetic", "files", "hub"] = "synthetic"
    paths: _StrList = Field(default_factory=list)
    format: Literal["auto", "json", "text", "parquet", "csv"] = "auto"  # ``json`` covers jsonl
    name: str | None = None  # hub dataset name (type: hub)
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    add_eos: StrictBool = True
    # documents: position ids restart per document, attention and labels stay inside it; concat: one sequence
    packing: Literal["documents", "concat"] = "documents"
    max_documents: _PosInt | None = None
    num_proc: _PosInt | None = None
    synthetic: _SyntheticConfig = Field(default_factory=_SyntheticConfig)


class OffloadLayers(_Section):
    """``training.offload_checkpoints`` layer by layer, as ``auto`` chooses it: the first ``layers``
    decoder layers keep their checkpoints in host memory; the first ``recompute`` keep only their input
    (plain recompute: their attention forward runs again in backward)."""

    layers: _NonNegInt
    recompute: _NonNegInt = 0


class _TrainingConfig(_Section):
    """Optimization. ``batch_size`` is sequences per data-parallel group per micro-step."""

    max_steps: _PosInt | None = None  # optimizer steps; None: run ``epochs`` epochs
    epochs: _PosInt = 1
    batch_size: _PosInt = 1
    grad_accum: _PosInt = 1
    lr: _PosFloat = 3e-4
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: _NonNegInt = 0
    min_lr_ratio: _Fraction = 0.1
    weight_decay: _NonNegFloat = 0.0
    betas: Annotated[list[_Beta], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [0.9, 0.95])
    max_grad_norm: _PosFloat | None = 1.0
    # no | bf16 | fp16; None: the accelerate config's setting
    mixed_precision: Annotated[Literal["no", "bf16", "fp16"] | None, BeforeValidator(_no_as_string)] = None
    checkpointing: Literal[(*CHECKPOINTING_MODES, "none")] = "remat"  # type: ignore[valid-type]
    backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: _Seed = 0
    # bound on every collective wait (a frozen or missing peer ends the run), the start-up's included; 1 s
    # to 30 days
    timeout_s: _number(float, ge=_MIN_TIMEOUT_S, le=_MAX_TIMEOUT_S) = 600.0  # type: ignore[valid-type]
    on_nonfinite: Literal["error", "skip"] = "error"  # a NaN/Inf loss or grad norm: stop, or skip the update
    # memory options (README "Memory")
    # what checkpointed layers keep -> pinned host memory, prefetched: true (every layer), N (the first N
    # layers), {layers: N, recompute: R} (and the first R keep only their input), auto (the planner's
    # choice for this machine's device and host memory, at launch)
    offload_checkpoints: (StrictBool | Annotated[StrictInt, Field(ge=0)] | Literal["auto"]
                          | OffloadLayers) = False
    tiled_mlp: _PosInt | None = None  # MLP and norm tokens per tile (e.g. 8192); null: untiled
    cpu_offload: StrictBool = False  # FSDP2 CPUOffloadPolicy: master weights, grads, AdamW state on host


class _LoggingConfig(_Section):
    """Progress bar, metrics (JSON lines), loss-curve PNG, evaluation cadence."""

    every: _PosInt = 1
    eval_every: _NonNegInt = 0  # steps between retrieval evaluations (synthetic data); 0: only at the end
    progress_bar: StrictBool = True
    metrics_file: str = "metrics.jsonl"
    plot: StrictBool = True
    peak_tflops: _PosFloat | None = None  # for MFU; default: 989 on H100/H200, else unknown


class _SavingConfig(_Section):
    """Checkpoints under ``output_dir/checkpoint-<step>``; ``resume_from``: a checkpoint path,
    ``latest`` (the newest complete one; an error if none) or ``latest_or_fresh``."""

    every: _NonNegInt = 0  # steps between checkpoints; 0: only at the end
    final: StrictBool = True
    resume_from: str | None = None
    save_optimizer: StrictBool = True
    checksums: StrictBool = True  # sha256 of every file in the completion record, verified on resume
    if_output_exists: Literal["error", "archive"] = "error"  # a fresh run into a used output_dir
    on_schedule_change: Literal["error", "rebuild", "keep"] = "error"  # resume with another step count
    resume_other_run: StrictBool = False  # allow resume_from to name a checkpoint outside output_dir


class _ParityCheckConfig(_Section):
    """The first-step parity check (``lightseq_hf.check_parity``): the sequence-parallel first step against
    the same step computed without sequence parallelism; a failure stops the run with one line."""

    enabled: StrictBool = True  # check at the first step of a fresh run (sp_size > 1)
    max_tokens: _PosInt | None = None  # tokens checked (a prefix of the first micro-batch); None: ~4%
    rtol: _PosFloat | None = None  # relative tolerance; None: by dtype (float32 1e-5, bfloat16 0.1)


class FinetuneConfig(_Section):
    """The whole run."""

    context_length: _PosInt = 4096
    sp_size: _PosInt | None = None  # ranks per sequence; None: every rank
    output_dir: str = "runs/finetune"
    tokenizer: str | None = None  # path, ``bytes``, or None (model.path's, if it has one)
    model: _ModelConfig = Field(default_factory=_ModelConfig)
    data: _DataConfig = Field(default_factory=_DataConfig)
    training: _TrainingConfig = Field(default_factory=_TrainingConfig)
    logging: _LoggingConfig = Field(default_factory=_LoggingConfig)
    saving: _SavingConfig = Field(default_factory=_SavingConfig)
    parity: _ParityCheckConfig = Field(default_factory=_ParityCheckConfig)


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    cls: Any = FinetuneConfig
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = field.annotation
    return cls


def _describe(err: dict) -> str:
    """One pydantic error as a sentence that starts with the dotted key."""
    loc = tuple(err["loc"])
    key = _dotted(loc) or "config"
    if err["type"] == "extra_forbidden":
        section = _section_at(loc[:-1])
        known = f"; known keys: {', '.join(sorted(section.model_fields))}" if section else ""
        meant = meant_key(str(loc[-1]), list(section.model_fields) if section else [])
        hint = f"; did you mean {_dotted((*loc[:-1], meant))}?" if meant else ""
        return f"unknown key {key}{hint} (in {_dotted(loc[:-1]) or 'top level'}{known})"
    msg = err["msg"]
    if err["type"] == "value_error":  # our own validators' words, without pydantic's prefix
        msg = str(err.get("ctx", {}).get("error", msg))
    msg = msg[0].lower() + msg[1:]
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"{key}: expected a mapping; got {err['input']!r}"
    if err["type"] == "missing":
        return f"{key}: {msg}"
    return f"{key}: {msg}; got {err['input']!r}"


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
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    data = {k: v for k, v in copy.deepcopy(data or {}).items()  # x-...: a place for YAML anchors
            if not (isinstance(k, str) and k.startswith(_EXTENSION_PREFIX))}
    for key, value in parse_overrides(overrides or []):
        _set_dotted(data, key, value)
    try:
        cfg = FinetuneConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err) for err in e.errors())) from None
    validate(cfg, base_dir=base_dir, world_size=world_size)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys, then this mapping's win
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{key_node.start_mark.name}: key {key!r} appears twice in one mapping "
                                  f"(lines {seen[key]} and {line}); the second would silently replace the "
                                  "first: merge them")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: list[str] | None = None,
                world_size: int | None = None) -> FinetuneConfig:
    """Read a YAML file, apply ``key.sub=value`` overrides, validate."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a YAML file (e.g. configs/tiny.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
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
    """Checks the schema cannot make alone (several keys, the world size, paths, the architecture);
    raise ConfigError naming the key. Relative paths are resolved in place."""
    base = Path(base_dir) if base_dir is not None else None
    cfg.output_dir = os.path.expanduser(cfg.output_dir)
    _validate_layout(cfg, world_size)
    _inside_output_dir(cfg.logging.metrics_file, "logging.metrics_file", cfg.output_dir)
    vocab = _validate_model(cfg, base)
    _check_input_memory(cfg)
    _validate_data(cfg, base, vocab)
    r = cfg.saving.resume_from
    if r is not None and r not in (RESUME_LATEST, RESUME_LATEST_OR_FRESH):
        cfg.saving.resume_from = _resolve(r, base)
        _need_path(cfg.saving.resume_from, "saving.resume_from",
                   f"checkpoint directory (or '{RESUME_LATEST}' / '{RESUME_LATEST_OR_FRESH}')")
        if not Path(cfg.saving.resume_from).is_dir():
            raise ConfigError(f"saving.resume_from: {cfg.saving.resume_from!r} is a file, not a checkpoint "
                              f"directory; pass a checkpoint-<step> directory, '{RESUME_LATEST}' or "
                              f"'{RESUME_LATEST_OR_FRESH}'")


def _inside_output_dir(value: str, key: str, output_dir: str) -> None:
    """``value``, a file the run writes, must be a path relative to ``output_dir`` that stays inside it (a
    run's files move with it, and are what a resume or an archive of the run finds)."""
    path = Path(os.path.expanduser(value))
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ConfigError(f"{key}: {value!r} is not inside output_dir ({output_dir}): give a path relative "
                          "to output_dir, such as metrics.jsonl or logs/metrics.jsonl")


def _validate_layout(cfg: FinetuneConfig, world_size: int | None) -> None:
    t = cfg.training
    if t.offload_checkpoints and t.checkpointing == "none":
        raise ConfigError("training.offload_checkpoints needs checkpointing (training.checkpointing remat or "
                          "hf): it offloads what checkpointed layers keep")
    check_sizes(cfg.context_length, cfg.sp_size, world_size)  # None: not launched yet


def _validate_model(cfg: FinetuneConfig, base: Path | None) -> int | None:
    """model.*, the tokenizer path and the architecture entries; the model's vocab_size when known."""
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
    check_model_config(m.config, m.path)
    return model_vocab_size(m.config, m.path)


def _validate_data(cfg: FinetuneConfig, base: Path | None, vocab: int | None) -> None:
    dc = cfg.data
    if dc.type == "files":
        if not dc.paths:
            raise ConfigError("data.paths: data.type is 'files' but no paths are given")
        for i, p in enumerate(dc.paths):
            dc.paths[i] = _resolve(str(p), base)
            _need_path(dc.paths[i], f"data.paths[{i}]", "data file")
            if Path(dc.paths[i]).is_dir():
                raise ConfigError(f"data.paths[{i}]: {dc.paths[i]!r} is a directory; list the data files in "
                                  "it (data.paths=[dir/a.jsonl, dir/b.jsonl])")
        if all(Path(q).stat().st_size == 0 for q in dc.paths):
            raise ConfigError("data.paths: every data file is empty; add documents to them")
        if cfg.tokenizer is None and cfg.model.path is None:
            raise ConfigError("tokenizer: text data needs a tokenizer (a path, 'bytes', or model.path's)")
        _check_formats(dc.paths, dc.format)
    if dc.type != "synthetic" and cfg.tokenizer == "bytes" and vocab is not None and vocab < _BYTE_VOCAB:
        raise ConfigError(
            f"tokenizer: the byte tokenizer produces {_BYTE_VOCAB} ids (256 bytes and end-of-text) but the "
            f"model's vocab_size is {vocab}; set model.config.vocab_size={_BYTE_VOCAB} (or more)")
    if dc.type == "hub" and not dc.name:
        raise ConfigError("data.name: data.type is 'hub' but no dataset name is given")
    if dc.type == "synthetic":
        s = dc.synthetic
        need = 4 + s.num_values * s.passkey_len
        if vocab is not None and vocab < need:
            raise ConfigError(
                f"model.config.vocab_size {vocab} is too small for the passkey task: it needs at least "
                f"{need} (3 special tokens, num_values * passkey_len key tokens, filler)"
            )


_BYTE_VOCAB = 257  # data.ByteTokenizer: ids 0-255 and the end-of-text id 256


def _check_formats(paths: list[str], fmt: str) -> None:
    """An explicit data.format must match every file whose extension says otherwise."""
    if fmt == "auto":
        detect_format(paths)  # a file of unknown format, or mixed formats: ConfigError
        return
    for i, p in enumerate(paths):
        suffixes = [x.lower() for x in Path(p).suffixes if x.lower() not in (".gz", ".bz2", ".xz", ".zst")]
        found = FILE_FORMATS.get(suffixes[-1]) if suffixes else None
        if found is not None and found != fmt:
            raise ConfigError(f"data.paths[{i}]: {p!r} is a {found} file but data.format is {fmt!r}; set "
                              f"data.format={found} (or auto)")


def _check_input_memory(cfg: FinetuneConfig) -> None:
    """A micro-batch's token tensors (ids, labels, positions: int64) must fit the host's memory."""
    t = cfg.training
    need = 3 * 8 * t.batch_size * cfg.context_length
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if need > ram:
        raise ConfigError(
            f"training.batch_size {t.batch_size} x context_length {cfg.context_length}: one micro-batch's "
            f"token tensors alone take {need / 2**30:.0f} GiB, more than this host's {ram / 2**30:.0f} GiB; "
            "lower training.batch_size (it counts sequences per data-parallel group per micro-step)")
