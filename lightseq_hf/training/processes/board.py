"""A step that runs out of memory, and one rank's failure told to every other rank.

* :func:`is_out_of_memory`: torch's ``OutOfMemoryError``, or an error whose text says "out of memory"
  (NCCL's surface as ``RuntimeError`` / ``DistBackendError``: "CUDA error: out of memory"), anywhere in
  the exception's cause chain.
* :class:`OutOfMemoryStop`: the step ran out of memory on this rank; its message is the one line the
  fine-tune prints (:func:`out_of_memory_line`: the rank, the phase, the allocator's numbers, then the
  planner's advice for this machine).
* :class:`FailureBoard`: notices in the process group's store (the keys of
  :mod:`lightseq_hf.parallel.failures`, which the library's own failure reports use). The rank that fails
  (out of memory, or any error of a training step, a save or an evaluation: :func:`tell_peers`)
  publishes its line and waits, a few seconds at most, until every peer has read it (a store that this
  rank hosts must outlive the reading); the other ranks read it through their watchdog
  (:mod:`.watchdog`).
* :func:`main_decides`: a decision of the main process (or its refusal) handed to every rank.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

import torch
import torch.distributed as dist

from ...parallel.failures import PeerFailure, failure_line, is_comm_failure, publish_notice, read_notices

__all__ = ["FailureBoard", "OutOfMemoryStop", "is_out_of_memory", "main_decides", "out_of_memory_line",
           "stop_for_out_of_memory", "tell_peers"]

_READ = "lightseq_failure/read/"


class OutOfMemoryStop(RuntimeError):
    """This rank ran out of memory in a training step; the message is the one line to print."""


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from is an out-of-memory error."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def out_of_memory_line(rank: int, operation: str, step: int, exc: BaseException, device: torch.device,
                       advice: str) -> str:
    """``rank R ran out of memory in '<operation>' at step S (<the allocator's numbers>); <advice>``."""
    asked = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(exc))
    facts = [f"tried to allocate {asked.group(1)}"] if asked else []
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        facts.append(f"{_gib(torch.cuda.memory_allocated(device))} allocated, "
                     f"{_gib(torch.cuda.memory_reserved(device))} reserved of {_gib(total)}")
    where = f" ({'; '.join(facts)})" if facts else ""
    return f"rank {rank} ran out of memory in '{operation}' at step {step}{where}; {advice}"


class FailureBoard:
    """Failure notices of the ranks of one run, in the default process group's store."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float = 5.0) -> None:
        self.rank, self.world = rank, world
        self.published = False
        self._main, self._watch = self._client(store, timeout_s), self._client(store, timeout_s)

    @staticmethod
    def _client(store: Any, timeout_s: float) -> Any:
        """A connection of its own (a blocked call holds the store client's lock), with a short timeout."""
        try:
            store = store.clone()
        except (AttributeError, RuntimeError):
            pass
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store

    @classmethod
    def for_default_group(cls, rank: int, world: int) -> FailureBoard | None:
        """The board of the default process group; None for one process or a group without a store."""
        if world < 2:
            return None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return cls(_get_default_store(), rank, world)
        except Exception:  # no store to publish in: the failed rank's own line and the launcher remain
            return None

    def publish(self, line: str) -> None:
        """Tell every other rank that this one failed, with ``line``."""
        self.published = True
        publish_notice(self._main, self.rank, line)

    def wait_read(self, timeout_s: float = 10.0) -> bool:
        """Wait until every other rank has read this rank's notice (False after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self._main.add(f"{_READ}{self.rank}", 0) >= self.world - 1:
                    return True
            except Exception:  # the store is gone with the peer that hosted it: nobody left to wait for
                return False
            time.sleep(0.05)
        return False

    def notices(self) -> dict[int, str]:
        """The other ranks' notices, by rank."""
        return read_notices(self._watch, self.rank, self.world)

    def mark_read(self, rank: int) -> None:
        self._watch.add(f"{_READ}{rank}", 1)


def tell_peers(board: FailureBoard | None, exc: BaseException) -> None:
    """Publish the failure ``exc`` of this rank (unless it is an effect of another rank's, or already told)
    and wait until the peers have read it: their watch ends them with a line naming this rank first."""
    if board is None or board.published or isinstance(exc, (PeerFailure, OutOfMemoryStop)) \
            or is_comm_failure(exc):
        return
    try:
        board.publish(failure_line(exc, board.rank))
        board.wait_read()
    except Exception:  # noqa: BLE001 - the store failed: this rank's own line still ends the run
        pass


def stop_for_out_of_memory(board: FailureBoard | None, line: str) -> OutOfMemoryStop:
    """Publish ``line`` for the other ranks and wait until they have read it; the exception to raise."""
    if board is not None:
        try:
            board.publish(line)
            board.wait_read()
        except Exception:  # the store failed: this rank's own line still ends the run
            pass
    return OutOfMemoryStop(line)


def main_decides(accelerator: Any, fn: Any) -> Any:
    """Run ``fn`` on the main process and hand its result, or its ConfigError/CheckpointError, to every
    rank (so that all ranks stop together, with the same message): a failure every rank learns of."""
    result: list[Any] = [None, None]
    if accelerator.is_main_process:
        try:
            result = [fn(), None]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait
            result = [None, (type(e).__name__, str(e))]
    if accelerator.num_processes > 1:
        device = accelerator.device if dist.get_backend() == "nccl" else None
        dist.broadcast_object_list(result, src=0, device=device)
    if result[1] is not None:
        kind, msg = result[1]
        from ..errors import ConfigError
        from ..saving import CheckpointError

        known = {"ConfigError": ConfigError, "CheckpointError": CheckpointError}
        raise known[kind](msg) if kind in known else RuntimeError(f"{kind}: {msg}")
    return result[0]
