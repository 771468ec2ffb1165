"""The parity check's verdict: every rank's findings compared, the same report on every rank.

The loss of each rank is compared with its unsharded run's. The gradients the optimizer would see (after
DDP, FSDP or the loop's ``sync``) are compared through their random projections with the MEAN over all
ranks of the unsharded runs' gradients (what DDP's average gives; each rank's own shard under FSDP), so a
sync that sums instead of averaging is a difference; and they must be equal on the ranks of a group.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from .gradients import SKETCH_DIM

__all__ = ["Findings", "passed_line", "summary", "verdict"]

#: checks also run the unsharded model with its attention at a higher precision (bfloat16 and float16 in
#: float32, float32 in float64; :data:`~.parity._PRECISE`). The relative change that rounding makes to the
#: loss, and the largest it makes to a parameter kind's gradients (every layer's copy of a weight), is the
#: yardstick, and the tolerance is ``max(rtol, _NOISE_FACTOR x yardstick)``: deep random-weight models
#: amplify every rounding in the key projections' gradients, and the sharded path rounds more than one
#: kernel (partial outputs merged across ranks) and runs nondeterministic backward kernels. Llama-2-7B
#: shape, FSDP2 bf16 on 2 x H100, 436-873 tokens (2026-11-25): the worst gradient errors 0.068-0.171 were
#: all in key projections, whose largest rounding change measured 0.021-0.112. The yardstick sees the
#: attention's rounding only; a model that amplifies its other roundings more gains on it: a tiny random
#: Gemma 4 (attention unscaled after its query/key norms, float32, 2 gloo processes, torch 2.13 CPU,
#: transformers 5.24, 2026-11-28) measured 9.4x in its embedding's gradient and 8.5x in a query norm's.
_NOISE_FACTOR = 10.0
#: a parameter's gradient error is relative to its norm, or to this fraction of the largest one if larger
_GRADIENT_FLOOR = 1e-3
#: gradients that are all one multiple of the unsharded ones, this far from 1x, are reported as scaled
_SCALE_HINT = 0.25


@dataclass
class Findings:
    """What one rank measured; gathered on every rank."""

    rank: int
    group: tuple[int, ...]
    group_name: str
    loss: float
    loss_reference: float
    sketch: torch.Tensor  # (parameters, SKETCH_DIM) projections of the gradients, sequence-parallel run
    sketch_reference: torch.Tensor  # the same, unsharded run (no sync: the model alone on this rank)
    norms_reference: torch.Tensor  # (parameters,) gradient norms, unsharded run
    loss_precise: float | None  # the unsharded run with its attention at a higher precision (or None)
    sketch_precise: torch.Tensor | None  # its gradients' projections
    calls: dict[str, list[tuple[int, str]]]  # attention module -> (local length, group name) per call
    interface_calls: dict[str, int]  # attention module -> calls of the registered attention function
    sharded_grads: bool  # FSDP: each rank holds a shard of the averaged gradients


def verdict(findings: list[Findings], prefix, rtol: float, names: list[str],
            attention: str) -> dict[str, Any]:
    """The report every rank computes from every rank's findings (so all agree)."""
    failures: list[str] = []
    worst = {"loss": 0.0, "loss_tolerance": rtol, "loss_noise": 0.0, "grad": 0.0, "excess": 0.0,
             "tolerance": rtol, "noise": 0.0, "sync": 0.0, "parameter": None, "layers": set(), "scale": 1.0}
    for members in sorted({f.group for f in findings}):
        mine = [f for f in findings if f.group == members]
        not_finite = _loss_failures(mine, rtol, worst)  # then the gradients compare with nothing either
        failures += _mechanism_failures(mine, prefix.length) + not_finite
        failures += [] if not_finite else _unsynced_failures(mine, names, rtol, worst)
    if not failures:
        failures += _gradient_failures(findings, names, rtol, worst)
    reference = f"the unpatched model's (attention {attention!r})"
    if worst["loss_tolerance"] < worst["loss"] < math.inf:
        failures.append(f"the loss differs from {reference} by {worst['loss']:.2e} (relative; tolerance "
                        f"{_tolerance_text(rtol, worst['loss_noise'])})")
    if worst["excess"] > 1:
        failures.append(_gradient_message(worst, reference, rtol))
    sp_size = len(findings[0].group)
    return {
        "passed": not failures, "failures": failures, "rtol": rtol, "reference_attention": attention,
        "tokens": prefix.tokens, "rows": prefix.rows, "length": prefix.length,
        "full_rows": prefix.full_rows, "full_length": prefix.full_length,
        "sp_size": sp_size, "local_length": math.ceil(prefix.length / sp_size),
        "attention_layers": len(findings[0].calls),
        "loss": findings[0].loss, "loss_reference": findings[0].loss_reference,
        "loss_rel_err": worst["loss"], "loss_tolerance": worst["loss_tolerance"],
        "grad_rel_err": worst["grad"], "grad_tolerance": worst["tolerance"],
        "worst_parameter": worst["parameter"], "rounding_noise": {"loss": worst["loss_noise"],
                                                                "grad": worst["noise"]},
        "grad_by_kind": worst.get("kinds", {}), "grad_scale": worst["scale"],
        "sync_rel_diff": worst["sync"],
        "checked": ["loss", f"gradients of {len(names)} parameters ({SKETCH_DIM} random projections each) "
                    "against the mean of the unsharded runs'", "attention ran distributed on each shard",
                    "gradients equal across the group"],
    }


def _gradient_message(worst: dict, reference: str, rtol: float) -> str:
    name = worst["parameter"]
    layer = _layer_of(name)
    text = (f"the gradient of {name}{'' if layer is None else f' (layer {layer})'} differs from {reference} "
            f"by {worst['grad']:.2e} (relative; tolerance {_tolerance_text(rtol, worst['noise'])}; worst of "
            "all parameters")
    if worst["layers"]:
        text += "; layers over tolerance: " + ", ".join(str(n) for n in sorted(worst["layers"]))
    text += ")"
    if worst.get("scaled") and abs(worst["scale"] - 1) > _SCALE_HINT:
        text += (f"; the gradients are {worst['scale']:.2f}x the unsharded ones: does the gradient sync sum "
                 "where it should average?")
    return text


def _layer_of(name: str) -> int | None:
    """The layer number in a parameter's name (``model.layers.3.mlp...`` -> 3), if any."""
    found = re.search(r"\.(\d+)\.", name)
    return None if found is None else int(found.group(1))


def _tolerance_text(rtol: float, noise: float) -> str:
    if not noise:
        return f"{rtol:.0e}"
    bound = max(rtol, _NOISE_FACTOR * noise)
    return (f"{bound:.2e} = max(rtol {rtol:.0e}, {_NOISE_FACTOR:g} x {noise:.2e}, the largest change one "
            "attention kernel's rounding makes)")


def _loss_failures(mine: list[Findings], rtol: float, worst: dict) -> list[str]:
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
        noise = abs(f.loss_precise - f.loss_reference) / denominator if f.loss_precise is not None else 0.0
        noise = noise if math.isfinite(noise) else 0.0
        if error >= worst["loss"]:
            worst.update(loss=error, loss_noise=noise, loss_tolerance=max(rtol, _NOISE_FACTOR * noise))
    return failures


def _mean(sketches: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if sketches[0] is None else torch.stack(sketches).mean(0)


def _gradient_failures(findings: list[Findings], names: list[str], rtol: float, worst: dict) -> list[str]:
    """Compare each rank's gradients with the mean over all ranks of the unsharded runs' (each rank's own
    under FSDP, whose shards its backward averaged); updates ``worst``."""
    norms = torch.stack([f.norms_reference for f in findings]).mean(0)
    floor = _GRADIENT_FLOOR * float(norms.max())
    if floor == 0:
        return ["no parameter received a gradient in the unsharded run (the check reads param.grad: "
                "DeepSpeed keeps gradients elsewhere)"]
    scale = norms.clamp(min=floor)
    if findings[0].sharded_grads:
        pairs = [(f.sketch, f.sketch_reference, f.sketch_precise, f.norms_reference.clamp(min=floor))
                 for f in findings]
    else:  # projections are linear: the mean projection is the projection of the mean gradient
        expected = _mean([f.sketch_reference for f in findings])
        precise = _mean([f.sketch_precise for f in findings])
        pairs = [(f.sketch, expected, precise, scale) for f in findings]
        worst["scale"], worst["scaled"] = _common_factor(torch.stack([f.sketch for f in findings]).mean(0),
                                                         expected)
    for sketch, sketch_ref, sketch_precise, bound_scale in pairs:
        errors = ((sketch - sketch_ref).square().mean(-1).sqrt() / bound_scale).nan_to_num(nan=math.inf)
        noise = torch.zeros_like(errors)
        if sketch_precise is not None:
            changes = (sketch_precise - sketch_ref).square().mean(-1).sqrt() / bound_scale
            noise = _kind_noise(changes.nan_to_num(nan=0.0), names)
        tolerance = (_NOISE_FACTOR * noise).clamp(min=rtol)
        excess = errors / tolerance
        _note_kinds(worst.setdefault("kinds", {}), names, errors, tolerance)
        worst["layers"] |= {_layer_of(n) for n, e in zip(names, excess.tolist()) if e > 1} - {None}
        if excess.numel() and float(excess.max()) >= worst["excess"]:
            i = int(excess.argmax())
            worst.update(excess=float(excess[i]), grad=float(errors[i]), tolerance=float(tolerance[i]),
                         noise=float(noise[i]), parameter=names[i])
    return []


def _common_factor(sketch: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    """The factor ``s`` that best maps the expected gradients' projections onto the measured ones, and
    whether the measured ones are that multiple of the expected (within 10%)."""
    factor = float((sketch * expected).sum() / (expected * expected).sum().clamp(min=1e-300))
    residual = float((sketch - factor * expected).norm() / (factor * expected).norm().clamp(min=1e-300))
    return factor, residual < 0.1


def _unsynced_failures(mine: list[Findings], names: list[str], rtol: float, worst: dict) -> list[str]:
    """The gradients the optimizer would see must be equal on every rank of a group (not under FSDP, whose
    ranks hold different shards); updates ``worst``."""
    if mine[0].sharded_grads:
        return []
    floor = _GRADIENT_FLOOR * float(mine[0].norms_reference.max())
    scale = mine[0].norms_reference.clamp(min=floor if floor > 0 else 1.0)
    for f in mine[1:]:
        spread = ((f.sketch - mine[0].sketch).square().mean(-1).sqrt() / scale).nan_to_num(nan=math.inf)
        if spread.numel() and float(spread.max()) > worst["sync"]:
            worst["sync"] = float(spread.max())
            if worst["sync"] > rtol:
                return [_unsynced_message(mine[0].group, f.rank, names[int(spread.argmax())], worst["sync"])]
    return []


def _parameter_kind(name: str) -> str:
    """A parameter's name with its layer numbers starred: the layers' copies of one weight are one kind."""
    return re.sub(r"\.\d+(?=\.)", ".*", name)


def _kind_noise(changes: torch.Tensor, names: list[str]) -> torch.Tensor:
    """Each parameter's yardstick: the largest rounding change among the parameters of its kind (one
    layer's change is a single sample; its kind's largest is a stable bound)."""
    kinds = [_parameter_kind(n) for n in names]
    largest: dict[str, float] = {}
    for kind, change in zip(kinds, changes.tolist()):
        largest[kind] = max(largest.get(kind, 0.0), change)
    return torch.tensor([largest[k] for k in kinds], dtype=changes.dtype)


def _note_kinds(kinds: dict, names: list[str], errors: torch.Tensor, tolerance: torch.Tensor) -> None:
    """Keep, per parameter kind, the worst error and its tolerance (the report's ``grad_by_kind``)."""
    for name, error, bound in zip(names, errors.tolist(), tolerance.tolist()):
        kind = _parameter_kind(name)
        if error >= kinds.get(kind, {"error": -1.0})["error"]:
            kinds[kind] = {"error": float(f"{error:.3g}"), "tolerance": float(f"{bound:.3g}")}


def _mechanism_failures(members: list[Findings], length: int) -> list[str]:
    """Every call an attention module made of the registered attention function ran the distributed
    attention once, over the group, on the shard's length."""
    failures = []
    local = math.ceil(length / len(members[0].group))
    for f in members:
        if not f.calls:
            failures.append(f"rank {f.rank}: the model has no attention module (class name ending in "
                            "'Attention') to check")
        missing = [name for name, calls in f.calls.items() if not calls]
        if missing:
            off = "sequence parallelism is off" if len(missing) == len(f.calls) else "attention ran unsharded"
            failures.append(
                f"rank {f.rank}: {off}: {len(missing)} of {len(f.calls)} attention layers ({missing[0]}"
                f"{', ...' if len(missing) > 1 else ''}) did not run the distributed attention (a call with "
                "use_cache=True or past_key_values runs unsharded; another library may have replaced the "
                "attention forward; call lightseq_hf.patch_llama(model) last)")
        for name, calls in f.calls.items():
            expected = max(f.interface_calls.get(name, 1), 1)
            wrong = [(n, g) for n, g in calls if n != local or g != f.group_name]
            if calls and (len(calls) != expected or wrong):
                n, g = (wrong or calls)[0]
                failures.append(
                    f"rank {f.rank}: {name} ran the distributed attention {len(calls)} time(s), on {n} "
                    f"tokens over group {g!r}; expected {expected} (its attention calls), on {local} tokens "
                    f"(the shard of {length}) over this rank's sequence-parallel group {f.group_name!r} of "
                    f"ranks {list(f.group)}")
                break
    return failures


def _unsynced_message(members: tuple[int, ...], rank: int, name: str, diff: float) -> str:
    return (f"the gradients the optimizer would see differ between ranks {members[0]} and {rank} of the "
            f"sequence-parallel group (worst: {name}, relative difference {diff:.2e}): nothing averages them "
            "after backward. Wrap the model in DDP or FSDP (accelerate's prepare does), or call "
            "lightseq_hf.sync_gradients(model) after loss.backward() (and pass "
            "sync=lightseq_hf.sync_gradients to check_parity)")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report's numbers as flat ``parity_*`` entries (for logs, metrics.jsonl, summary.json)."""
    keys = ("passed", "compared", "note", "tokens", "rows", "length", "sp_size", "loss_rel_err",
            "grad_rel_err", "worst_parameter", "sync_rel_diff", "rtol", "dtype", "gradient_sync",
            "reference_attention", "documents", "padding_tokens", "labels", "loss_tolerance",
            "grad_tolerance", "rounding_noise", "grad_by_kind", "seconds")
    return {f"parity_{k}": report[k] for k in keys if k in report}


def passed_line(report: dict[str, Any]) -> str:
    """A passed check's report in one line: tokens, the relative errors and the tolerance."""
    return (f"lightseq_hf parity check passed on {report.get('tokens')} tokens (sequence-parallel size "
            f"{report.get('sp_size')}): loss rel err {report.get('loss_rel_err', 0):.1e}, gradients "
            f"{report.get('grad_rel_err', 0):.1e} (rtol {report.get('rtol')})")
