"""What ours is compared with, and the attention runners the timings call.

- :func:`torch_context_parallel`: torch's ``context_parallel`` (ring attention over SDPA cuDNN, math on
  the CPU, head-tail load balancing) around a block; :func:`cp_inputs` its attention inputs.
- :func:`allgather_varlen`: the all-gather varlen ring of ring-flash-attention's ``llama3`` mode and
  torchtitan: every rank all-gathers all keys/values, attends its queries with a kernel taking per-row
  key ranges, and reduce-scatters dk/dv.
- :func:`ours`, :func:`fwd_bwd`, :func:`forward_only`: ``attn(q, k, v)`` callables and the closures
  that time them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import lightseq_hf
from lightseq_hf.kernels import AttentionMask, get_kernel
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ours(**kwargs) -> Attention:
    """``attn(q, k, v)``: ``lightseq_hf.dist_flash_attn`` with ``kwargs``."""
    return lambda q, k, v: lightseq_hf.dist_flash_attn(q, k, v, **kwargs)


def fwd_bwd(attn: Attention, q, k, v, dout) -> Callable[[], None]:
    """One forward+backward of ``attn(q, k, v)``; gradients dropped."""

    def run():
        attn(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    return run


def forward_only(attn: Attention, q, k, v) -> Callable[[], None]:
    """One forward of ``attn(q, k, v)`` without autograd."""

    def run():
        with torch.no_grad():
            attn(q, k, v)

    return run


@contextmanager
def torch_context_parallel(buffers: list[torch.Tensor], seq_dims: list[int], device: torch.device,
                           rotate: str | None = None) -> Iterator[None]:
    """Inside the block, SDPA over ``buffers`` (sharded head-tail along ``seq_dims`` over the world,
    not restored afterwards) is torch's ring attention on the cuDNN kernel (math on the CPU);
    ``rotate``: its key/value rotation (``"allgather"`` or ``"alltoall"``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if rotate is not None:
        set_rotate_method(rotate)
    kernel = SDPBackend.CUDNN_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    with sdpa_kernel(kernel), context_parallel(
        mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers)
    ):
        yield


def cp_inputs(n: int, h: int, hk: int, d: int, device: torch.device,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 ``(1, heads, n, d)`` query, key and value of one causal sequence for torch's ring, whose
    attention needs equal head counts: GQA key/value heads are repeated to ``h``."""
    q = torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16, generator=generator)
    k = torch.randn(1, hk, n, d, device=device, dtype=torch.bfloat16, generator=generator)
    v = torch.randn(1, hk, n, d, device=device, dtype=torch.bfloat16, generator=generator)
    return q, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)


class AllGatherVarlen(torch.autograd.Function):
    """The all-gather varlen ring: all keys/values gathered on every rank, dk/dv reduce-scattered."""

    @staticmethod
    def forward(ctx, q, k, v, key_range, kernel, scale):
        world = dist.get_world_size()
        k_all = torch.cat(_all_gather(k, world), dim=1)
        v_all = torch.cat(_all_gather(v, world), dim=1)
        mask = AttentionMask(key_range=key_range)
        out, lse = kernel.forward(q, k_all, v_all, scale=scale, mask=mask)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.kernel, ctx.scale, ctx.mask = kernel, scale, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        dq, dk_all, dv_all = ctx.kernel.backward(dout.contiguous(), q, k_all, v_all, out, lse,
                                                 scale=ctx.scale, mask=ctx.mask)
        world = dist.get_world_size()
        dk, dv = _reduce_scatter(dk_all, world), _reduce_scatter(dv_all, world)
        return dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None, None, None


def _all_gather(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return parts


def _reduce_scatter(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(world, dim=1)]
    if dist.get_backend() == "nccl":
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts)
        return mine
    for p in parts:  # gloo has no reduce_scatter: all-reduce, keep this rank's part
        dist.all_reduce(p)
    return parts[dist.get_rank()]


def allgather_varlen(segments: Segments, backend: str, device: torch.device) -> Attention:
    """``attn(q, k, v)`` of the all-gather varlen baseline for ``segments`` (this rank's query rows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = key_ranges(segments, causal=True, device=device)

    def attn(q, k, v):
        n = q.shape[1]
        rows = slice(rank * n, (rank + 1) * n)
        rng = local_key_range(lo[:, rows], hi[:, rows], 0, n * world)
        kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1])
        return AllGatherVarlen.apply(q, k, v, rng, kernel, q.shape[-1] ** -0.5)

    return attn
