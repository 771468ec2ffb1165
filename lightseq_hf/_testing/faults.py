"""Fault injection for the fine-tune: kill, freeze or poison one rank of a real run (tests/test_faults.py).

    LIGHTSEQ_TEST_FAULTS=save:1:4:kill python -m lightseq_hf._testing.faults --nproc 2 CONFIG [key=value ...]

This module is the entry point of such runs: it installs the faults named in ``LIGHTSEQ_TEST_FAULTS``
(comma-separated ``point:rank:step:action``) by wrapping two functions of the trainer, then runs
``lightseq-finetune``; its ``--nproc`` workers run this module again. The library never reads the
variable. Points: ``step`` (a step, before its forward pass), ``loss`` (the step's summed loss),
``save`` (before a rank writes its training state into the checkpoint of that step), ``forward`` and
``backward`` (the first decoder layer's forward, or the backward through its output, in the step's
training pass). Actions: ``kill`` (SIGKILL), ``stop`` (SIGSTOP), ``hang`` (sleep until killed), ``nan``
(the loss becomes NaN; ``loss`` only), ``oom`` (raise ``torch.OutOfMemoryError`` as the CUDA allocator
does), ``raise`` (a ValueError, as a crash of the user's own code would), ``diskfull`` (an OSError
"No space left on device").
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV", "act", "main", "parse"]

ENV = "LIGHTSEQ_TEST_FAULTS"
_POINTS = ("step", "loss", "save", "forward", "backward")
_ACTIONS = ("kill", "stop", "hang", "nan", "oom", "raise", "diskfull")
_STEP = [0]  # the step whose training pass is running (0: none, e.g. the first step's parity check)


@dataclass(frozen=True)
class _Fault:
    point: str
    rank: int
    step: int
    action: str


def parse(spec: str) -> list[_Fault]:
    """``"point:rank:step:action,..."`` -> faults; ValueError naming a malformed entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) != 4 or parts[0] not in _POINTS or parts[3] not in _ACTIONS \
                or not (parts[1].isdigit() and parts[2].isdigit()):
            raise ValueError(f"{ENV} entry {entry!r} must look like point:rank:step:action with point one of "
                             f"{', '.join(_POINTS)} and action one of {', '.join(_ACTIONS)}")
        faults.append(_Fault(parts[0], int(parts[1]), int(parts[2]), parts[3]))
    return faults


def act(faults: list[_Fault], point: str, rank: int, step: int) -> bool:
    """Carry out the fault at ``(point, rank, step)``, if one is listed; True for ``nan``."""
    for f in faults:
        if (f.point, f.rank, f.step) != (point, rank, step):
            continue
        print(f"[lightseq] fault injection: {f.action} at {point}, rank {rank}, step {step}", flush=True)
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.action == "hang":
            while True:
                time.sleep(3600)
        elif f.action == "oom":
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. (fault injection)")
        elif f.action == "raise":
            raise ValueError(f"injected failure ({point} point, step {step})")
        elif f.action == "diskfull":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"step {step}")
        return f.action == "nan"
    return False


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def _listed(faults: list[_Fault], point: str, step: int) -> bool:
    return any((f.point, f.rank, f.step) == (point, _rank(), step) for f in faults)


def _add_layer_faults(model, faults: list[_Fault]) -> None:
    """Points forward and backward: a forward hook on the model's first decoder layer."""
    armed: set[int] = set()

    def hook(module, args, output):
        step = _STEP[0]
        act(faults, "forward", _rank(), step)
        if _listed(faults, "backward", step) and step not in armed:
            armed.add(step)
            hidden = output[0] if isinstance(output, tuple) else output
            hidden.register_hook(lambda grad: act(faults, "backward", _rank(), step))

    model.get_decoder().layers[0].register_forward_hook(hook)


def _install(faults: list[_Fault]) -> None:
    """Wrap ``Trainer._forward_backward`` (points step, loss, and the step the layer points see),
    the fine-tune's ``apply_patch`` (points forward, backward) and ``checkpoints.write_training_state``
    (point save) so that they carry out ``faults``."""
    from lightseq_hf.training import checkpoints, loop

    forward_backward = loop.Trainer._forward_backward
    write_state = checkpoints.write_training_state
    apply_patch = loop.apply_patch

    @functools.wraps(forward_backward)
    def faulty_forward_backward(self, batches, step):
        act(faults, "step", _rank(), step)
        _STEP[0] = step
        try:
            loss_sum = forward_backward(self, batches, step)
        finally:
            _STEP[0] = 0
        return loss_sum + float("nan") if act(faults, "loss", _rank(), step) else loss_sum

    @functools.wraps(apply_patch)
    def faulty_apply_patch(model, *args, **kwargs):
        model = apply_patch(model, *args, **kwargs)
        _add_layer_faults(model, faults)
        return model

    @functools.wraps(write_state)
    def faulty_write_state(accelerator, directory: Path):
        step = int(re.search(r"checkpoint-(\d+)", Path(directory).parent.name).group(1))
        act(faults, "save", _rank(), step)
        return write_state(accelerator, directory)

    loop.Trainer._forward_backward = faulty_forward_backward
    loop.apply_patch = faulty_apply_patch
    checkpoints.write_training_state = faulty_write_state


def main(argv: list[str] | None = None) -> None:
    """``lightseq-finetune`` with the faults of ``LIGHTSEQ_TEST_FAULTS`` installed in every worker."""
    from lightseq_hf.training.cli import run

    _install(parse(os.environ.get(ENV, "")))
    run(argv, worker_module="lightseq_hf._testing.faults")


if __name__ == "__main__":
    main()
