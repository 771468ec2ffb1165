"""The mask of one distributed attention call over the full rows, and its custom-op encoding.

:func:`~lightseq_hf.parallel.api.dist_flash_attn` builds one :class:`SequenceMask` from its arguments.
Custom-op schemas take only plain types (no dataclasses), so the mask crosses the op boundary as
:meth:`SequenceMask.op_args` and every op call turns those back into the same value once
(:meth:`SequenceMask.from_op_args`). The loops then cut each task's
:class:`~lightseq_hf.kernels.AttentionMask` from it (``dist_attn.TaskMasks``), which the kernel takes as is.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from ..kernels import MaskKind
from .segments import Segments, decode_segments

__all__ = ["OpMaskArgs", "SequenceMask"]

#: The custom-op arguments of a :class:`SequenceMask`: causal, :meth:`Segments.encode` (empty: plain rows),
#: window (0: none), softcap (0.0: none).
OpMaskArgs = tuple[bool, list[int], int, float]


@dataclass(frozen=True)
class SequenceMask:
    """Which keys every query of the full rows sees: ``causal``; the documents of the rows (``segments``,
    None: plain rows, one sequence each); a sliding ``window``, which needs the segments
    (``Segments.full`` for plain rows); the logit ``softcap``."""

    causal: bool = True
    segments: Segments | None = None
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.segments is None:
            raise ValueError("a window needs the segments of the rows (Segments.full for plain rows).")

    @property
    def kind(self) -> MaskKind:
        """What the mask needs from a backend (the selection's mask column)."""
        if self.window is not None:
            return MaskKind.WINDOW
        if self.segments is not None:
            return MaskKind.DOCUMENTS
        return MaskKind.CAUSAL if self.causal else MaskKind.FULL

    def digest(self) -> int:
        """A deterministic number for the segments, window and softcap (ranks compare it; causal is
        compared on its own)."""
        digest = 0 if self.segments is None else self.segments.checksum() * 31 + (self.window or 0)
        if self.softcap is not None:
            digest = digest * 31 + zlib.crc32(repr(float(self.softcap)).encode())
        return digest

    def op_args(self) -> OpMaskArgs:
        """The mask as custom-op arguments (the one encoding; :meth:`from_op_args` reverses it)."""
        segments = [] if self.segments is None else self.segments.encode()
        return bool(self.causal), segments, self.window or 0, float(self.softcap or 0.0)

    @classmethod
    def from_op_args(cls, causal: bool, segments: list[int], window: int, softcap: float) -> SequenceMask:
        """The mask that :meth:`op_args` encoded."""
        return cls(bool(causal), decode_segments(segments) if segments else None, window or None,
                   softcap or None)
