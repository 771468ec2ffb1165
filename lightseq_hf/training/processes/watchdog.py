"""The watchdog: a thread on every rank of a run that reads the other ranks' failure notices
(:class:`~.board.FailureBoard`). A rank that has not failed itself prints ``stopped on rank R: <the
notice>`` as its one line and ends its process at once, whatever its main thread is blocked in (a
collective waiting for the failed rank would otherwise wait for ``training.timeout_s``, or end with a
backend traceback).

Every rank of a run that stops this way exits with status 1 (:data:`_EXIT_STOPPED`), the status of a run
that stopped on a failure, each with one line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from ..output import release_output_dir_locks
from .board import FailureBoard

__all__ = ["PeerWatch", "watch_peers"]

_EXIT_STOPPED = 1
_PREFIX = "lightseq-finetune: "  # the fine-tune's one-line reports (cli._fail) start so
_LINGER_S = 1.0  # a peer's exit after reading a notice waits this long: the failed rank prints first


def _end_process(line: str, mark_read: Callable[[], None] = lambda: None) -> None:
    """Print ``line`` as this process's one report, tell the failed rank (``mark_read``), and end the
    process (exit status :data:`_EXIT_STOPPED`); what the process writes after the line is discarded."""
    print(_PREFIX + line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        mark_read()
    finally:
        release_output_dir_locks()
        time.sleep(_LINGER_S)
        os._exit(_EXIT_STOPPED)


class PeerWatch(threading.Thread):
    """Reads the other ranks' notices every ``interval_s``; the first one ends this process through
    ``on_failure(line, mark_read)`` (default :func:`_end_process`), unless this rank published a notice
    of its own (it then marks the others' notices read and reports its own failure itself)."""

    def __init__(self, board: FailureBoard, interval_s: float = 0.2,
                 on_failure: Callable[[str, Callable[[], None]], None] = _end_process) -> None:
        super().__init__(name="lightseq-peer-watch", daemon=True)
        self.board, self.interval_s, self.on_failure = board, interval_s, on_failure
        self._stop_event = threading.Event()

    def run(self) -> None:
        read: set[int] = set()
        while not self._stop_event.wait(self.interval_s):
            try:
                notices = {r: line for r, line in self.board.notices().items() if r not in read}
                for rank, line in sorted(notices.items()):
                    read.add(rank)
                    if self.board.published:
                        self.board.mark_read(rank)
                    else:
                        self.on_failure(f"stopped on rank {self.board.rank}: {line}",
                                        lambda rank=rank: self.board.mark_read(rank))
                        return
            except Exception:  # the store is gone: the run is ending, by another path
                return

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)


def watch_peers(board: FailureBoard | None) -> PeerWatch | None:
    """A started watchdog reading ``board``; None without a board (a run of one process)."""
    if board is None:
        return None
    watch = PeerWatch(board)
    watch.start()
    return watch
