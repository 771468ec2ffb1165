"""Run guards: non-finite values and peers that stop answering.

* :class:`NonFiniteError` stops a run whose loss or gradient norm is NaN/Inf, naming the step;
  :func:`check_every_parameter_has_a_gradient` one whose wrapping left trainable parameters out.
* :class:`Progress` records what each rank is doing (in the process group's key-value store), so a
  rank whose collective fails can say which operation it was in, and which rank failed and why
  (:mod:`lightseq_hf.parallel.failures`) or where each peer last was; :meth:`Progress.explain` turns the
  raw backend error into :class:`PeerFailure`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from collections.abc import Iterator

import torch

from ..parallel.failures import PeerFailure, explain_peer_failure, is_comm_failure

__all__ = ["NonFiniteError", "PeerFailure", "Progress", "check_every_parameter_has_a_gradient",
           "is_comm_failure"]


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step is NaN or Inf."""


class Progress:
    """What this rank is doing, published in the default store for its peers to read on failure."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.operation, self.step = "start-up", 0
        self._store = None
        if world > 1:
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                self._store = _get_default_store()
            except Exception:  # no store to share progress through: errors still name this rank's op
                self._store = None

    def _key(self, rank: int) -> str:
        return f"lightseq_progress/{rank}"

    def set(self, operation: str, step: int) -> None:
        self.operation, self.step = operation, step
        if self._store is not None:
            try:
                self._store.set(self._key(self.rank), json.dumps({"op": operation, "step": step,
                                                                   "time": time.time()}))
            except Exception:
                self._store = None

    @contextlib.contextmanager
    def phase(self, operation: str, step: int) -> Iterator[None]:
        """Run a block as ``operation``; a failed collective inside becomes :class:`PeerFailure`."""
        self.set(operation, step)
        try:
            yield
        except (NonFiniteError, PeerFailure):
            raise
        except Exception as e:
            if self.world > 1 and is_comm_failure(e):
                raise self.explain(e) from e
            raise

    def peers(self) -> str:
        """Where every other rank last reported being (best effort: the store may be gone)."""
        if self._store is None:
            return "peer progress unknown"
        notes = []
        with contextlib.suppress(Exception):
            self._store.set_timeout(datetime.timedelta(seconds=2))
        now = time.time()
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                rec = json.loads(self._store.get(self._key(r)))
                notes.append(f"rank {r} last in '{rec['op']}' at step {rec['step']} "
                             f"({now - rec['time']:.0f} s ago)")
            except Exception:
                notes.append(f"rank {r}: no report (gone, or never started)")
        return "; ".join(notes)

    def explain(self, exc: BaseException) -> PeerFailure:
        """The one-line PeerFailure for a failed collective of the current operation: the rank that failed
        and its reason when it published one, else where every peer last was."""
        return explain_peer_failure(
            exc, f"'{self.operation}' at step {self.step}",
            f"a peer did not answer within training.timeout_s={self.timeout_s:g} s or left ({self.peers()})")


def check_every_parameter_has_a_gradient(model: torch.nn.Module) -> None:
    """Raise if a trainable parameter got no gradient from the first step: it would silently never train."""
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise RuntimeError(
            f"{len(missing)} trainable parameters received no gradient in the first step ({shown}); they "
            "would never train. Freeze them (requires_grad=False) or report this with the wrapping used."
        )
