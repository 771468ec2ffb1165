"""The local attention kernel contract shared by every backend.

Layout: ``q`` is ``(batch, q_len, heads, head_dim)``; ``k`` is ``(batch, kv_len, kv_heads, head_dim)`` and
``v`` is ``(batch, kv_len, kv_heads, value_dim)`` with ``heads % kv_heads == 0`` (``value_dim`` equals
``head_dim`` unless the backend declares ``supports_value_head_dim``); query head ``h`` reads key/value
head ``h // (heads // kv_heads)`` (key/value heads are never replicated). ``lse`` is
``(batch, heads, q_len)``, float32 (float64 for float64 inputs), natural log.

The mask of one call is an :class:`AttentionMask`, which a kernel takes as ``mask=``. Direct calls may pass
its fields as keywords instead (``causal``, ``key_range``, ``doc_blocks``, ``window``, ``softcap``:
:data:`MASK_KEYWORDS`, the one list of them), turned into the :class:`AttentionMask` once at the call:

- ``causal``: bottom-right aligned (flash-attn's rule): query row ``i`` sees key ``j`` when
  ``j <= i + kv_len - q_len``. A row that sees no key has ``lse = -inf`` and an all-zero output.
- ``key_range=(lo, hi)``, int32 ``(batch, q_len)`` each: row ``i`` sees keys ``lo[i] <= j < hi[i]`` of
  this chunk (both non-decreasing along the row). Replaces ``causal`` (pass ``causal=False``).
- ``doc_blocks``: a :class:`DocBlocks`, independent blocks of gathered rows. Replaces ``causal``.
- ``window``: the sliding window that ``key_range`` already encodes (kernels read the ranges; the field
  names the mask kind so that a backend without ``supports_window`` is refused by name).
- ``softcap``: scores become ``softcap * tanh(score / softcap)`` (after the softmax scale).

Every backend declares what it takes in a :class:`Capabilities` record; :class:`KernelBase` refuses, naming
the backend, what the record does not declare.

forward(q, k, v, *, scale, mask, out=None, lse=None) -> (out, lse)
    Without ``out``/``lse``: returns ``out`` in ``q.dtype`` and ``lse`` in float32. With them (float32
    running output ``(batch, q_len, heads, value_dim)`` and running lse): merges this chunk's attention
    into them in place (the paper's Algorithm 3) and returns them. A running row with ``lse = -inf``
    holds nothing yet.

backward(dout, q, k, v, out, lse, *, scale, mask, delta=None, dq=None, dk=None, dv=None)
    ``out`` and ``lse`` are the *global* results of the query rows (over every key chunk), so gradients
    of all chunks add up to the full gradient. ``delta`` is ``rowsum(dout * out)`` as float32
    ``(batch, heads, q_len)``; computed from ``out`` when not given (``out`` may be ``None`` when
    ``delta`` is given, unless ``needs_out_in_backward``). When ``dq``/``dk``/``dv`` (float32) are given,
    the chunk's gradients are added into them in place; the others are returned in float32, or in the
    input dtype by backends that compute them in it (SDPA).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import ClassVar, Protocol

import torch

from .working_memory import BackwardMemory

__all__ = ["AttentionKernel", "AttentionMask", "Capabilities", "DocBlocks", "KernelBase", "KernelRequest",
           "KeyRange", "MASK_KEYWORDS", "MaskKind", "Rows", "check_key_range", "check_qkv", "check_softcap"]

KeyRange = tuple[torch.Tensor, torch.Tensor]
Rows = torch.Tensor | slice


class MaskKind(enum.Enum):
    """What a call's mask needs from a backend (the selection table's mask column)."""

    CAUSAL = "causal masks"
    FULL = "unmasked attention"
    DOCUMENTS = "packed documents and padding"
    WINDOW = "sliding windows"


@dataclass(frozen=True, eq=False)
class DocBlocks:
    """Independent attention blocks of one local call.

    ``q_lens[i]`` / ``k_lens[i]``: query and key rows of block ``i`` (each >= 1). ``q_rows`` / ``k_rows``:
    which rows of the flattened ``(batch * q_len)`` queries / ``(batch * kv_len)`` keys are fed, block after
    block (int64 index tensors on the device, or a ``slice`` when they are one contiguous run). ``cu_q`` /
    ``cu_k``: int32 cumulative lengths on the device. ``causal``: bottom-right causal mask inside every
    block (else each query row sees all keys of its block). Rows fed to no block see nothing.
    :func:`~lightseq_hf.kernels.varlen.rows.make_doc_blocks` builds one from host lists.
    """

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    q_rows: Rows
    k_rows: Rows
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    causal: bool

    @property
    def num_blocks(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def total_k(self) -> int:
        return sum(self.k_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_k(self) -> int:
        return max(self.k_lens, default=0)

    @cached_property
    def padded_lse_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, position in block) of every fed query row, int64 on the device."""
        lens = torch.tensor(self.q_lens, dtype=torch.int64)
        block = torch.repeat_interleave(torch.arange(self.num_blocks), lens)
        starts = torch.tensor([0, *self.q_lens], dtype=torch.int64).cumsum(0)[:-1]
        pos = torch.arange(self.total_q, dtype=torch.int64) - starts[block]
        return block.to(self.cu_q.device), pos.to(self.cu_q.device)


@dataclass(frozen=True, eq=False)
class AttentionMask:
    """Which keys each query row of one local call sees, and how its scores are shaped (see the module
    docstring). ``key_range`` and ``doc_blocks`` exclude each other and replace ``causal``."""

    causal: bool = False
    key_range: KeyRange | None = None
    doc_blocks: DocBlocks | None = None
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.key_range is not None and self.doc_blocks is not None:
            raise ValueError("pass key_range or doc_blocks, not both: each describes the whole mask.")
        if self.causal and (self.key_range is not None or self.doc_blocks is not None):
            what = "key_range" if self.key_range is not None else "doc_blocks"
            raise ValueError(f"{what} replaces the causal rule; pass causal=False together with {what}.")
        if self.window is not None and self.key_range is None:
            raise ValueError("a window travels inside key_range (the ranges encode it); pass both.")
        check_softcap(self.softcap)

    @property
    def kind(self) -> MaskKind:
        if self.window is not None:
            return MaskKind.WINDOW
        if self.key_range is not None or self.doc_blocks is not None:
            return MaskKind.DOCUMENTS
        return MaskKind.CAUSAL if self.causal else MaskKind.FULL

    def keywords(self) -> dict:
        """The fields as kernel keywords."""
        return {name: getattr(self, name) for name in MASK_KEYWORDS}


#: The mask keywords every kernel's forward and backward take (the fields of :class:`AttentionMask`).
MASK_KEYWORDS: tuple[str, ...] = tuple(f.name for f in fields(AttentionMask))


def check_softcap(softcap: float | None) -> None:
    """Raise ValueError unless ``softcap`` is None or a positive finite number."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a positive finite number (or None); got {softcap!r}.")


@dataclass(frozen=True)
class KernelRequest:
    """What one attention call needs from a backend, known before any mask tensor is built (``dtype`` and
    the head dims None: not checked)."""

    device: torch.device
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None
    mask: MaskKind = MaskKind.CAUSAL
    softcap: bool = False
    lse_grad: bool = False  # a gradient will flow through the returned lse (attention sinks, custom merges)


@dataclass(frozen=True)
class Capabilities:
    """What a backend takes. Selection (``autoselect``) and the refusals read only this record.

    ``devices``: device types its kernels run on (None: any). ``dtypes``: input dtypes. Head dims: exactly
    ``head_dims`` when given, else any multiple of ``head_dim_multiple`` up to ``max_head_dim`` (None: no
    bound). ``supports_key_range`` / ``supports_doc_blocks``: the mask representations it takes (packed
    documents need one of them); ``supports_window``: sliding windows (through ``key_range``).
    ``supports_softcap``: logit soft-capping. ``supports_value_head_dim``: ``v`` may have another head
    dim than ``q``/``k``. ``merges_in_kernel``: accumulate mode updates the running (out, lse) inside the
    kernel (no separate merge pass). ``needs_out_in_backward``: backward takes the output rows, not
    ``delta``, so no gradient flows through the returned lse. ``backward_memory``: what its backward
    allocates (:mod:`.working_memory`; the memory planner reads it and refuses a backend without it).
    """

    devices: frozenset[str] | None
    dtypes: frozenset[torch.dtype]
    head_dims: tuple[int, ...] | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    supports_key_range: bool = False
    supports_doc_blocks: bool = False
    supports_window: bool = False
    supports_softcap: bool = False
    supports_value_head_dim: bool = False
    merges_in_kernel: bool = False
    needs_out_in_backward: bool = False
    backward_memory: BackwardMemory | None = field(default=None, compare=False)
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.supports_window and not self.supports_key_range:
            raise ValueError("supports_window needs supports_key_range: windows travel as key ranges.")

    def takes_head_dim(self, d: int) -> bool:
        if self.head_dims is not None:
            return d in self.head_dims
        return d % self.head_dim_multiple == 0 and (self.max_head_dim is None or d <= self.max_head_dim)

    def takes_mask(self, kind: MaskKind) -> bool:
        if kind is MaskKind.DOCUMENTS:
            return self.supports_key_range or self.supports_doc_blocks
        if kind is MaskKind.WINDOW:
            return self.supports_window
        return True

    def head_dim_text(self) -> str:
        if self.head_dims is not None:
            return ", ".join(map(str, self.head_dims))
        bound = f" up to {self.max_head_dim}" if self.max_head_dim is not None else ""
        if self.head_dim_multiple > 1:
            return f"multiples of {self.head_dim_multiple}{bound}"
        return f"any{bound}"

    def refusal(self, request: KernelRequest) -> str | None:
        """Why this backend cannot serve ``request`` (a phrase completing "it ..."), or None."""
        if self.devices is not None and request.device.type not in self.devices:
            where = " or ".join("a CUDA GPU" if d == "cuda" else f"{d} tensors" for d in sorted(self.devices))
            return f"needs {where}; tensors are on {request.device}"
        if request.dtype is not None and request.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"takes {names}, not {str(request.dtype).removeprefix('torch.')}"
        if request.head_dim is not None and not self.takes_head_dim(request.head_dim):
            return f"takes head dims {self.head_dim_text()}; got {request.head_dim}"
        if (request.value_head_dim not in (None, request.head_dim)
                and not self.supports_value_head_dim):
            return (f"needs equal query/key and value head dims; got {request.head_dim} and "
                    f"{request.value_head_dim}")
        if not self.takes_mask(request.mask):
            return f"does not take {request.mask.value}"
        if request.softcap and not self.supports_softcap:
            return "does not take logit soft-capping (softcap)"
        if request.lse_grad and self.needs_out_in_backward:
            return "cannot back-propagate through the returned lse (its backward takes the output rows)"
        return None


class AttentionKernel(Protocol):
    """A local (single-device) attention backend (:class:`KernelBase` implements the call surface): the mask
    as ``mask=``, or its fields as keywords (one of the two)."""

    name: str
    capabilities: Capabilities

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        mask: AttentionMask | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        causal: bool | None = None,
        key_range: KeyRange | None = None,
        doc_blocks: DocBlocks | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None,
        lse: torch.Tensor,
        *,
        scale: float,
        mask: AttentionMask | None = None,
        delta: torch.Tensor | None = None,
        dq: torch.Tensor | None = None,
        dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
        causal: bool | None = None,
        key_range: KeyRange | None = None,
        doc_blocks: DocBlocks | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _call_mask(mask: AttentionMask | None, causal: bool | None, key_range: KeyRange | None = None,
               doc_blocks: DocBlocks | None = None, window: int | None = None,
               softcap: float | None = None) -> AttentionMask:
    """The mask of one kernel call: ``mask`` as given, or the one its keywords describe (direct calls)."""
    if mask is None:
        if causal is None:
            raise TypeError("a kernel call needs its mask: mask=AttentionMask(...), or causal= and the other "
                            "mask keywords.")
        return AttentionMask(causal, key_range, doc_blocks, window, softcap)
    if not isinstance(mask, AttentionMask):
        raise TypeError(f"mask must be an AttentionMask; got {type(mask).__name__}.")
    given = [name for name, value in zip(MASK_KEYWORDS, (causal, key_range, doc_blocks, window, softcap))
             if value is not None]
    if given:
        raise ValueError(f"pass mask= or the mask keywords, not both; got mask= and {', '.join(given)}=.")
    return mask


class KernelBase:
    """Base of every backend: takes the :class:`AttentionMask` (:func:`_call_mask`), checks q, k, v
    (:func:`check_qkv`), refuses what ``capabilities`` does not declare (:meth:`check_call`: the only
    device, dtype, head-dim and mask checks a backend needs), and calls ``_forward`` / ``_backward``.

    A backend sets ``name`` and ``capabilities``, implements ``_forward(q, k, v, mask, *, scale, out,
    lse)`` and ``_backward(dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv)``, and may override
    :meth:`unavailable` (a run-time condition: an importable package, an op in this torch build).
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    def unavailable(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        """Why the backend cannot run on ``device`` now beyond its declared capabilities, or None."""
        return None

    def check_call(self, mask: AttentionMask, q: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ValueError naming the backend when its capabilities do not take this call (device, dtype,
        head dims, mask kind and representation, softcap) or it cannot run now."""
        caps = self.capabilities
        request = KernelRequest(q.device, q.dtype, q.shape[-1], v.shape[-1], mask.kind,
                                mask.softcap is not None)
        reason = caps.refusal(request) or self.unavailable(q.device, q.dtype)
        if reason is None and mask.key_range is not None and not caps.supports_key_range:
            reason = "does not take key_range masks (it takes packed documents as doc_blocks)"
        if reason is None and mask.doc_blocks is not None and not caps.supports_doc_blocks:
            reason = "does not take doc_blocks (it takes packed documents as key_range masks)"
        if reason is not None:
            raise ValueError(f"backend {self.name!r} {reason}; use backend='reference', or 'auto' to pick "
                             "one that takes the call.")

    def forward(self, q, k, v, *, scale, mask=None, out=None, lse=None, causal=None, key_range=None,
                doc_blocks=None, window=None, softcap=None):
        mask = _call_mask(mask, causal, key_range, doc_blocks, window, softcap)
        check_qkv(q, k, v)
        self.check_call(mask, q, v)
        return self._forward(q, k, v, mask, scale=scale, out=out, lse=lse)

    def backward(self, dout, q, k, v, out, lse, *, scale, mask=None, delta=None, dq=None, dk=None, dv=None,
                 causal=None, key_range=None, doc_blocks=None, window=None, softcap=None):
        mask = _call_mask(mask, causal, key_range, doc_blocks, window, softcap)
        check_qkv(q, k, v)
        self.check_call(mask, q, v)
        return self._backward(dout, q, k, v, out, lse, mask, scale=scale, delta=delta, dq=dq, dk=dk, dv=dv)

    def _forward(self, q, k, v, mask: AttentionMask, *, scale, out, lse):
        raise NotImplementedError

    def _backward(self, dout, q, k, v, out, lse, mask: AttentionMask, *, scale, delta, dq, dk, dv):
        raise NotImplementedError


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError naming the problem when q, k, v do not fit the contract."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seq, heads, head_dim); got shape {tuple(t.shape)}. "
                "Transpose (batch, heads, seq, head_dim) tensors with .transpose(1, 2)."
            )
        if not t.is_floating_point():
            raise ValueError(
                f"{name} has dtype {t.dtype}; attention needs a floating dtype "
                "(float32, bfloat16, float16 or float64)."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v dtypes disagree ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype."
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}).")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v shapes disagree ({tuple(k.shape)} vs {tuple(v.shape)}); they must match in batch, "
            "length and heads."
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes disagree: q has {q.shape[0]}, k/v have {k.shape[0]}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims disagree: q has {q.shape[3]}, k/v have {k.shape[3]}.")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError("head_dim is 0: q, k and v need at least one feature per head.")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}) "
            "for GQA/MQA; pick kv_heads dividing heads."
        )


def check_key_range(key_range: KeyRange | None, q: torch.Tensor) -> None:
    """Raise ValueError naming the problem when ``key_range`` does not fit ``q``."""
    if key_range is None:
        return
    lo, hi = key_range
    shape = (q.shape[0], q.shape[1])
    for name, t in (("lo", lo), ("hi", hi)):
        if tuple(t.shape) != shape or t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(
                f"key_range {name} must be an int32 tensor of shape {shape} on {q.device}; got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}."
            )
