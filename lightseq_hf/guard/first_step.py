"""The parity check as a fine-tune's first step: its YAML section and the call the training loop makes.

YAML (``parity:`` section; every key optional)::

    parity:
      enabled: true        # run the check at the first step
      max_tokens: null     # tokens checked (a prefix of the first micro-batch); null: ~4% of its cost
      rtol: null           # relative tolerance; null: by dtype (lightseq_hf.guard.DEFAULT_RTOL)

The loop calls :func:`run_first_step_check` before its first optimizer step with the first micro-batch,
writes the returned report into ``metrics.jsonl`` (``kind: parity``) and ``summary.json``, and on
:class:`~lightseq_hf.ParityError` stops with the error's one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt

from ..metrics import matmul_params, model_flops_per_step
from .parity import check_parity, default_max_tokens

__all__ = ["ParityConfig", "check_cost_fraction", "run_first_step_check"]


class ParityConfig(BaseModel):
    """The ``parity`` section of a fine-tune config."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    max_tokens: PositiveInt | None = None
    rtol: PositiveFloat | None = None


def run_first_step_check(
    model: torch.nn.Module,
    batch: dict[str, Any],
    config: ParityConfig | dict[str, Any] | None = None,
    *,
    sync: Callable[[torch.nn.Module], None] | None = None,
) -> dict[str, Any]:
    """Run :func:`lightseq_hf.check_parity` as configured; the report (``{"enabled": False}`` when off).

    ``model`` is the model as the loop steps it (DDP/FSDP-wrapped when it is); ``sync`` what the loop
    does to gradients after backward when it is not. Raises :class:`~lightseq_hf.ParityError` on failure.
    """
    config = config if isinstance(config, ParityConfig) else ParityConfig.model_validate(config or {})
    if not config.enabled:
        return {"enabled": False}
    report = check_parity(model, batch, max_tokens=config.max_tokens, rtol=config.rtol, sync=sync)
    return {"enabled": True, **report}


def check_cost_fraction(model_config: Any, context_length: int, sp_size: int, micro_batches: int,
                        rows: int = 1, max_tokens: int | None = None, unsharded_passes: int = 2) -> float:
    """Model FLOPs of the check over those of the first optimizer step, per rank, for a Llama-style
    ``model_config`` (no recompute counted on either side).

    The step: ``micro_batches`` micro-batches of ``rows x context_length`` tokens split over ``sp_size``
    ranks. The check on ``n`` tokens: the same computation split over the group, plus on every rank
    ``unsharded_passes`` passes of the unpatched model on whole rows (the reference and its
    higher-precision yardstick), their attention counted at all ``n^2`` pairs (an upper bound).
    """
    tokens = max_tokens or default_max_tokens(rows, context_length, sp_size)
    n_params = matmul_params(model_config)
    step = micro_batches * model_flops_per_step(model_config, n_params, rows, context_length) / sp_size
    sharded = model_flops_per_step(model_config, n_params, 1, tokens) / sp_size
    unsharded = model_flops_per_step(model_config, n_params, 1, tokens, attention_pairs=tokens**2)
    return (sharded + unsharded_passes * unsharded) / step
