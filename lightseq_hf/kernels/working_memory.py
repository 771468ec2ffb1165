"""What a backend's backward allocates, declared on its capability record
(:attr:`~lightseq_hf.kernels.base.Capabilities.backward_memory`) for the memory planner, which reads it
from there: a new backend's memory is declared with it, never guessed.

Counted per token of one local call, beside the call's inputs and the float32 dq/dk/dv the distributed
loop adds into. Widths: ``q`` the query's (query heads x head dim, also the output's), ``kv`` a key's or
value's (key/value heads x head dim), ``qkv`` both together (``q + 2 kv``: dq, dk and dv).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackwardMemory", "Workspace"]

_DTYPE_BYTES = {"float32": 4}
_WIDTHS = ("q", "kv", "qkv")
_WHEN = ("always", "gqa", "ring")


@dataclass(frozen=True)
class Workspace:
    """``count`` tensors of ``width`` per token (``"q"``, ``"kv"`` or ``"qkv"``, see the module docstring) in
    ``dtype`` (``"input"``: the call's dtype, or ``"float32"``), alive at once in the backward; ``when``:
    ``"always"``, only under GQA (``"gqa"``: fewer key/value heads than query heads) or only in a ring task
    (``"ring"``: a sequence-parallel group of more than one). ``tiles``: float32 score tiles of
    ``tile x tile`` per head and batch row beside them (a fixed size, up to the call's tokens)."""

    what: str
    width: str
    dtype: str = "input"
    count: float = 1.0
    when: str = "always"
    tiles: int = 0
    tile: int = 512

    def __post_init__(self) -> None:
        if self.width not in _WIDTHS or self.when not in _WHEN or self.dtype not in ("input", "float32"):
            raise ValueError(f"workspace {self.what!r}: width in {_WIDTHS}, when in {_WHEN}, dtype 'input' "
                             f"or 'float32'; got {self.width!r}, {self.when!r}, {self.dtype!r}.")


@dataclass(frozen=True)
class BackwardMemory:
    """A backend's backward working memory. ``label``: how the planner names its terms. ``partials``: the
    dtype of the gradients it returns for another rank's rows or keys in a ring (``"input"``, or
    ``"float32"``: they take float32 room until sent). ``workspace``: what it allocates."""

    label: str
    partials: str = "float32"
    workspace: tuple[Workspace, ...] = ()

    def terms(self, *, q: int, kv: int, input_bytes: int, heads: int, batch: int, tokens: int, gqa: bool,
              ring: bool) -> dict[str, tuple[float, float]]:
        """``name -> (fixed bytes, bytes per token)`` of the workspace that applies (``gqa``, ``ring``) to a
        call of ``tokens`` tokens on ``batch`` rows with ``heads`` query heads."""
        width = {"q": q, "kv": kv, "qkv": q + 2 * kv}
        out = {}
        for w in self.workspace:
            if (w.when == "gqa" and not gqa) or (w.when == "ring" and not ring):
                continue
            per_token = w.count * width[w.width] * _DTYPE_BYTES.get(w.dtype, input_bytes)
            tile = min(w.tile, tokens)
            out[f"{self.label}: {w.what}"] = (float(w.tiles * batch * heads * tile * tile * 4), per_token)
        return out

    def partial_bytes_per_token(self, kv: int) -> float:
        """Bytes per key token of the dk/dv partials it returns in a ring beyond the input dtype's."""
        return 0.0 if self.partials == "input" else 2 * kv * 4
