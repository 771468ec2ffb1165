"""``lightseq-finetune --nproc N CONFIG [key=value ...]``: start N local worker processes of the fine-tune.

The workers get the environment ``torchrun`` gives (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) plus, with ``--accelerate-config``, what
``accelerate launch`` derives from that file (FSDP, mixed precision); like torchrun's agent, the launcher
hosts their rendezvous store, which outlives any worker, so the reason one rank published for its
failure reaches the others (:mod:`lightseq_hf.parallel.failures`). Each worker reports its own
failure in one line (rank 0 for configuration errors); the launcher adds nothing to those, and one line
for a worker that died without a word (killed by a signal). After the first worker fails, the others get a
few seconds (``grace_s``) to report what they saw, then are terminated: a frozen peer never would, and the
first failure's message already names where every rank was.

SIGTERM (``kill``, ``timeout``, a batch scheduler) and SIGINT (Ctrl-C) sent to the launcher are passed on
to the workers, which stop where they are and exit without output; the launcher waits for them (SIGKILL
after ``grace_s``), prints one line and exits with ``128 + signal``. A worker also stops when its launcher
dies (``LAUNCHER_PID_ENV``: the worker asks the kernel for SIGTERM then).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

import lightseq_hf

__all__ = ["LAUNCHER_PID_ENV", "STOP_SIGNALS", "accelerate_env", "launch", "use_expandable_segments",
           "worker_env"]

_EXIT_FAILED = 1
_REPORTED = (1, 2)  # exit statuses whose reason the worker printed itself
#: set in each worker's environment: the launcher's process id (the worker stops when it dies)
LAUNCHER_PID_ENV = "LIGHTSEQ_LAUNCHER_PID"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
#: the CUDA caching allocator's setting every training process starts with, unless the user chose one
_EXPANDABLE_SEGMENTS = "expandable_segments:True"


class _Stopped(Exception):
    """The launcher received SIGTERM."""


def _raise_stopped(signum, frame) -> None:
    raise _Stopped


def _host_store(nproc: int):
    """The workers' rendezvous store, hosted by the launcher on a free port (as torchrun's agent does)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(minutes=30))


def accelerate_env(config_file: str, nproc: int) -> dict[str, str]:
    """The environment ``accelerate launch --config_file config_file`` gives its workers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", config_file, "--num_processes", str(nproc),
                                               "--main_process_port", "0", "worker"])
    args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


def worker_env(base: dict[str, str], rank: int, world: int, port: int) -> dict[str, str]:
    """``base`` plus what a worker of a single-host group of ``world`` needs to join it."""
    package_root = str(Path(lightseq_hf.__file__).resolve().parents[1])  # importable from a checkout too
    path = os.pathsep.join(p for p in (package_root, base.get("PYTHONPATH", "")) if p)
    return {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "NODE_RANK": "0", "PYTHONPATH": path, LAUNCHER_PID_ENV: str(os.getpid())}


def use_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``environ`` unless the user set the
    allocator's configuration (``PYTORCH_CUDA_ALLOC_CONF``, or torch's newer ``PYTORCH_ALLOC_CONF``);
    returns the one log line saying which. The CUDA caching allocator reads the variable once, at its
    first allocation: call this before the process touches CUDA. Expandable segments grow one mapping
    per stream instead of caching blocks of fixed sizes, so long-context steps, whose activations change
    size from layer to layer, do not strand reserved but unallocated memory."""
    for name in (_ALLOC_CONF, "PYTORCH_ALLOC_CONF"):
        if environ.get(name):
            return f"{name}={environ[name]} (set by the user) configures the CUDA allocator"
    environ[_ALLOC_CONF] = _EXPANDABLE_SEGMENTS
    return (f"{_ALLOC_CONF}={_EXPANDABLE_SEGMENTS}: the CUDA allocator grows its segments instead of "
            f"fragmenting (set {_ALLOC_CONF} to choose otherwise)")


def _describe_death(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's out-of-memory killer, or a kill from outside)" if name == "SIGKILL" else ""
        return f"rank {rank} was killed by {name}{hint}"
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        return f"rank {rank} was stopped by {signal.Signals(code - 128).name} (a signal from outside)"
    return f"rank {rank} exited with status {code} without a message (see its output above)"


def _wait(procs: list[subprocess.Popen], grace_s: float, ended: set[int]) -> list[int]:
    """Exit statuses of every worker; once one fails, the rest get ``grace_s`` before SIGTERM/SIGKILL (their
    ranks are added to ``ended``)."""
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes  # type: ignore[return-value]
        if deadline is None and any(c not in (None, 0) for c in codes):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    ended.add(rank)
                    p.terminate()
            try:
                for p in procs:
                    p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            return [p.wait() for p in procs]
        time.sleep(0.1)


def _stop_workers(procs: list[subprocess.Popen], signum: signal.Signals, grace_s: float) -> int:
    """Pass ``signum`` on to the workers still running, wait ``grace_s`` for them (then SIGKILL), say so in
    one line; the exit status ``128 + signum``."""
    for s in STOP_SIGNALS:  # a second Ctrl-C while the workers stop changes nothing
        signal.signal(s, signal.SIG_IGN)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    print(f"lightseq-finetune: stopped by {signum.name}; every worker has exited (resume the run with "
          "saving.resume_from=latest)", file=sys.stderr, flush=True)
    return 128 + signum


def launch(nproc: int, module: str, worker_args: list[str], accelerate_config: str | None = None,
           grace_s: float = 10.0) -> int:
    """Run ``python -m module *worker_args`` as ``nproc`` ranks of one process group on this host; the
    exit status is the first failing rank's (0 when all succeed)."""
    base = accelerate_env(accelerate_config, nproc) if accelerate_config else dict(os.environ)
    store = _host_store(nproc)  # outlives any worker, so the others can read why one failed
    base = {**base, "TORCHELASTIC_USE_AGENT_STORE": "True"}  # the workers join it as clients
    procs = [subprocess.Popen([sys.executable, "-m", module, *worker_args],
                              env=worker_env(base, rank, nproc, store.port)) for rank in range(nproc)]
    previous = {s: h for s in STOP_SIGNALS if (h := signal.getsignal(s)) is not None}
    signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        ended: set[int] = set()
        codes = _wait(procs, grace_s, ended)
    except (KeyboardInterrupt, _Stopped) as stop:
        signum = signal.SIGTERM if isinstance(stop, _Stopped) else signal.SIGINT
        return _stop_workers(procs, signum, grace_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if not failed:
        return 0
    for rank, code in failed:
        if code not in _REPORTED and rank not in ended:
            print(f"lightseq-finetune: {_describe_death(rank, code)}", file=sys.stderr, flush=True)
    return next((c for _, c in failed if c in _REPORTED), _EXIT_FAILED)
