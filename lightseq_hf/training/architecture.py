"""``model.config`` checked against the architecture's own config class (from transformers) before a
run: keys it does not know (with the closest known key), numbers that are booleans, NaN or Inf, and the
sizes the model and the planner divide by."""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any

from .._values import is_positive_int
from .errors import ConfigError

__all__ = ["check_model_config", "model_vocab_size"]

_POSITIVE_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
#: the config keys architectures read their attention dropout from
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop")


def _path_entries(model_path: str | None) -> dict:
    if model_path is None:
        return {}
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # from_pretrained reports it with its own words


def _config_class(model_type: Any) -> Any:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"model.config.model_type: transformers knows no architecture {model_type!r}{hint}")
    return CONFIG_MAPPING[model_type]


def _check_numbers(entries: dict, prefix: str = "model.config") -> None:
    for key, value in entries.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            _check_numbers(value, name)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}: must be a finite number; got {value}")
        elif key in _POSITIVE_INT_KEYS and value is not None and not is_positive_int(value):
            raise ConfigError(f"{name}: must be a positive integer; got {value!r}")
        elif key == "rope_theta" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value <= 0):
            raise ConfigError(f"{name}: must be a positive number; got {value!r}")


def _check_against_defaults(cls: Any, entries: dict) -> None:
    """Unknown keys (with the closest known one) and booleans where the class holds a number."""
    default = cls()
    known = set(default.to_dict())
    for key, value in entries.items():
        base = getattr(default, key, None)
        if isinstance(value, bool) and isinstance(base, (int, float)) and not isinstance(base, bool):
            raise ConfigError(f"model.config.{key}: expected a number, not the boolean {str(value).lower()}")
    try:
        built = cls(**entries)
    except Exception as e:  # noqa: BLE001 - the class's own refusal, reported in one line
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(f"model.config: {cls.__name__} refused the entries: {msg}") from None
    unknown = sorted(set(built.to_dict()) - known)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; {cls.__name__} has no such setting"
        raise ConfigError(f"model.config.{key}: not a key of {cls.__name__} (transformers would ignore it)"
                          f"{hint}")


def check_model_config(entries: dict | None, model_path: str | None) -> None:
    """ConfigError naming the first ``model.config`` entry the architecture does not accept, or a size of
    the combined config (``model.path``'s config.json under the entries) that cannot work."""
    entries = dict(entries or {})
    merged = {**_path_entries(model_path), **entries}
    _check_numbers(entries)
    hidden, heads = merged.get("hidden_size"), merged.get("num_attention_heads")
    if merged.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
            and hidden % heads:
        raise ConfigError(f"model.config: hidden_size {hidden} is not divisible by num_attention_heads "
                          f"{heads}; set head_dim")
    kv = merged.get("num_key_value_heads")
    if isinstance(kv, int) and isinstance(heads, int) and kv > 0 and heads % kv:
        raise ConfigError(f"model.config: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv} (each key/value head serves a group of query heads)")
    _check_attention_dropout(merged)
    model_type = entries.pop("model_type", None) or merged.get("model_type")
    if model_type is not None and entries:
        _check_against_defaults(_config_class(model_type), entries)


def _check_attention_dropout(merged: dict) -> None:
    """The distributed attention has no dropout and refuses it at the first training step; a run would
    stop there after its set-up, so it is refused with the config."""
    for key in _ATTENTION_DROPOUT_KEYS:
        rate = merged.get(key)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            raise ConfigError(f"model.config.{key}: {rate}; lightseq_hf's distributed attention has no "
                              f"dropout; set model.config.{key}=0.0")


def model_vocab_size(entries: dict | None, model_path: str | None) -> int | None:
    """The model's ``vocab_size`` from ``model.config`` or ``model.path``'s config.json, when given."""
    vocab = {**_path_entries(model_path), **(entries or {})}.get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
