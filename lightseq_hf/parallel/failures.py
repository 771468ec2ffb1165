"""When one rank fails, the others say which rank failed and why, in one line.

A rank that stops on an exception publishes one line about it in the default process group's store
(:func:`report_failure`: ``lightseq-finetune``'s workers call it, and importing ``lightseq_hf`` chains
:func:`excepthook` into ``sys.excepthook`` for scripts of one's own). A peer whose collective then fails,
because the failed rank left, reads those lines: :func:`explain_peer_failure` turns the backend's error
("Connection closed by peer") into a :class:`PeerFailure` naming the failed rank and its reason.

The store must outlive the failed rank. Under ``torchrun``, ``accelerate launch`` and ``lightseq-finetune
--nproc`` the launcher hosts it; where rank 0 hosts it (``init_process_group`` from MASTER_ADDR/MASTER_PORT
without a launcher), a failure of rank 0 reads as "a peer left".
"""

from __future__ import annotations

import datetime
import sys

import torch.distributed as dist

_KEY = "lightseq_hf/failed/{}"
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


def report_failure(exc: BaseException | str) -> None:
    """Publish this rank's failure (an exception or a line) for its peers; best effort, a no-op without a
    process group. Failures of communication are not published: they are effects, not causes."""
    if isinstance(exc, BaseException) and (is_comm_failure(exc) or isinstance(exc, PeerFailure)):
        return
    store = _store()
    if store is None:
        return
    try:
        store.set(_KEY.format(dist.get_rank()), exc if isinstance(exc, str) else one_line(exc))
    except Exception:  # noqa: BLE001 - the store is gone: peers will say "a peer left"
        pass


def reported_failures() -> dict[int, str]:
    """The failures other ranks published, by global rank (empty when none, or without a store)."""
    store = _store()
    if store is None:
        return {}
    found = {}
    for rank in range(dist.get_world_size()):
        key = _KEY.format(rank)
        try:
            if rank != dist.get_rank() and store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is gone
            break
    return found


def explain_peer_failure(exc: BaseException, operation: str, unexplained: str = "") -> PeerFailure:
    """The one-line :class:`PeerFailure` for ``exc``, a failed ``operation`` of this rank: which rank failed
    and why when it said so, else ``unexplained`` (what this rank knows) and the backend's reason."""
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    failed = reported_failures()
    if failed:
        rank, line = min(failed.items())
        return PeerFailure(f"rank {me}: {operation} could not complete because rank {rank} failed: {line}",
                           rank, line)
    unexplained = unexplained or "a peer rank left, froze or called another operation"
    return PeerFailure(f"rank {me}: {operation} could not complete: {unexplained}. Backend said: "
                       f"{one_line(exc)}")


def excepthook(kind, value, traceback, previous=sys.excepthook) -> None:
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
    """Chain :func:`excepthook` in front of the current ``sys.excepthook`` (once)."""
    current = sys.excepthook
    if getattr(current, "_lightseq_failures", False):
        return

    def hook(kind, value, traceback):
        excepthook(kind, value, traceback, previous=current)

    hook._lightseq_failures = True
    sys.excepthook = hook
