"""The exit handler (lightseq_hf.parallel.teardown): it drops the library's process groups, so that a group
nothing else holds is destroyed and its gloo threads joined before the interpreter finalizes, and it
waits for the gloo workers of the groups that remain to be idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from distributed import run_distributed

import lightseq_hf
from lightseq_hf.parallel import current_groups, init_sequence_parallel, ops, teardown

ROOT = Path(__file__).resolve().parent.parent


def worker_release(rank: int, world: int) -> list[str]:
    failures = []
    x = torch.ones(4)
    dist.all_reduce(x)  # gloo starts a group's threads at its first collective
    before = len(teardown.gloo_worker_states())
    groups = init_sequence_parallel(1)  # a one-rank gloo group per rank, with its own worker threads
    q = torch.randn(1, 4, 2, 8)
    lightseq_hf.dist_flash_attn(q, q, q, group=groups.sp_group)  # the ring's cached PeerComm holds it too
    dist.all_reduce(x, group=groups.sp_group)
    dist.barrier()
    with_group = len(teardown.gloo_worker_states())
    if with_group <= before:
        failures.append(f"rank {rank}: {with_group} gloo workers with the group, {before} without")
    dist.destroy_process_group(groups.sp_group)  # torch forgets it; the library still holds it
    del groups
    if len(teardown.gloo_worker_states()) != with_group:
        failures.append(f"rank {rank}: the group's threads ended while the library held it")
    teardown.release_at_exit()
    if current_groups() is not None or (held := ops.release_comms()):
        failures.append(f"rank {rank}: the library still holds groups: {current_groups()}, {held} rings")
    deadline = time.monotonic() + 5.0  # a joined thread can stay listed in /proc for a moment
    while len(teardown.gloo_worker_states()) != before and time.monotonic() < deadline:
        time.sleep(0.01)
    if len(teardown.gloo_worker_states()) != before:
        failures.append(f"rank {rank}: {len(teardown.gloo_worker_states())} gloo workers after the release, "
                        f"{before} before the group was made")
    if not teardown.wait_for_idle_gloo_workers(timeout=5.0):
        failures.append(f"rank {rank}: the default group's workers did not go idle")
    return failures


def test_release_at_exit_joins_the_threads_of_the_library_groups():
    failures = [f for rank_failures in run_distributed(worker_release, 2) for f in rank_failures]
    assert not failures, failures


_EXIT_SCRIPT = """
import atexit
{before}
import torch
import lightseq_hf
from lightseq_hf.parallel import ops
{after}
q = torch.randn(1, 4, 2, 8)
lightseq_hf.dist_flash_attn(q, q, q)  # its ring is kept for the next call
"""
_REPORT = 'atexit.register(lambda: print("held at the end:", ops.release_comms()))'


def test_the_handler_runs_at_exit():
    """Registered when lightseq_hf.parallel is imported: exit handlers registered later run before it,
    those registered earlier after it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for before, after, held in (("", _REPORT, 1), (_REPORT, "", 0)):
        script = _EXIT_SCRIPT.format(before=before, after=after)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0 and f"held at the end: {held}" in out.stdout, (out.stdout, out.stderr)
