"""Leave a model as it was: gradients, buffers, training modes and every random generator."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch


def _numpy_random():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Run the body with dropout off and no gradients on the parameters; afterwards restore, bit for bit,
    each parameter's gradient (the same tensor object, its values copied back in case backward wrote
    into shared storage, as DDP's bucket views do), the buffers, each module's training mode, and the
    torch CPU and CUDA, Python and NumPy random states."""
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
    try:
        for m in model.modules():
            if isinstance(m, torch.nn.modules.dropout._DropoutNd):
                m.eval()
        for p in params:
            p.grad = None
        yield
    finally:
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
