"""Leave a model as it was (gradients, buffers, training modes, every random generator), and run it
without random draws in between (dropout, layer drop, sampled routing)."""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator

import torch

__all__ = ["preserved_state"]

#: module attributes holding the probability or scale of a draw made in training mode (dropout, layer drop,
#: router and input jitter)
_NOISE_ATTRIBUTE = re.compile(r"dropout|drop_prob|pdrop|layerdrop|jitter")


def _numpy_random():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Run the body with no random draws (:func:`_without_noise`) and no gradients on the parameters;
    afterwards restore, bit for bit, each parameter's gradient (the same tensor object, its values copied
    back in case backward wrote into shared storage, as DDP's bucket views do), the buffers, each module's
    training mode and the zeroed attributes, and the torch CPU and CUDA, Python and NumPy random states."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else None
    python_rng = random.getstate()
    numpy_random = _numpy_random()
    numpy_rng = numpy_random.get_state() if numpy_random is not None else None
    modes = [(m, m.training) for m in model.modules()]
    params = [p for p in model.parameters()]
    grads = [(p.grad, p.grad.detach().clone() if p.grad is not None else None) for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    noise = _without_noise(model)
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for module, name, value in noise:
            setattr(module, name, value)
        with torch.no_grad():
            for p, (grad, saved) in zip(params, grads):
                if grad is not None:
                    grad.copy_(saved)
                p.grad = grad
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for m, mode in modes:
            m.training = mode
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        if numpy_rng is not None:
            numpy_random.set_state(numpy_rng)


def _without_noise(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, float]]:
    """Turn off what ``model`` draws at random in training mode, keeping gradient checkpointing: every
    module that neither checkpoints (a ``gradient_checkpointing`` attribute: decoder layers and stacks)
    nor contains one that does goes to eval mode (dropout, sampled expert routing), and the modules that
    stay in training mode get their positive float ``*dropout*``, ``*layerdrop*``, ``*jitter*`` attributes
    set to 0 (functional dropout, layer drop). Returns the ``(module, attribute, value)`` it zeroed."""
    checkpointing = [name for name, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]
    kept = {name.rsplit(".", depth)[0] for name in checkpointing for depth in range(name.count(".") + 1)}
    kept |= {""} | set(checkpointing)
    zeroed = []
    for name, module in model.named_modules():
        if name not in kept:
            module.training = False
            continue
        for attribute, value in vars(module).items():
            if _NOISE_ATTRIBUTE.search(attribute) and isinstance(value, float) and value > 0:
                zeroed.append((module, attribute, value))
    for module, attribute, _ in zeroed:
        setattr(module, attribute, 0.0)
    return zeroed
