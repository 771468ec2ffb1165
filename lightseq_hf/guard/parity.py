"""``check_parity``: prove on one batch that sequence parallelism changed nothing.

One forward and backward of the patched, sequence-parallel model, then the same computation on each
rank alone by the model as Transformers defines it (its original forwards and the attention
implementation it had before the patch: :mod:`.reference`), on the batch or a prefix of it, with the
same weights and inputs and no random draws on either side. Compared (:mod:`.verdict`): the loss, and
every parameter's gradient through random projections (linear, so the mean of the unsharded runs' over
all ranks is the projection of the gradient DDP's average gives). Also checked, from outside the
library: every attention layer ran the distributed attention once, over the rank's group, on the
shard's length; and the gradients the optimizer will see (after DDP/FSDP or the loop's ``sync``) are
the same on every rank of the group. The ranks exchange their findings, so all reach the same verdict.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._values import is_positive_int
from ..parallel.groups import launched_world_size
from ..patches.state import resolve_sp_group
from .gradients import gradient_sketch, is_sharded_gradient
from .observe import AttentionWatch
from .reference import (
    CU_KEYS,
    SEQUENCE_KEYS,
    attention_upcast,
    batch_shape,
    document_ids,
    reference_attention,
    take_prefix,
    unpacked_documents,
    unpatched_model,
)
from .state import preserved_state
from .verdict import Findings, summary, verdict

_IGNORE_INDEX = -100  # the label transformers' losses skip
_logger = logging.getLogger("lightseq_hf")

#: default relative tolerances by the attention's dtype. float32: the brief's 1e-5 (correct setups measure
#: about 5e-7). bfloat16 and float16: about 3.5x the worst error of 80 correct checks each (40 with weights
#: in the dtype, 40 fp32 weights under autocast; random 2-layer GQA Mistral models with a window, plain,
#: packed, padded and cu_seq_lens rows of 12-36 tokens, 2 gloo processes; torch 2.13 CPU, transformers
#: 5.23, 2026-11-24): bfloat16 0.0276 (loss 2.2e-4), float16 0.0035 (loss 4.2e-5).
DEFAULT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 0.1, torch.float16: 0.0125}
#: the precision of the unsharded run that measures what the attention's rounding changes (the tolerance's
#: yardstick, :mod:`.verdict`), by the attention's dtype
_PRECISE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
#: default prefix: this fraction of a fine-tune micro-batch's cost (sharded + unsharded passes)
_COST_FRACTION = 0.04
_MIN_TOKENS_PER_RANK = 16

__all__ = ["DEFAULT_RTOL", "ParityError", "check_parity", "default_max_tokens", "summary"]


class ParityError(RuntimeError):
    """The sequence-parallel run differs from the unpatched model's (one-line message; ``.report``)."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def default_max_tokens(rows: int, length: int, sp_size: int) -> int:
    """Tokens whose two passes cost about ``_COST_FRACTION`` of one micro-batch of ``rows x length``.

    Per rank, the micro-batch costs ``T / P`` token-passes and the check ``n / P`` (sharded) plus ``n``
    (unsharded): ``n = f T / (1 + P)``, and at least ``_MIN_TOKENS_PER_RANK`` per rank.
    """
    tokens = rows * length
    return min(tokens, max(int(_COST_FRACTION * tokens / (1 + sp_size)), _MIN_TOKENS_PER_RANK * sp_size))


def check_parity(
    model: torch.nn.Module,
    batch: dict[str, Any],
    *,
    max_tokens: int | None = None,
    rtol: float | None = None,
    sync: Callable[[torch.nn.Module], None] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Check that the patched, sequence-parallel ``model`` computes the loss and gradients of the same
    model run without the patch, on ``batch`` (every rank of the group passes the same full rows, as to
    the model; labels default to ``input_ids``). Every rank must call it.

    ``max_tokens``: check at most this many tokens (a prefix of the rows; default: about 4% of the cost
    of a forward and backward of the batch). ``rtol``: tolerance on the relative errors (default by dtype,
    :data:`DEFAULT_RTOL`). ``sync``: what the training loop does to the gradients after ``backward()``
    when the model is wrapped in neither DDP nor FSDP (e.g. :func:`lightseq_hf.sync_gradients`).
    Parameters, gradients, buffers, training modes and RNG states are left as they were; no optimizer
    step. Returns a report (dict); raises :class:`ParityError` (same message on every rank) when the
    errors exceed ``rtol``, an attention layer did not run distributed on its shard, or the gradients
    differ between the ranks of a group. Under a launch whose sequence-parallel groups all have one rank
    (data parallelism only) nothing is split: the report says there is nothing to compare (``compared``
    False, ``note``), and the note is logged.
    """
    start = time.perf_counter()
    _check_options(max_tokens, rtol)
    target = _patched_module(model)
    group = resolve_sp_group(getattr(target, "_lightseq_settings", None))  # refuses an unsplit launch
    rank, sp_ranks = _rank_and_group(group)
    attention = reference_attention(target)
    device = _device_of(model)
    problem = prefix = inputs = labels = None
    try:
        prefix, inputs, labels = _prepare(batch, max_tokens, len(sp_ranks), device)
    except ValueError as err:  # raised on every rank after the exchange below, never on one alone
        problem = str(err)
    gathered = _gather((rank, sp_ranks, problem))
    _check_same_groups(gathered)
    unsplit = _nothing_split(gathered)
    if unsplit is not None:
        return unsplit
    docs = document_ids(inputs, prefix.rows, prefix.length, device)
    params = [p for _, p in model.named_parameters()]
    with preserved_state(model):
        watch = AttentionWatch(target)
        with watch:
            loss = model(**inputs).loss
        loss_value, sketch, sharded = _backward(model, loss, sync, params, seed)
        dtypes = [c.dtype for found in watch.calls.values() for c in found]
        floats = [p.dtype for p in params if p.is_floating_point()]
        dtype = dtypes[0] if dtypes else (floats or [torch.float32])[0]
        reference = _reference_passes(model, target, attention, unpacked_documents(inputs, docs) or inputs,
                                      params, seed, _PRECISE.get(dtype))
    calls = {name: [(c.local_length, c.group) for c in found] for name, found in watch.calls.items()}
    tolerance = rtol if rtol is not None else DEFAULT_RTOL.get(dtype, 1e-5)
    error, loss_ref, sketch_ref, norms_ref, loss_precise, sketch_precise = reference
    findings = _gather((error, Findings(
        rank, sp_ranks, _group_name(group), loss=loss_value, loss_reference=loss_ref, sketch=sketch[0],
        sketch_reference=sketch_ref, norms_reference=norms_ref, loss_precise=loss_precise,
        sketch_precise=sketch_precise, calls=calls, interface_calls=watch.interface_calls,
        sharded_grads=sharded or _fsdp1(model))))
    _check_reference_ran(findings, attention)
    report = verdict([f for _, f in findings], prefix, tolerance,
                     [_display(n) for n, _ in model.named_parameters()], attention)
    report.update(dtype=str(dtype).replace("torch.", ""), gradient_sync=_sync_kind(model, sync, sharded),
                  documents=sum(len(row[row >= 0].unique()) for row in docs),
                  padding_tokens=int((docs < 0).sum()), windows=_windows(target),
                  window_exercised=any(prefix.length > w for w in _windows(target)), labels=labels,
                  seconds=round(time.perf_counter() - start, 3))
    if report["failures"]:
        raise ParityError("lightseq_hf parity check failed: " + "; ".join(report["failures"]), report)
    return report


def _as_tensors(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its per-token entries given as lists (a collator's output) made tensors, as the
    model's own code would need them; ValueError naming an entry that cannot be one (ragged rows)."""
    out = dict(batch)
    for key in (*SEQUENCE_KEYS, *CU_KEYS):
        if isinstance(out.get(key), (list, tuple)):
            try:
                out[key] = torch.as_tensor(out[key])
            except (ValueError, TypeError, RuntimeError) as err:
                kind, why = type(out[key]).__name__, str(err).splitlines()[0]
                raise ValueError(f"the parity check's batch entry {key!r} is a {kind} that cannot be made a "
                                 f"tensor ({why}); pass tensors of (rows, length).") from None
    return out


def _prepare(batch: dict[str, Any], max_tokens: int | None, sp_size: int, device: torch.device):
    """(prefix, inputs on ``device``, which labels) of the batch, or ValueError naming what is wrong."""
    batch = _as_tensors(batch)
    rows, length = batch_shape(batch)
    if length < 2:
        raise ValueError(f"the parity check needs rows of at least 2 tokens (a next-token loss); the batch's "
                         f"rows have {length}.")
    prefix = take_prefix(batch, max_tokens or default_max_tokens(rows, length, sp_size),
                         min(length, _MIN_TOKENS_PER_RANK * sp_size))
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prefix.batch.items()}
    return prefix, inputs, _label_tokens(inputs, prefix.tokens)


def _check_options(max_tokens: int | None, rtol: float | None) -> None:
    if max_tokens is not None and not is_positive_int(max_tokens):
        raise ValueError(f"max_tokens must be a positive int (or None for the default); got {max_tokens!r}.")
    if rtol is not None and (isinstance(rtol, bool) or not isinstance(rtol, (int, float))
                             or not math.isfinite(rtol) or rtol <= 0):
        raise ValueError(f"rtol must be a positive finite number (or None for the dtype's default); "
                         f"got {rtol!r}.")


def _label_tokens(inputs: dict[str, Any], tokens: int) -> str:
    """Make sure the checked prefix has a supervised token (a loss over none is NaN and compares with
    nothing): the batch's labels when the prefix has one, else next-token labels from ``input_ids``
    (padding excluded). Returns which labels the check uses."""
    labels, shifted = inputs.get("labels"), inputs.get("shift_labels")
    if shifted is not None and bool((shifted != _IGNORE_INDEX).any()):
        return "shift_labels"
    if shifted is None and labels is not None and bool((labels[..., 1:] != _IGNORE_INDEX).any()):
        return "labels"
    ids = inputs.get("input_ids")
    if ids is None:
        raise ValueError(f"the parity check's prefix of {tokens} tokens has inputs_embeds and no supervised "
                         "label; pass labels that supervise its tokens, or raise max_tokens.")
    mask = inputs.get("attention_mask")
    inputs.pop("shift_labels", None)
    padded = mask is not None and mask.dim() == 2
    inputs["labels"] = ids.masked_fill(mask == 0, _IGNORE_INDEX) if padded else ids
    given = "no labels were given" if labels is None and shifted is None else "no label in the prefix"
    return f"input_ids ({given})"


def _reference_passes(model, target, attention, inputs, params, seed, precise: torch.dtype | None):
    """(error or None, loss, sketch, norms, loss and sketch with the attention in ``precise`` or None) of
    the unsharded runs on this rank: ``model`` as Transformers defines it, outside DDP (its gradients are
    this rank's alone), with no gradient sync."""
    alone = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    try:
        with unpatched_model(target, attention):
            value, (sketch, norms) = _unsharded_pass(alone, inputs, params, seed)
            precise_value = precise_sketch = None
            if precise is not None:
                with attention_upcast(attention, precise):
                    precise_value, (precise_sketch, _) = _unsharded_pass(alone, inputs, params, seed)
    except Exception as err:  # noqa: BLE001  (reported on every rank by the verdict's exchange)
        return (f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", math.nan, None,
                None, None, None)
    return None, value, sketch, norms, precise_value, precise_sketch


def _unsharded_pass(model, inputs, params, seed) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    """Forward and backward of ``model`` on whole rows (under :func:`unpatched_model`); clears the
    gradients. (loss, (sketch, norms))."""
    loss = model(**{"use_cache": False, **inputs}).loss
    value, sketch, _ = _backward(model, loss, None, params, seed)
    return value, sketch


def _backward(model, loss, sync, params, seed) -> tuple[float, tuple[torch.Tensor, torch.Tensor], bool]:
    """Backward, the loop's sync, the gradients' sketch; clears the gradients. (loss, sketch, sharded)."""
    if loss is None:
        raise ValueError("the model returned no loss for the parity check's batch; pass labels.")
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(f"the model's loss for the parity check's batch is {type(loss).__name__} "
                         f"{tuple(getattr(loss, 'shape', ()))}, not one number; the check compares a scalar "
                         "loss (reduce it in the model, or pass labels its loss reads).")
    value = float(loss.detach().float())
    loss.backward()
    if sync is not None:
        sync(model)
    sketch = gradient_sketch(params, seed)
    sharded = any(is_sharded_gradient(p.grad) for p in params)
    for p in params:
        p.grad = None
    return value, sketch, sharded


def _check_reference_ran(findings: list[tuple[str | None, Findings]], attention: str) -> None:
    """ParityError on every rank when the unsharded run raised on some rank (nothing to compare with)."""
    failed = [(f.rank, error) for error, f in findings if error]
    if failed:
        rank, error = failed[0]
        raise ParityError(f"lightseq_hf parity check failed: rank {rank}: the check's reference run raised "
                          f"{error} (the unpatched model, attention {attention!r}, whole rows on one rank)",
                          {"passed": False})


def _windows(target: torch.nn.Module) -> list[int]:
    """The sliding windows the model's config declares (layers of that kind), for the report."""
    config = target.config
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ()
    uses = "sliding_attention" in kinds or not kinds and bool(getattr(config, "use_sliding_window", True))
    return [int(window)] if isinstance(window, int) and window > 0 and uses else []


def _check_same_groups(gathered: list[tuple[int, tuple[int, ...], str | None]]) -> None:
    """A batch refused on any rank is refused on all; every member of a rank's sequence-parallel group
    must use the same group (else the forward hangs)."""
    problems = [(rank, problem) for rank, _, problem in gathered if problem]
    if problems:
        rank, problem = problems[0]
        same = len(problems) == len(gathered) and len({p for _, p in problems}) == 1
        raise ValueError(problem if same else f"rank {rank}: {problem}")
    group_of = {rank: members for rank, members, _ in gathered}
    for rank, members, _ in gathered:
        for other in members:
            if group_of.get(other) != members:
                alone = min((r for r in (rank, other) if len(group_of[r]) == 1), default=None)
                what = (f"ranks {rank} and {other} disagree on their sequence-parallel group" if alone is None
                        else f"rank {alone} would run its attention unsharded (a group of one)")
                raise ParityError(
                    f"lightseq_hf parity check failed: {what}: rank {rank} uses ranks {list(members)}, rank "
                    f"{other} uses {list(group_of[other])}. Patch every rank the same way "
                    "(lightseq_hf.init_sequence_parallel(sp_size) on every rank, or the same "
                    "sp_group everywhere).", {"passed": False})


def _nothing_split(gathered: list[tuple[int, tuple[int, ...], str | None]]) -> dict[str, Any] | None:
    """The report of a check with nothing to compare: every rank's sequence-parallel group has 1 rank under
    a launch of several processes (data parallelism only); else None."""
    world = max(len(gathered), launched_world_size())
    if world == 1 or any(len(members) > 1 for _, members, _ in gathered):
        return None
    note = (f"lightseq_hf parity check: nothing to compare: every rank's sequence-parallel group has 1 rank "
            f"under a launch of {world} processes (data parallelism only), so each runs whole sequences and "
            "nothing is split; use groups of several ranks (lightseq_hf.init_sequence_parallel(sp_size) with "
            "sp_size > 1, or none: the whole world) to split them.")
    _logger.warning(note)
    return {"compared": False, "note": note, "sp_size": 1, "world_size": world}


# ----------------------------------------------------------------------------- helpers


def _patched_module(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module of ``model`` whose class forward lightseq_hf patched (else ValueError)."""
    found = [m for m in model.modules() if getattr(type(m).forward, "_lightseq_patched", False)]
    if not found:
        raise ValueError(f"{type(model).__name__} is not patched by lightseq_hf; call "
                         "lightseq_hf.patch_llama(model) before check_parity.")
    return found[0]


def _rank_and_group(group) -> tuple[int, tuple[int, ...]]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, (0,)
    group = group if group is not None else dist.group.WORLD
    return dist.get_rank(), tuple(dist.get_process_group_ranks(group))


def _group_name(group) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return (group if group is not None else dist.group.WORLD).group_name


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _fsdp1(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


def _sync_kind(model: torch.nn.Module, sync, sharded: bool) -> str:
    if sharded or _fsdp1(model):
        return "fsdp"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    return getattr(sync, "__name__", "custom") if sync is not None else "none"


def _display(name: str) -> str:
    """A parameter's name without wrapper prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name
