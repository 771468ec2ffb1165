"""Run a function on N spawned CPU processes joined by gloo, and collect what each returns.

Workers return a list of failure messages instead of raising mid-run, so one failing
comparison cannot leave its peers waiting in a collective; the caller asserts the
lists are empty. A worker that raises still fails the test (its peers then stop on
the broken connection or the group timeout).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers fork from one server process per pytest run that has imported these once: a worker then
# starts in well under a second instead of importing torch and transformers again (about 9 s of CPU
# each on the 2-core CI machine). The server imports only; it never runs an operation, so no thread
# pool is forked.
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama"]
mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def _entry(rank: int, world: int, port: int, backend: str, out_dir: str, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the server's from its start
    os.environ.update(environ)
    fn, args = torch.load(Path(out_dir) / "call.pt", weights_only=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300),
                            **kwargs)
    try:
        result = fn(rank, world, *args)
        dist.barrier()  # all ranks done before any tears the group down (gloo may hang or abort if not)
    except Exception:
        result = [f"rank {rank} raised:\n{traceback.format_exc()}"]
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # End without interpreter finalization (as lightseq_hf.training.cli.run does for its workers): a gloo
    # worker thread still freeing a finished collective's tensors needs the GIL there and is ended by
    # pthread_exit, whose unwind through the work's noexcept destructor aborts the process ("terminate
    # called without an active exception") after correct results (lightseq_hf.parallel.teardown waits for
    # those threads at exit; these workers do not depend on it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world: int, *args, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes (gloo on CPU, or nccl with one GPU
    each); return each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        # the call goes through a file: a forkserver passes a tensor argument as one descriptor each, and
        # refuses more than a few hundred (a model's state dict)
        torch.save((fn, args), Path(out_dir) / "call.pt")
        context = mp.start_processes(_entry, args=(world, _free_port(), backend, out_dir, dict(os.environ)),
                                     nprocs=world, join=False, start_method="forkserver")
        try:
            while not context.join():
                pass
        except BaseException:  # Ctrl-C, or a failed rank: no worker keeps computing
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor) in float64 (0 when both are zero); -inf entries must match, a NaN
    fails. ``floor``: for a reference that is zero in exact arithmetic (its norm is rounding noise)."""
    x64, r64 = x.detach().double(), ref.detach().double()
    finite = torch.isfinite(r64)
    if not torch.equal(finite, torch.isfinite(x64)):
        return float("inf")
    x64, r64 = x64[finite], r64[finite]
    denom = max(r64.norm().item(), floor)
    diff = (x64 - r64).norm().item()
    return diff / denom if denom > 0 else diff
