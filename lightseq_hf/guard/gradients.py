"""Gradient synchronisation for hand-written loops, and cheap gradient fingerprints.

With sequence parallelism each rank's backward gives its share of the gradient: the patched loss is
the group's token mean through a differentiable all-reduce, so the *average* over the ranks of a
sequence-parallel group is the gradient of the whole sequence, and the average over every rank (the
data-parallel groups too) the gradient of the global batch. DDP and FSDP take exactly that average;
a loop without them must call :func:`sync_gradients` after ``backward()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._values import check_group

__all__ = ["SKETCH_DIM", "gradient_sketch", "is_sharded_gradient", "sync_gradients"]

#: random projections per parameter in a gradient sketch
SKETCH_DIM = 8
_BUCKET_BYTES = 64 * 2**20
_SKETCH_ROWS = 4096


def is_sharded_gradient(grad: torch.Tensor | None) -> bool:
    """A gradient that is one rank's shard (FSDP2's DTensor)."""
    return grad is not None and type(grad).__name__ == "DTensor"


def sync_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter's gradient over ``group`` (default: all ranks), as DDP does.

    Call it after ``loss.backward()`` and before ``optimizer.step()`` in a loop that does not wrap the
    model in DDP or FSDP (which already average): each rank of a sequence-parallel group holds only its
    share of the gradient until then. A gradient missing on some ranks counts as zeros there. A no-op
    without torch.distributed or on one rank.
    """
    check_group(group)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    if any(is_sharded_gradient(p.grad) for p in params):
        raise ValueError("the gradients are FSDP shards: FSDP averages them itself; do not call "
                         "lightseq_hf.sync_gradients on an FSDP model.")
    device = next((p.device for p in params), torch.device("cpu"))
    where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=where)
    dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
    for p, any_rank in zip(params, present.tolist()):
        if any_rank and p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size(group)
    buckets: dict[tuple, list[list[torch.Tensor]]] = {}
    for p in params:
        if p.grad is None:
            continue
        chain = buckets.setdefault((p.grad.dtype, p.grad.device), [[]])
        if sum(g.numel() * g.element_size() for g in chain[-1]) >= _BUCKET_BYTES:
            chain.append([])
        chain[-1].append(p.grad)
    for chain in buckets.values():
        for grads in chain:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)


def gradient_sketch(params: list[torch.Tensor], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``SKETCH_DIM`` random projections, norm) of each parameter's gradient (this rank's shard for FSDP),
    float64 on the CPU; zeros for a missing gradient.

    Projection ``k`` of a gradient ``G`` (viewed as rows x columns) is ``a_k^T G b_k`` with Gaussian
    ``a_k``, ``b_k`` drawn from ``seed`` and the parameter's index: linear in ``G``, and the mean square
    of the projections of a difference estimates its squared norm. Computed in float64, a few thousand
    rows at a time.
    """
    sketches, norms = [], []
    for index, param in enumerate(params):
        grad = param.grad
        if is_sharded_gradient(grad):
            grad = grad.to_local()
        if grad is None or grad.numel() == 0:
            sketches.append(torch.zeros(SKETCH_DIM, dtype=torch.float64))
            norms.append(torch.zeros((), dtype=torch.float64))
            continue
        matrix = grad.detach().reshape(grad.shape[0] if grad.dim() else 1, -1)
        gen = torch.Generator(device=matrix.device).manual_seed(seed * 1_000_003 + index)
        options = dict(generator=gen, device=matrix.device, dtype=torch.float64)
        left = torch.randn(SKETCH_DIM, matrix.shape[0], **options)
        right = torch.randn(matrix.shape[1], SKETCH_DIM, **options)
        rows = torch.zeros(SKETCH_DIM, matrix.shape[1], dtype=torch.float64, device=matrix.device)
        square = torch.zeros((), dtype=torch.float64, device=matrix.device)
        for start in range(0, matrix.shape[0], _SKETCH_ROWS):
            block = matrix[start:start + _SKETCH_ROWS].double()
            rows += left[:, start:start + _SKETCH_ROWS] @ block
            square += block.square().sum()
        sketches.append((rows * right.T).sum(-1).cpu())
        norms.append(square.sqrt().cpu())
    return torch.stack(sketches), torch.stack(norms)
