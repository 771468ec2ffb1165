"""Process-group teardown at interpreter exit (registered with ``atexit`` when the package is imported).

A gloo worker thread frees a finished collective's work after ``wait()`` has returned, and a later
barrier can hold an earlier work until the barrier's own work is freed; freeing a tensor that Python
code created takes the GIL. Once the interpreter finalizes, a thread that asks for the GIL is ended
by ``pthread_exit``, whose unwind through the work's ``noexcept`` destructor calls ``std::terminate``:
a rank aborts (SIGABRT, "terminate called without an active exception") after correct results.
``atexit`` callbacks run before that point, so :func:`release_at_exit` drops the library's references
to its process groups (a group nothing else holds is then destroyed, which joins its threads) and
waits, without the GIL, until the gloo workers of the groups that remain are idle.
"""

from __future__ import annotations

import gc
import os
import time

__all__ = ["gloo_worker_states", "release_at_exit", "wait_for_idle_gloo_workers"]

_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_TASKS = "/proc/self/task"


def gloo_worker_states() -> dict[str, tuple[str, str, str]]:
    """(state, voluntary, involuntary context switches) of this process's gloo worker threads, by
    thread id; empty where ``/proc`` does not list threads."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return {}
    states = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/status") as status:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)
        except OSError:  # the thread ended while being read
            continue
        if fields.get("Name") == _GLOO_WORKER:
            states[tid] = (fields["State"][:1], fields["voluntary_ctxt_switches"],
                           fields["nonvoluntary_ctxt_switches"])
    return states


def wait_for_idle_gloo_workers(timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Wait until every gloo worker thread stayed asleep through one ``interval``; False after
    ``timeout`` seconds without that.

    The sleeps release the GIL, so a worker still freeing a work's tensors can take it and finish; a
    worker that slept through the interval without being switched in is parked on its queue (the GIL
    was free all along, so it was not waiting for it)."""
    deadline = time.monotonic() + timeout
    before = gloo_worker_states()
    while before:
        time.sleep(interval)
        after = gloo_worker_states()
        if after == before and all(state == "S" for state, _, _ in after.values()):
            return True
        if time.monotonic() > deadline:
            return False
        before = after
    return True


def release_at_exit() -> None:
    """Drop the library's process-group references, collect them, and wait for idle gloo workers."""
    from .groups import release_groups
    from .ops import release_comms

    if release_groups() + release_comms():
        gc.collect()  # groups inside reference cycles; the destructor joins a group's threads
    wait_for_idle_gloo_workers()
