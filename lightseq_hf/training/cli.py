"""``lightseq-finetune [--nproc N] CONFIG.yaml [key.sub=value ...]`` (also ``scripts/finetune.py``).

With ``--nproc N`` the command checks the config for N processes, then starts them (see
:mod:`.processes.launch`); without it, it is one worker (under ``accelerate launch``/``torchrun``, or
alone). Exit status: 0 done, 2 a configuration problem (one line, printed by rank 0 only), 1 a run that
stopped on a checkpoint, non-finite or peer failure (one line per rank that saw it) or because a step ran
out of memory on some rank (one line on every rank: which rank, where, and the planner's advice for this
machine).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from ..parallel.failures import PeerFailure, explain_peer_failure, is_comm_failure, one_line, report_failure
from .config import FinetuneConfig, load_config
from .errors import ConfigError
from .log import install_console_handler, logger
from .output import release_output_dir_locks
from .processes.launch import LAUNCHER_PID_ENV, STOP_SIGNALS
from .shape import RunShape, run_shape

__all__ = ["main", "run", "worker_failed"]

_EXIT_CONFIG, _EXIT_FAILED = 2, 1
_WORKER_MODULE = "lightseq_hf.training.cli"


def _world_size() -> int | None:
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws else None


def _is_reporting_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(msg: str, code: int, every_rank: bool = False) -> int:
    if every_rank or _is_reporting_rank():
        print(f"lightseq-finetune: {msg}", file=sys.stderr, flush=True)
    return code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line (no usage block), exit status 2
        raise ConfigError(f"{message} (see lightseq-finetune --help)")


def _parser() -> _Parser:
    p = _Parser(prog="lightseq-finetune",
                description="Sequence-parallel long-context fine-tuning (DistFlashAttn). `lightseq-finetune "
                            "--nproc N CONFIG.yaml` starts N local processes; under `accelerate launch` or "
                            "`torchrun` leave --nproc out.")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides, e.g. training.max_steps=20 output_dir=/tmp/x")
    p.add_argument("--nproc", type=int, default=None,
                   help="check the config for this many processes, then start them on this host")
    p.add_argument("--accelerate-config", default=None, metavar="FILE",
                   help="--nproc: an accelerate config file (FSDP, mixed precision) for the workers")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--check", action="store_true",
                   help="validate the config and output_dir (no changes made), say what was checked, exit; "
                        "with --world-size or --nproc, as a launch of that many processes would")
    p.add_argument("--world-size", "--world", type=int, default=None,
                   help="processes the run will launch (--check, --plan; default --nproc, else WORLD_SIZE)")
    p.add_argument("--plan", action="store_true",
                   help="print the predicted peak device and host memory per rank and the longest context "
                        "that fits, then exit (nothing is allocated)")
    p.add_argument("--sharding", choices=("fsdp", "replicated"), default="fsdp",
                   help="--plan: FSDP (parameters, gradients, optimizer state sharded) or DDP")
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="--plan: device memory per rank (default: this machine's GPU, else 139 = H200)")
    p.add_argument("--host-gib", type=float, default=None,
                   help="--plan: host memory per rank (default: this machine's RAM / world)")
    return p


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric options: process counts at least 1, memory sizes positive and finite."""
    for flag, value in (("--nproc", args.nproc), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1; got {value}")
    for flag, value in (("--gpu-gib", args.gpu_gib), ("--host-gib", args.host_gib)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be a positive number of GiB; got {value}")


def _check_text(cfg: FinetuneConfig, config_path: str, shape: RunShape | None, resume: Path | None) -> str:
    """What ``--check`` verified, in one line (``shape``: None when the world size is not given)."""
    layout = (f"{shape.describe()}, {shape.tokens_per_rank} tokens per rank" if shape is not None else
              "world size not given (add --world-size N to check the process layout)")
    m = cfg.model
    model = f"model.path {m.path}" if m.path else f"model.config ({m.config.get('model_type')}, keys checked)"
    start = f"resumes from {resume}" if resume is not None else "fresh start"
    return (f"check passed: {config_path}: schema, types and ranges; {layout}; context {cfg.context_length}; "
            f"{model}; data {cfg.data.type}; output_dir {cfg.output_dir} writable, {start}")


def _stop_on_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM (kill, timeout, a batch scheduler) stop this worker where it is, as a
    KeyboardInterrupt; a second signal while it stops changes nothing. Under ``lightseq-finetune --nproc``
    the worker also stops when the launcher dies."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame):
        if _stopped_by[0] is None:
            _stopped_by[0] = signal.Signals(signum)
            raise KeyboardInterrupt

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and sys.platform == "linux":
        import ctypes

        with contextlib.suppress(OSError, AttributeError):  # PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
        if str(os.getppid()) != launcher:  # the launcher died before the request
            os.kill(os.getpid(), signal.SIGTERM)


_stopped_by: list[signal.Signals | None] = [None]


def _stopped(signum: signal.Signals) -> int:
    """A worker stopped by a signal: one line from rank 0, none under our launcher (it says it once)."""
    if LAUNCHER_PID_ENV not in os.environ:
        _fail(f"stopped by {signum.name} (resume the run with saving.resume_from=latest)", 128 + signum)
    return 128 + signum


def _timed_out(e: BaseException) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


def _port_in_use(e: BaseException) -> bool:
    return "EADDRINUSE" in str(e) or "address already in use" in str(e).lower()


def _process_group_failed(e: BaseException, timeout_s: float | None) -> str:
    """What failed when the process group of the environment's WORLD_SIZE could not start."""
    names = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
    shown = ", ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ)
    reason = one_line(e).rstrip(".")
    if _port_in_use(e):
        where = f"port {os.environ.get('MASTER_PORT')} of {os.environ.get('MASTER_ADDR', 'this host')}"
        return (f"{where} is in use (another run's, or one that has not exited yet), so rank 0 could not "
                f"host the process group there ({reason}). Choose a free port (MASTER_PORT, torchrun "
                "--master_port, accelerate launch --main_process_port), or start with lightseq-finetune "
                "--nproc N, which picks one")
    if timeout_s is not None and _timed_out(e):
        return (f"the processes did not all join the process group within training.timeout_s={timeout_s:g} s "
                f"({shown}: {reason}). Raise training.timeout_s (it bounds the start-up as well as every "
                "collective wait), and check that every rank was started")
    return (f"could not start the process group that the environment describes ({shown}): {reason}. "
            "Start every rank (lightseq-finetune --nproc N, torchrun or accelerate launch), or unset "
            "WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to run one process.")


def worker_failed(e: BaseException, timeout_s: float | None = None) -> int:
    """Report a worker's failure (published for its peers first), in one line where it is understood
    (``timeout_s``: the run's ``training.timeout_s``, named when a wait ran out); the process's exit
    status."""
    from ..guard.parity import ParityError
    from .guards import NonFiniteError
    from .processes.board import OutOfMemoryStop
    from .saving import CheckpointError

    if _stopped_by[0] is not None or isinstance(e, KeyboardInterrupt):
        return _stopped(_stopped_by[0] or signal.SIGINT)
    if not isinstance(e, Exception):
        raise e
    started = dist.is_available() and dist.is_initialized()
    if not started and (_world_size() or 1) > 1 and (isinstance(e, getattr(dist, "DistError", ()))
                                                   or "MASTER_ADDR" in str(e) or _timed_out(e)
                                                   or _port_in_use(e)):
        return _fail(_process_group_failed(e, timeout_s), _EXIT_CONFIG, every_rank=True)
    if is_comm_failure(e) and not isinstance(e, (CheckpointError, NonFiniteError, ParityError)):
        waited = f" or did not answer within training.timeout_s={timeout_s:g} s" if timeout_s else ""
        e = explain_peer_failure(e, "the run", f"a peer rank left, froze, called another operation{waited}")
    if not isinstance(e, OutOfMemoryStop):  # that one published its line itself
        report_failure(e)
    if isinstance(e, ConfigError):
        return _fail(f"config error: {e}", _EXIT_CONFIG)
    if isinstance(e, (CheckpointError, NonFiniteError)):
        return _fail(f"stopped: {e}", _EXIT_FAILED)
    if isinstance(e, ParityError):
        return _fail(f"stopped at the first step's parity check (parity.enabled=false skips it): {e}",
                     _EXIT_FAILED, every_rank=True)
    if isinstance(e, PeerFailure) and e.reason.startswith(f"rank 0 failed: {ConfigError.__name__}:"):
        return _EXIT_CONFIG  # rank 0 printed the configuration problem
    if isinstance(e, (PeerFailure, OutOfMemoryStop)):
        return _fail(f"stopped: {e}", _EXIT_FAILED, every_rank=True)
    if isinstance(e, (ValueError, OSError)):  # the library's refusals, and the system's (disk, files)
        return _fail(f"rank {os.environ.get('RANK', '0')} stopped: {one_line(e)}", _EXIT_FAILED,
                     every_rank=True)
    raise e  # anything else is a fault of the program: its traceback follows


def _run_worker(cfg: FinetuneConfig) -> int:
    from .loop import train

    _stopped_by[0] = None
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: h for s in STOP_SIGNALS if (h := signal.getsignal(s)) is not None} if main_thread else {}
    try:
        _stop_on_signals()
        train(cfg)
    except BaseException as e:  # noqa: BLE001 - every failure is reported (peers read it), then mapped
        return worker_failed(e, cfg.training.timeout_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _worker_args(argv: list[str]) -> list[str]:
    """The command line without the launcher's own options."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--accelerate-config"):
            skip = True
        elif not a.startswith(("--nproc=", "--accelerate-config=")):
            out.append(a)
    return out


def main(argv: list[str] | None = None, worker_module: str = _WORKER_MODULE) -> int:
    """Parse the command line, validate the config, and train (or launch ``--nproc`` workers running
    ``python -m worker_module``). Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    install_console_handler()
    try:
        args = _parser().parse_intermixed_args(argv)  # options may come after the overrides
        _check_numbers(args)
        world = args.world_size or args.nproc or _world_size()
        cfg = load_config(args.config, args.overrides, world_size=world)
        shape = run_shape(cfg, world) if world else None
        if args.check or args.nproc:
            from .output import prepare_output_dir

            resume = prepare_output_dir(cfg, dry_run=True)
    except ConfigError as e:
        return _fail(f"config error: {e}", _EXIT_CONFIG)
    except RuntimeError as e:  # CheckpointError from --check
        return _fail(str(e), _EXIT_FAILED)
    if args.plan:
        from .planning import plan_text

        try:
            planned = shape or run_shape(cfg, cfg.sp_size or 1)
            print(plan_text(cfg, planned, args.sharding, args.gpu_gib, args.host_gib))
        except (ConfigError, ValueError) as e:
            return _fail(f"--plan: {e}", _EXIT_CONFIG)
        return 0
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if args.check or args.nproc:  # the launcher makes --check's checks before it starts anything
        from .preflight import preflight

        try:
            done = preflight(cfg, shape, resume)
        except ConfigError as e:
            return _fail(f"config error: {e}", _EXIT_CONFIG)
        except RuntimeError as e:  # CheckpointError
            return _fail(str(e), _EXIT_FAILED)
    if args.check:
        print(f"lightseq-finetune: {_check_text(cfg, args.config, shape, resume)}; {'; '.join(done)}",
              flush=True)
        return 0
    if args.nproc:
        from .processes.launch import launch

        try:
            return launch(args.nproc, worker_module, _worker_args(argv), args.accelerate_config,
                          grace_s=min(max(cfg.training.timeout_s, 2.0), 10.0))
        except (ValueError, OSError) as e:  # accelerate refusing its config file
            return _fail(f"--accelerate-config: {e}", _EXIT_CONFIG)
    _start_worker(cfg.training.device)
    return _run_worker(cfg)


def _start_worker(device: str) -> None:
    """What a training process sets before its first CUDA allocation: the allocator's default (said by
    rank 0 when the run uses CUDA; ``device``: ``training.device``)."""
    import torch

    from .processes.launch import use_expandable_segments

    line = use_expandable_segments()
    if _is_reporting_rank() and device != "cpu" and torch.cuda.is_available():
        logger.info(line)


def run(argv: list[str] | None = None, worker_module: str = _WORKER_MODULE) -> NoReturn:
    """The process entry point (``lightseq-finetune``, ``python -m``, scripts/finetune.py): :func:`main`,
    then exit with its status.

    A worker of a multi-process run ends with ``os._exit`` once its output is flushed, skipping the
    interpreter's finalization: a gloo worker thread still freeing a finished collective's tensors
    needs the GIL there and is ended by ``pthread_exit``, whose unwind through the work's ``noexcept``
    destructor aborts the process ("terminate called without an active exception") after a correct run.
    The exit handler of ``lightseq_hf.parallel.teardown`` waits for those threads; ``os._exit`` does not
    depend on it. Everything the run writes is closed before ``main`` returns."""
    code = main(argv, worker_module)
    release_output_dir_locks()  # however the run ended
    if (_world_size() or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
