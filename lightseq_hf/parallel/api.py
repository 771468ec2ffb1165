"""The public entry point: :func:`dist_flash_attn`."""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib

import torch
import torch.distributed as dist

from .._values import check_group, is_positive_int
from ..kernels import KernelRequest, backend_names, check_qkv, select_backend
from ..kernels.base import check_softcap
from .groups import check_launched
from .ops import dist_attn_fwd, group_handle, group_rank_and_size
from .schedule import SCHEDULES
from .segments import Segments, as_segments
from .sequence_mask import SequenceMask

__all__ = ["dist_flash_attn"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


@dataclasses.dataclass(frozen=True)
class _CallSignature:
    """What every rank of a group must pass alike to one distributed attention call, encoded as integers
    so that one all-gather compares them."""

    batch: int
    seq: int
    heads: int
    dim: int
    kv_seq: int
    kv_heads: int
    value_dim: int
    dtype: int
    causal: int
    scale_bits: int
    schedule: int
    backend: int
    chosen: int
    grad_q: int
    grad_k: int
    grad_v: int
    mask_digest: int

    #: the argument a user changes to mend each field, in the order the message names them
    _ARGUMENTS = {"batch": "shapes", "seq": "shapes", "heads": "shapes", "dim": "shapes", "kv_seq": "shapes",
                  "kv_heads": "shapes", "value_dim": "shapes", "dtype": "dtypes", "causal": "causal flags",
                  "scale_bits": "softmax scales", "schedule": "schedules", "backend": "backends",
                  "chosen": "backends", "grad_q": "requires_grad", "grad_k": "requires_grad",
                  "grad_v": "requires_grad", "mask_digest": "segments, windows or softcaps"}

    @classmethod
    def of_call(cls, q, k, v, causal, scale, schedule, backend, chosen, mask_digest) -> _CallSignature:
        grads = [int(t is not None and t.requires_grad and torch.is_grad_enabled()) for t in (q, k, v)]
        bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0] if scale is not None else 0
        return cls(*q.shape, k.shape[1], k.shape[2], v.shape[3] if v is not None else q.shape[3],
                   _DTYPE_CODES.get(q.dtype, 9), int(causal), bits, SCHEDULES.index(schedule),
                   _name_code(backend), _name_code(chosen or backend), *grads, mask_digest)

    def encode(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, encoded: torch.Tensor) -> _CallSignature:
        return cls(*encoded.tolist())

    def differ(self, other: _CallSignature) -> set[str]:
        """The arguments (as the message names them) in which ``other`` differs from this call."""
        return {self._ARGUMENTS[f.name] for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}

    def describe(self, names: dict[int, str]) -> str:
        scale = struct.unpack("<d", struct.pack("<q", self.scale_bits))[0]
        need = "".join(n for n, g in zip("qkv", (self.grad_q, self.grad_k, self.grad_v)) if g) or "none"
        return (f"q (batch {self.batch}, seq {self.seq}, heads {self.heads}, dim {self.dim}), "
                f"kv seq {self.kv_seq}, kv heads {self.kv_heads}, value dim {self.value_dim}, "
                f"dtype code {self.dtype}, causal {bool(self.causal)}, scale {scale:.6g}, "
                f"schedule {SCHEDULES[self.schedule]}, backend {names.get(self.backend, '?')} "
                f"(chose {names.get(self.chosen, '?')}), grads {need}, "
                f"segments/window/softcap digest {self.mask_digest}")


def _check_same_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    group: dist.ProcessGroup | None,
    *,
    v: torch.Tensor | None = None,
    scale: float | None = None,
    schedule: str = "balanced",
    backend: str = "auto",
    mask_digest: int = 0,
    chosen: str = "",
) -> None:
    """All-gather each rank's call (:class:`_CallSignature`) and raise the same ValueError on every rank if
    they differ.

    Runs before any point-to-point transfer, so a mismatch fails fast instead of hanging (or, for
    the scale, silently mixing two attentions).
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = _CallSignature.of_call(q, k, v, causal, scale, schedule, backend, chosen, mask_digest)
    encoded = mine.encode(device)
    gathered = [torch.empty_like(encoded) for _ in range(world)]
    dist.all_gather(gathered, encoded, group=group)
    calls = [_CallSignature.decode(t) for t in gathered]
    if all(call == mine for call in calls):
        return
    names = {_name_code(n): n for n in (*backend_names(), chosen, backend)}
    found = set().union(*(mine.differ(call) for call in calls))
    differ = [name for name in dict.fromkeys(_CallSignature._ARGUMENTS.values()) if name in found]
    described = "; ".join(f"rank {r}: {call.describe(names)}" for r, call in enumerate(calls))
    same_masks = " Pass every rank the same segments (of the full rows), window and softcap."
    hint = (" Every rank must hold an equal-length shard: pad the sequence to a multiple of the group size "
            "(lightseq_hf.pad_to_multiple) before sharding." if "shapes" in differ else
            same_masks if "segments, windows or softcaps" in differ else
            " Every rank of the group must call dist_flash_attn with the same arguments, and the same q/k/v "
            "must require gradients on every rank (backward is collective).")
    raise ValueError(
        f"ranks of the sequence-parallel group passed different {', '.join(differ)} ({described}).{hint}"
    )


def _name_code(name: str) -> int:
    """A stable number for a backend name (the fingerprint is an int64 tensor)."""
    return zlib.crc32(name.encode())


def _check_arguments(q, k, v, causal, softmax_scale, group, schedule, backend, segments, cu_seqlens, window,
                     softcap) -> None:
    check_group(group, default="the world")
    if group is None:
        check_launched("lightseq_hf.dist_flash_attn")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    if backend not in backend_names():
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(backend_names())}.")
    check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False; got {causal!r} ({type(causal).__name__}).")
    if softmax_scale is not None:
        try:
            finite = math.isfinite(softmax_scale)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"softmax_scale must be a number (or None); got {softmax_scale!r}.") from None
        if not finite:
            raise ValueError(f"softmax_scale must be a finite number; got {softmax_scale}.")
    if q.shape[1] != k.shape[1]:
        if q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0:  # q/k differ in heads, not tokens
            raise ValueError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} agree on dim 2 and differ on dim 1 by a whole "
                f"factor: that is Transformers' (batch, heads, seq, head_dim) layout with {q.shape[1]} query "
                f"and {k.shape[1]} key/value heads. dist_flash_attn takes (batch, seq, heads, head_dim): "
                "pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (and transpose the output "
                "back).")
        raise ValueError(
            f"q has {q.shape[1]} local tokens but k/v have {k.shape[1]}; dist_flash_attn shards "
            "one sequence, so q, k and v shards must have the same length."
        )
    if segments is not None and cu_seqlens is not None:
        raise ValueError("pass segments or cu_seqlens, not both.")
    if window is not None and not is_positive_int(window):
        raise ValueError(f"window must be a positive int (or None); got {window!r}.")
    check_softcap(softcap)


def _segments_of(segments, cu_seqlens, window, batch: int, length: int, world: int, local: int,
                 heads: int = 0):
    """The segments of the full rows (None: plain rows without a window)."""
    seg = as_segments(segments if segments is not None else cu_seqlens, batch, length)
    if seg is not None and (seg.batch, seg.length) != (batch, length):
        transposed = seg.length == heads * world and seg.batch == batch
        raise ValueError(
            f"segments describe {seg.batch} rows of {seg.length} tokens, but the full inputs are {batch} "
            f"rows of {length} tokens ({local} per rank x {world} ranks); " + (
                "q looks like Transformers' (batch, heads, seq, head_dim) layout: dist_flash_attn takes "
                "(batch, seq, heads, head_dim), pass q.transpose(1, 2) (and k, v alike)." if transposed else
                "build them for the full, padded rows (Segments.padded extends them with padding).")
        )
    if window is not None and seg is None:
        seg = Segments.full(batch, length)
    if seg is not None and seg.is_full() and window is None:
        seg = None  # plain rows: the whole-block schedule
    return seg


def _check_not_a_shards_cu_seqlens(cu_seqlens, seg: Segments | None, world: int, local: int) -> None:
    """Refuse ``cu_seqlens`` that end exactly where one rank's shard of the rows ends.

    Those are almost always the cumulative lengths of this rank's shard, passed where the full rows' are
    expected: read as full rows, every later token would be padding (output 0 on the other ranks).
    ``segments`` states the full row length, so a caller who means that padding passes them instead.
    """
    if cu_seqlens is None or seg is None or world == 1:
        return
    ends = [r * seg.length + row[-1][1] for r, row in enumerate(seg.docs) if row]
    if ends and max(ends) == seg.batch * local:
        raise ValueError(
            f"cu_seqlens ends at {seg.batch * local}, the size of one rank's shard ({seg.batch} x {local} "
            f"tokens), but it must describe the full rows ({seg.batch} x {seg.length} tokens over {world} "
            "ranks), the same on every rank; read as full rows, everything after it would be padding. Pass "
            "the full rows' cumulative lengths, or, if the rest really is padding, pass "
            "segments=Segments.from_cu_seqlens(cu_seqlens, batch, full_length) instead."
        )


def dist_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    schedule: str = "balanced",
    backend: str = "auto",
    return_lse: bool = False,
    check_shapes: bool = True,
    segments: Segments | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded contiguously across ``group``.

    ``q`` is this rank's shard ``(batch, local_seq, heads, head_dim)`` (chunk ``rank`` of ``group`` in rank
    order; default group: the world; not Transformers' ``(batch, heads, seq, head_dim)``, which is refused
    where the shapes show it and, with as many key/value heads as query heads and no segments, cannot be
    told apart: transpose such tensors first), ``k`` is ``(batch, local_seq, kv_heads, head_dim)`` and ``v``
    ``(batch, local_seq, kv_heads, value_dim)`` (``value_dim`` other than ``head_dim``: the reference
    backend). Returns this rank's output shard ``(batch, local_seq, heads, value_dim)`` in ``q.dtype`` and,
    with ``return_lse``, its log-sum-exp ``(batch, heads, local_seq)`` (float32). Without an initialized
    process group, or with a group of one, it is plain attention on the local tensors (under a launcher that
    started several processes, ``WORLD_SIZE > 1``, a missing process group is refused instead). Gradients
    flow to q, k and v (and through the lse). ``schedule`` is ``"balanced"`` (default), ``"pipelined"``
    (balanced, its last step in two halves: returned results overlap compute), ``"paper"`` or ``"ring"``;
    ``backend`` is ``"auto"`` (the measured-fastest backend that takes the call, see
    ``kernels.autoselect``), ``"reference"``, ``"triton"``, ``"sdpa"``, ``"flash_varlen"`` or ``"cudnn_fe"``
    (packed documents through cuDNN's variable-length op, from the optional nvidia-cudnn-frontend); a backend
    that cannot take the call is refused, naming what it lacks. ``check_shapes=False`` skips the
    all-gather that checks every rank's call agrees (shapes, dtype, causal, scale, schedule, backend,
    masks, which inputs need gradients), for callers that guarantee it, such as the model patch.

    Packed documents and padding: ``segments`` (a :class:`~lightseq_hf.parallel.segments.Segments`
    of the *full* rows, the same on every rank) or ``cu_seqlens`` (cumulative document lengths over
    the flattened full ``batch * seq`` tokens, flash-attn style; tokens after the last are padding;
    refused when they end exactly at one shard's size, the sign of a shard's own lengths).
    Attention never crosses a document; padding tokens attend nothing and are attended by nothing
    (output 0, lse -inf, gradients 0), and a NaN in one document or padding token stays there. ``window``:
    sliding-window attention, key ``j`` visible from query ``i`` only when ``i - window < j`` (and,
    non-causal, ``j < i + window``). Blocks with no visible pair are neither computed nor sent, and the
    schedule balances visible pairs (it replaces ``schedule``, which applies to plain rows). ``softcap``:
    logit soft-capping, scores ``softcap * tanh(score / softcap)`` after the softmax scale (Gemma 2).
    """
    _check_arguments(q, k, v, causal, softmax_scale, group, schedule, backend, segments, cu_seqlens,
                     window, softcap)
    _, world = group_rank_and_size(group)
    seg = _segments_of(segments, cu_seqlens, window, q.shape[0], q.shape[1] * world, world, q.shape[1],
                       q.shape[2])
    mask = SequenceMask(causal, seg, window, softcap)
    lse_grad = return_lse and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    request = KernelRequest(q.device, q.dtype, q.shape[-1], v.shape[-1], mask.kind, softcap is not None,
                            lse_grad)
    chosen = select_backend(backend, request)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if check_shapes:
        _check_same_shapes(q, k, causal, group, v=v, scale=scale, schedule=schedule, backend=backend,
                          mask_digest=mask.digest(), chosen=chosen)
    _check_not_a_shards_cu_seqlens(cu_seqlens, seg, world, q.shape[1])  # after the check: every rank agrees
    out, lse = dist_attn_fwd(q, k, v, float(scale), group_handle(group), schedule, chosen, *mask.op_args())
    return (out, lse) if return_lse else out
