"""``check_parity``: prove on one batch that sequence parallelism changed nothing.

One forward and backward of the patched, sequence-parallel model, then the same computation on each
rank alone (whole rows, dense masked attention, the same weights; :mod:`.reference`), on the batch or a
prefix of it. Compared: the loss, and every parameter's gradient through random projections (linear,
so averaging them over the sequence-parallel group averages the gradients). Also checked, from outside
the library: every attention layer ran the distributed attention once, over the rank's group, on the
shard's length; and the gradients the optimizer will see (after DDP/FSDP or the loop's ``sync``) are the
same on every rank of the group. The ranks exchange their findings, so all reach the same verdict.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._values import is_positive_int
from ..patches.state import resolve_sp_group, unsharded
from .gradients import SKETCH_DIM, gradient_sketch, is_sharded_gradient
from .observe import AttentionWatch
from .reference import batch_shape, dense_masked_attention, document_ids, take_prefix
from .state import preserved_state

IGNORE_INDEX = -100  # the label transformers' losses skip

#: default relative tolerances by the attention's dtype. float32: the brief's 1e-5 (correct setups measure
#: about 5e-7). bfloat16 and float16: about 3.5x the worst error of 80 correct checks each (40 with weights
#: in the dtype, 40 fp32 weights under autocast; random 2-layer GQA Mistral models with a window, plain,
#: packed, padded and cu_seq_lens rows of 12-36 tokens, 2 gloo processes; torch 2.13 CPU, transformers
#: 5.23, 2026-11-24): bfloat16 0.0276 (loss 2.2e-4), float16 0.0035 (loss 4.2e-5).
DEFAULT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 0.1, torch.float16: 0.0125}
#: bfloat16 and float16 checks also run the unsharded model with its attention's operands rounded to the
#: dtype, as one flash attention kernel of that dtype rounds them. The relative change that rounding makes
#: to the loss, and the largest it makes to a parameter kind's gradients (every layer's copy of a weight),
#: is the yardstick, and the tolerance is ``max(rtol, NOISE_FACTOR x yardstick)``: deep random-weight
#: models amplify every rounding in the key projections' gradients, and the sharded path rounds more than
#: one kernel (partial outputs merged across ranks) and runs nondeterministic backward kernels. Llama-2-7B
#: shape, FSDP2 bf16 on 2 x H100, 436-873 tokens (2026-11-25): the worst gradient errors 0.068-0.171 were
#: all in key projections, whose largest rounding change measured 0.021-0.112.
NOISE_FACTOR = 8.0
#: a parameter's gradient error is relative to its norm, or to this fraction of the largest one if larger
GRADIENT_FLOOR = 1e-3
#: default prefix: this fraction of a fine-tune micro-batch's cost (sharded + unsharded passes)
COST_FRACTION = 0.04
MIN_TOKENS_PER_RANK = 16


class ParityError(RuntimeError):
    """The sequence-parallel run differs from the unsharded one (one-line message; ``.report``)."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class _Findings:
    """What one rank measured; gathered on every rank."""

    rank: int
    group: tuple[int, ...]
    group_name: str
    loss: float
    loss_reference: float
    sketch: torch.Tensor  # (parameters, SKETCH_DIM) projections of the gradients, sequence-parallel run
    sketch_reference: torch.Tensor  # the same, unsharded run
    norms_reference: torch.Tensor  # (parameters,) gradient norms, unsharded run
    loss_rounded: float | None  # bfloat16/float16: the unsharded run with the attention's operands rounded
    sketch_rounded: torch.Tensor | None  # its gradients' projections
    calls: dict[str, list[tuple[int, str]]]  # attention module -> (local length, group name) per call
    sharded_grads: bool  # FSDP: each rank holds a shard of the averaged gradients


def default_max_tokens(rows: int, length: int, sp_size: int) -> int:
    """Tokens whose two passes cost about ``COST_FRACTION`` of one micro-batch of ``rows x length``.

    Per rank, the micro-batch costs ``T / P`` token-passes and the check ``n / P`` (sharded) plus ``n``
    (unsharded): ``n = f T / (1 + P)``, and at least ``MIN_TOKENS_PER_RANK`` per rank.
    """
    tokens = rows * length
    return min(tokens, max(int(COST_FRACTION * tokens / (1 + sp_size)), MIN_TOKENS_PER_RANK * sp_size))


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
    model run without sequence parallelism, on ``batch`` (every rank of the group passes the same full
    rows, as to the model; labels default to ``input_ids``). Every rank must call it.

    ``max_tokens``: check at most this many tokens (a prefix of the rows; default: about 4% of the cost
    of a forward and backward of the batch). ``rtol``: tolerance on the relative errors (default by dtype,
    :data:`DEFAULT_RTOL`). ``sync``: what the training loop does to the gradients after ``backward()``
    when the model is wrapped in neither DDP nor FSDP (e.g. :func:`lightseq_hf.sync_gradients`).
    Parameters, gradients, buffers, training modes and RNG states are left as they were; no optimizer
    step. Returns a report (dict); raises :class:`ParityError` (same message on every rank) when the
    errors exceed ``rtol``, an attention layer did not run distributed on its shard, or the
    gradients differ between the ranks of a group.
    """
    start = time.perf_counter()
    _check_options(max_tokens, rtol)
    target = _patched_module(model)
    group = resolve_sp_group(getattr(target, "_lightseq_settings", None))
    rank, sp_ranks = _rank_and_group(group)
    rows, length = batch_shape(batch)
    if length < 2:
        raise ValueError(f"the parity check needs rows of at least 2 tokens (a next-token loss); the batch's "
                         f"rows have {length}.")
    prefix = take_prefix(batch, max_tokens or default_max_tokens(rows, length, len(sp_ranks)),
                         min(length, MIN_TOKENS_PER_RANK * len(sp_ranks)))
    device = _device_of(model)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in prefix.batch.items()}
    labels = _label_tokens(inputs, prefix.tokens)
    _check_same_groups(_gather((rank, sp_ranks)))
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
        reference = _RecordingReference(dense_masked_attention(docs))
        reference_value, sketch_ref = _unsharded_pass(model, inputs, reference, sync, params, seed)
        rounded_value, sketch_rounded = None, (None, None)
        if dtype in (torch.bfloat16, torch.float16):
            rounded = dense_masked_attention(docs, operand_dtype=dtype)
            rounded_value, sketch_rounded = _unsharded_pass(model, inputs, rounded, sync, params, seed)
    calls = {name: [(c.local_length, c.group) for c in found] for name, found in watch.calls.items()}
    tolerance = rtol if rtol is not None else DEFAULT_RTOL.get(dtype, 1e-5)
    mine = _Findings(rank, sp_ranks, _group_name(group), loss_value, reference_value, sketch[0],
                     sketch_ref[0], sketch_ref[1], rounded_value, sketch_rounded[0], calls,
                     sharded or _fsdp1(model))
    report = _verdict(_gather(mine), prefix, tolerance, [_display(n) for n, _ in model.named_parameters()])
    report.update(dtype=str(dtype).replace("torch.", ""), gradient_sync=_sync_kind(model, sync, sharded),
                  documents=sum(len(row[row >= 0].unique()) for row in docs),
                  padding_tokens=int((docs < 0).sum()), windows=sorted(reference.windows),
                  window_exercised=any(prefix.length > w for w in reference.windows), labels=labels,
                  seconds=round(time.perf_counter() - start, 3))
    if report["failures"]:
        raise ParityError("lightseq_hf parity check failed: " + "; ".join(report["failures"]), report)
    return report


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
    if shifted is not None and bool((shifted != IGNORE_INDEX).any()):
        return "shift_labels"
    if shifted is None and labels is not None and bool((labels[..., 1:] != IGNORE_INDEX).any()):
        return "labels"
    ids = inputs.get("input_ids")
    if ids is None:
        raise ValueError(f"the parity check's prefix of {tokens} tokens has inputs_embeds and no supervised "
                         "label; pass labels that supervise its tokens, or raise max_tokens.")
    mask = inputs.get("attention_mask")
    inputs.pop("shift_labels", None)
    padded = mask is not None and mask.dim() == 2
    inputs["labels"] = ids.masked_fill(mask == 0, IGNORE_INDEX) if padded else ids
    given = "no labels were given" if labels is None and shifted is None else "no label in the prefix"
    return f"input_ids ({given})"


class _RecordingReference:
    """The reference attention, noting the sliding windows the layers asked for."""

    def __init__(self, attention: Callable) -> None:
        self.attention = attention
        self.windows: set[int] = set()

    def __call__(self, module, query, key, value, scaling=None, **kwargs):
        if kwargs.get("sliding_window") is not None:
            self.windows.add(int(kwargs["sliding_window"]))
        return self.attention(module, query, key, value, scaling, **kwargs)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report's numbers as flat ``parity_*`` entries (for logs, metrics.jsonl, summary.json)."""
    keys = ("passed", "tokens", "rows", "length", "sp_size", "loss_rel_err", "grad_rel_err",
            "worst_parameter", "sync_rel_diff", "rtol", "dtype", "gradient_sync", "documents",
            "padding_tokens", "labels", "loss_tolerance", "grad_tolerance", "rounding_noise", "grad_by_kind",
            "seconds")
    return {f"parity_{k}": report[k] for k in keys if k in report}


def _unsharded_pass(model, inputs, attention, sync, params, seed) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Forward and backward of ``model`` on whole rows with ``attention`` on this rank alone."""
    with unsharded(attention, _solo_group()):
        loss = model(**inputs).loss
        value, sketch, _ = _backward(model, loss, sync, params, seed)
    return value, sketch


def _backward(model, loss, sync, params, seed) -> tuple[float, tuple[torch.Tensor, torch.Tensor], bool]:
    """Backward, the loop's sync, the gradients' sketch; clears the gradients. (loss, sketch, sharded)."""
    if loss is None:
        raise ValueError("the model returned no loss for the parity check's batch; pass labels.")
    value = float(loss.detach().float())
    loss.backward()
    if sync is not None:
        sync(model)
    sketch = gradient_sketch(params, seed)
    sharded = any(is_sharded_gradient(p.grad) for p in params)
    for p in params:
        p.grad = None
    return value, sketch, sharded


def _verdict(findings: list[_Findings], prefix, rtol: float, names: list[str]) -> dict[str, Any]:
    """The report every rank computes from every rank's findings (so all agree)."""
    failures: list[str] = []
    worst = {"loss": 0.0, "loss_tolerance": rtol, "loss_noise": 0.0, "grad": 0.0, "excess": 0.0,
             "tolerance": rtol, "noise": 0.0, "sync": 0.0, "parameter": None}
    for members in sorted({f.group for f in findings}):
        mine = [f for f in findings if f.group == members]
        failures += _mechanism_failures(mine, prefix.length)
        failures += _gradient_failures(mine, names, rtol, worst)
        failures += _loss_failures(mine, rtol, worst)
    if worst["loss_tolerance"] < worst["loss"] < math.inf:
        failures.append(f"the loss differs from the unsharded run's by {worst['loss']:.2e} (relative; "
                        f"tolerance {_tolerance_text(rtol, worst['loss_noise'])})")
    if worst["excess"] > 1:
        failures.append(f"the gradient of {worst['parameter']} differs from the unsharded run's by "
                        f"{worst['grad']:.2e} (relative; tolerance {_tolerance_text(rtol, worst['noise'])}; "
                        "worst of all parameters)")
    sp_size = len(findings[0].group)
    return {
        "passed": not failures, "failures": failures, "rtol": rtol,
        "tokens": prefix.tokens, "rows": prefix.rows, "length": prefix.length,
        "full_rows": prefix.full_rows, "full_length": prefix.full_length,
        "sp_size": sp_size, "local_length": math.ceil(prefix.length / sp_size),
        "attention_layers": len(findings[0].calls),
        "loss": findings[0].loss, "loss_reference": findings[0].loss_reference,
        "loss_rel_err": worst["loss"], "loss_tolerance": worst["loss_tolerance"],
        "grad_rel_err": worst["grad"], "grad_tolerance": worst["tolerance"],
        "worst_parameter": worst["parameter"], "rounding_noise": {"loss": worst["loss_noise"],
                                                                "grad": worst["noise"]},
        "grad_by_kind": worst.get("kinds", {}),
        "sync_rel_diff": worst["sync"],
        "checked": ["loss", f"gradients of {len(names)} parameters ({SKETCH_DIM} random projections each)",
                    "attention ran distributed on each shard", "gradients equal across the group"],
    }


def _tolerance_text(rtol: float, noise: float) -> str:
    if not noise:
        return f"{rtol:.0e}"
    bound = max(rtol, NOISE_FACTOR * noise)
    return (f"{bound:.2e} = max(rtol {rtol:.0e}, {NOISE_FACTOR:g} x {noise:.2e}, the largest change one "
            "attention kernel's rounding makes)")


def _loss_failures(mine: list[_Findings], rtol: float, worst: dict) -> list[str]:
    """Compare one group's losses with the unsharded run's; updates ``worst``."""
    failures = []
    for f in mine:
        if not (math.isfinite(f.loss) and math.isfinite(f.loss_reference)):
            failures.append(f"rank {f.rank}: the loss is not finite ({f.loss} sharded, "
                            f"{f.loss_reference} unsharded); nothing can be compared")
            worst["loss"] = math.inf
            continue
        denominator = max(abs(f.loss_reference), 1e-30)
        error = abs(f.loss - f.loss_reference) / denominator
        noise = abs(f.loss_rounded - f.loss_reference) / denominator if f.loss_rounded is not None else 0.0
        noise = noise if math.isfinite(noise) else 0.0
        if error >= worst["loss"]:
            worst.update(loss=error, loss_noise=noise, loss_tolerance=max(rtol, NOISE_FACTOR * noise))
    return failures


def _gradient_failures(mine: list[_Findings], names: list[str], rtol: float, worst: dict) -> list[str]:
    """Compare one group's gradients with the unsharded run's (its mean, or each rank's FSDP shard) and
    between its ranks; updates ``worst``."""
    floor = GRADIENT_FLOOR * float(mine[0].norms_reference.max())
    if floor == 0:
        return ["no parameter received a gradient in the unsharded run (the check reads param.grad: "
                "DeepSpeed keeps gradients elsewhere)"]
    if mine[0].sharded_grads:
        pairs = [(f.sketch, f.sketch_reference, f.sketch_rounded, f.norms_reference.clamp(min=floor))
                 for f in mine]
    else:  # projections are linear: the group's mean projection is the projection of the mean gradient
        def mean(sketches):
            return None if sketches[0] is None else torch.stack(sketches).mean(0)
        pairs = [(mean([f.sketch for f in mine]), mean([f.sketch_reference for f in mine]),
                  mean([f.sketch_rounded for f in mine]), mine[0].norms_reference.clamp(min=floor))]
    for sketch, sketch_ref, sketch_rounded, scale in pairs:
        errors = ((sketch - sketch_ref).square().mean(-1).sqrt() / scale).nan_to_num(nan=math.inf)
        noise = torch.zeros_like(errors)
        if sketch_rounded is not None:
            changes = (sketch_rounded - sketch_ref).square().mean(-1).sqrt() / scale
            noise = _kind_noise(changes.nan_to_num(nan=0.0), names)
        tolerance = (NOISE_FACTOR * noise).clamp(min=rtol)
        excess = errors / tolerance
        _note_kinds(worst.setdefault("kinds", {}), names, errors, tolerance)
        if excess.numel() and float(excess.max()) >= worst["excess"]:
            i = int(excess.argmax())
            worst.update(excess=float(excess[i]), grad=float(errors[i]), tolerance=float(tolerance[i]),
                         noise=float(noise[i]), parameter=names[i])
    if mine[0].sharded_grads:
        return []
    scale = mine[0].norms_reference.clamp(min=floor)
    for f in mine[1:]:
        spread = ((f.sketch - mine[0].sketch).square().mean(-1).sqrt() / scale).nan_to_num(nan=math.inf)
        if spread.numel() and float(spread.max()) > worst["sync"]:
            worst["sync"] = float(spread.max())
            if worst["sync"] > rtol:
                return [_unsynced_message(mine[0].group, f.rank, names[int(spread.argmax())], worst["sync"])]
    return []


def parameter_kind(name: str) -> str:
    """A parameter's name with its layer numbers starred: the layers' copies of one weight are one kind."""
    return re.sub(r"\.\d+(?=\.)", ".*", name)


def _kind_noise(changes: torch.Tensor, names: list[str]) -> torch.Tensor:
    """Each parameter's yardstick: the largest rounding change among the parameters of its kind (one
    layer's change is a single sample; its kind's largest is a stable bound)."""
    kinds = [parameter_kind(n) for n in names]
    largest: dict[str, float] = {}
    for kind, change in zip(kinds, changes.tolist()):
        largest[kind] = max(largest.get(kind, 0.0), change)
    return torch.tensor([largest[k] for k in kinds], dtype=changes.dtype)


def _note_kinds(kinds: dict, names: list[str], errors: torch.Tensor, tolerance: torch.Tensor) -> None:
    """Keep, per parameter kind, the worst error and its tolerance (the report's ``grad_by_kind``)."""
    for name, error, bound in zip(names, errors.tolist(), tolerance.tolist()):
        kind = parameter_kind(name)
        if error >= kinds.get(kind, {"error": -1.0})["error"]:
            kinds[kind] = {"error": float(f"{error:.3g}"), "tolerance": float(f"{bound:.3g}")}


def _mechanism_failures(members: list[_Findings], length: int) -> list[str]:
    """Every attention layer ran the distributed attention once, over the group, on the shard's length."""
    failures = []
    local = math.ceil(length / len(members[0].group))
    for f in members:
        if not f.calls:
            failures.append(f"rank {f.rank}: the model has no attention module (class name ending in "
                            "'Attention') to check")
        counts = {name: len(calls) for name, calls in f.calls.items()}
        missing = [name for name, n in counts.items() if n == 0]
        if missing:
            off = "sequence parallelism is off" if len(missing) == len(counts) else "attention ran unsharded"
            failures.append(
                f"rank {f.rank}: {off}: {len(missing)} of {len(counts)} attention layers ({missing[0]}"
                f"{', ...' if len(missing) > 1 else ''}) did not run the distributed attention (a call with "
                "use_cache=True or past_key_values runs unsharded; another library may have replaced the "
                "attention forward; call lightseq_hf.patch_llama(model) last)")
        for name, calls in f.calls.items():
            wrong = [(n, g) for n, g in calls if n != local or g != f.group_name]
            if len(calls) > 1 or wrong:
                n, g = (wrong or calls)[0]
                failures.append(
                    f"rank {f.rank}: {name} ran the distributed attention {len(calls)} time(s), on {n} "
                    f"tokens over group {g!r}; expected once, on {local} tokens (the shard of {length}) over "
                    f"this rank's sequence-parallel group {f.group_name!r} of ranks {list(f.group)}")
                break
    return failures


def _unsynced_message(members: tuple[int, ...], rank: int, name: str, diff: float) -> str:
    return (f"the gradients the optimizer would see differ between ranks {members[0]} and {rank} of the "
            f"sequence-parallel group (worst: {name}, relative difference {diff:.2e}): nothing averages them "
            "after backward. Wrap the model in DDP or FSDP (accelerate's prepare does), or call "
            "lightseq_hf.sync_gradients(model) after loss.backward() (and pass "
            "sync=lightseq_hf.sync_gradients to check_parity)")


def _check_same_groups(ranks_and_groups: list[tuple[int, tuple[int, ...]]]) -> None:
    """Every member of a rank's sequence-parallel group must use the same group (else the forward hangs)."""
    group_of = dict(ranks_and_groups)
    for rank, members in ranks_and_groups:
        for other in members:
            if group_of.get(other) != members:
                alone = min((r for r in (rank, other) if len(group_of[r]) == 1), default=None)
                what = (f"ranks {rank} and {other} disagree on their sequence-parallel group" if alone is None
                        else f"rank {alone} would run its attention unsharded (a group of one)")
                raise ParityError(
                    f"lightseq_hf parity check failed: {what}: rank {rank} uses ranks {list(members)}, rank "
                    f"{other} uses {list(group_of[other])}. Patch every rank the same way "
                    "(lightseq_hf.parallel.init_sequence_parallel(sp_size) on every rank, or the same "
                    "sp_group everywhere).", {"passed": False})


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


_solo: dict[str, Any] = {}


def _solo_group():
    """A process group of this rank alone (created once, by this rank only); None without distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = dist.group.WORLD.group_name
    if key not in _solo:
        _solo[key] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _solo[key]


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
