"""Make the shared test helpers (tests/distributed.py) importable from every test folder; without a GPU,
Triton kernels run in Triton's interpreter (set before any test imports triton, whatever the order).

Nothing a test starts outlives the test run: the pytest process adopts the processes its children leave
behind (a launcher killed mid-run leaves its workers: Linux's child subreaper), and when pytest ends,
normally or by Ctrl-C, every process still below it is terminated (then killed) and reaped.
"""

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config) -> None:
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _children(pid: int) -> list[int]:
    """Every process whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += _children(child)
    return out


def _ours(pid: int) -> bool:
    """A process a test started (not multiprocessing's resource tracker, which ends with this process)."""
    with contextlib.suppress(OSError):
        return b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


def end_descendants(grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process a test left below this one, SIGKILL what is left after ``grace_s``, reap
    them; their ids."""
    if sys.platform != "linux":
        return []
    ended = [p for p in _descendants(os.getpid()) if _ours(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ended:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(p) for p in ended):
            time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    return ended


def _running(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return False


def pytest_unconfigure(config) -> None:
    end_descendants()
