"""Test-side instruments for the kernels and the distributed op: no counter lives in the library.

- :class:`PoisonEmpty`: every floating ``torch.empty`` result starts as NaN (an element a kernel leaves
  unwritten then shows).
- :class:`OpCalls`: counts calls of the ``lightseq_hf::dist_attn_fwd`` / ``dist_attn_bwd`` custom ops, the
  local query length and the mask arguments of each forward, as autograd and checkpointing really dispatch
  them.
"""

from __future__ import annotations

import collections
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_EMPTY = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
          torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default)


class PoisonEmpty(TorchDispatchMode):
    """Fill every floating tensor ``torch.empty`` (and its variants) returns with NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and out.is_floating_point():
            out.fill_(math.nan)
            self.poisoned += 1
        return out


class OpCalls(TorchDispatchMode):
    """Counts of the distributed attention ops: ``calls["forward"]`` / ``calls["backward"]``;
    ``lengths``: local query length -> forwards that saw it; ``masks``: per forward, whether it got packed
    documents (the op's ``segments`` argument) and its ``window`` (0: none). Use as a context manager around
    the work."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"forward": 0, "backward": 0}
        self.lengths: collections.Counter = collections.Counter()
        self.masks: list[tuple[bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.lightseq_hf.dist_attn_fwd.default:
            self.calls["forward"] += 1
            self.lengths[args[0].shape[1]] += 1
            named = {**dict(zip((a.name for a in func._schema.arguments), args)), **(kwargs or {})}
            self.masks.append((bool(named["segments"]), named["window"]))
        elif func is torch.ops.lightseq_hf.dist_attn_bwd.default:
            self.calls["backward"] += 1
        return func(*args, **(kwargs or {}))
