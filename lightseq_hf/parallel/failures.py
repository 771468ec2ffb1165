"""When one rank fails, the others say which rank failed and why, in one line.

A rank that stops on an exception publishes one line about it in the default process group's store
(:func:`publish_notice`, :func:`report_failure`: ``lightseq-finetune``'s workers publish theirs, and
importing ``lightseq_hf`` chains :func:`_excepthook` into ``sys.excepthook`` for scripts of one's own). The
others read those lines (:func:`read_notices`): the fine-tune's watchdog ends a rank as soon as another
published (:mod:`lightseq_hf.training.processes.watchdog`), and a rank whose collective fails because the
failed rank left turns the backend's error ("Connection closed by peer") into a :class:`PeerFailure`
naming the failed rank and its reason (:func:`explain_peer_failure`).

The store must outlive the failed rank. Under ``torchrun``, ``accelerate launch`` and ``lightseq-finetune
--nproc`` the launcher hosts it; where rank 0 hosts it (``init_process_group`` from MASTER_ADDR/MASTER_PORT
without a launcher), a failure of rank 0 reads as "a peer left".
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch.distributed as dist

__all__ = [
    "PeerFailure", "explain_peer_failure", "failure_line", "install_excepthook", "is_comm_failure",
    "one_line", "publish_notice", "read_notices", "report_failure",
]

_NOTICE, _COUNT = "lightseq_failure/notice/", "lightseq_failure/count"
_published = [False]  # this process published its failure
_STORE_WAIT = datetime.timedelta(seconds=2)  # the store is asked only while the process stops
_COMM_HINTS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
               "socket", "gloo", "nccl", "peer", "recv", "send")


class PeerFailure(RuntimeError):
    """A collective did not complete: a peer rank failed, froze, left, or called another operation.
    ``failed_rank`` and ``reason``: the rank that published its failure, and its line (else None, "")."""

    def __init__(self, message: str, failed_rank: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.failed_rank, self.reason = failed_rank, reason


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective or point-to-point transfer that could not complete."""
    if isinstance(exc, PeerFailure):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _COMM_HINTS)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _store():
    """The default group's store with a short wait, or None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        store.set_timeout(_STORE_WAIT)
        return store
    except Exception:  # noqa: BLE001 - no store: the failure is still raised, only unnamed for peers
        return None


def publish_notice(store: Any, rank: int, line: str) -> None:
    """Put ``line``, rank ``rank``'s failure, in ``store`` for the other ranks (once per process)."""
    store.set(f"{_NOTICE}{rank}", line)
    store.add(_COUNT, 1)
    _published[0] = True


def read_notices(store: Any, rank: int, world: int) -> dict[int, str]:
    """The failures the ranks other than ``rank`` published in ``store``, by rank."""
    if store.add(_COUNT, 0) == 0:
        return {}
    found = {}
    for other in range(world):
        key = f"{_NOTICE}{other}"
        if other != rank and store.check([key]):
            found[other] = store.get(key).decode(errors="replace")
    return found


def failure_line(exc: BaseException, rank: int) -> str:
    """The line a failed rank publishes: ``rank R failed: Type: message``."""
    return f"rank {rank} failed: {one_line(exc)}"


def report_failure(exc: BaseException) -> None:
    """Publish this rank's failure for its peers, unless it published one already; best effort, a no-op
    without a process group. Failures of communication are not published: they are effects, not causes."""
    if _published[0] or is_comm_failure(exc) or isinstance(exc, PeerFailure):
        return
    store = _store()
    if store is not None:
        try:
            publish_notice(store, dist.get_rank(), failure_line(exc, dist.get_rank()))
        except Exception:  # noqa: BLE001 - the store is gone: peers will say "a peer left"
            pass


def _reported_failures() -> dict[int, str]:
    """The failures other ranks published, by global rank (empty when none, or without a store)."""
    store = _store()
    try:
        return {} if store is None else read_notices(store, dist.get_rank(), dist.get_world_size())
    except Exception:  # noqa: BLE001 - the store is gone
        return {}


def explain_peer_failure(exc: BaseException, operation: str, unexplained: str = "") -> PeerFailure:
    """The one-line :class:`PeerFailure` for ``exc``, a failed ``operation`` of this rank: the failure
    another rank published, else ``unexplained`` (what this rank knows) and the backend's reason."""
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    failed = _reported_failures()
    if failed:
        rank, line = min(failed.items())
        return PeerFailure(f"rank {me}: {operation} could not complete: {line}", rank, line)
    unexplained = unexplained or "a peer rank left, froze or called another operation"
    return PeerFailure(f"rank {me}: {operation} could not complete: {unexplained}. Backend said: "
                       f"{one_line(exc)}")


def _excepthook(kind, value, traceback, previous=sys.excepthook) -> None:
    """``sys.excepthook`` with a process group: a failed collective is one line naming the rank that
    failed; any other uncaught exception is published for the peers, then shown as usual."""
    if isinstance(value, Exception) and dist.is_available() and dist.is_initialized():
        if is_comm_failure(value) or isinstance(value, PeerFailure):
            said = value if isinstance(value, PeerFailure) else explain_peer_failure(
                value, "a collective", "a peer rank left, froze or called another operation (every rank "
                "of a group must call lightseq_hf.patch(), the model and the same collectives in one order)")
            print(f"lightseq_hf: {said}", file=sys.stderr, flush=True)
            return
        report_failure(value)
    previous(kind, value, traceback)


def install_excepthook() -> None:
    """Chain :func:`_excepthook` in front of the current ``sys.excepthook`` (once)."""
    current = sys.excepthook
    if getattr(current, "_lightseq_failures", False):
        return

    def hook(kind, value, traceback):
        _excepthook(kind, value, traceback, previous=current)

    hook._lightseq_failures = True
    sys.excepthook = hook
