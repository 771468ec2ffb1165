"""DistFlashAttn as torch custom ops, so that checkpoint policies can recognise it.

``torch.ops.lightseq_hf.dist_attn_fwd`` computes this rank's (out, lse);
``torch.ops.lightseq_hf.dist_attn_bwd`` its gradients. Process groups cannot be op
arguments, so they travel as their registered names (:func:`group_handle`), which
``torch.distributed`` resolves back to the group inside the op. A name is computed from the group
object alone, so ``torch.compile`` traces it as a constant (an index into a Python list appended
to while tracing was not yet filled when the compiled graph first ran).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import AttentionKernel, kernel_named
from .comm import PeerComm
from .dist_attn import TaskMasks, dist_attn_backward, dist_attn_forward, lse_folded_delta
from .doc_blocks import task_doc_blocks
from .schedule import Schedule, SpanTask, build_schedule
from .segment_schedule import build_segment_schedule
from .segments import key_ranges
from .sequence_mask import OpMaskArgs, SequenceMask

__all__ = [
    "BACKWARD_CHUNK_BYTES", "backward_chunks", "dist_attn_bwd", "dist_attn_fwd", "group_handle",
    "group_rank_and_size", "release_comms",
]

_comms: dict[tuple[str, str], PeerComm] = {}

#: The distributed backward runs over groups of heads, one after the other, so that its float32
#: dq/dk/dv accumulators and the ring's key/value buffers and gradient partials exist for one group
#: at a time: the fewest groups (a divisor of the key/value heads) whose float32 dq is at most this.
#: Heads are independent, so the result is the same; at 64K tokens per rank and 32 x 128 query
#: dims (1 GiB) there is one group.
BACKWARD_CHUNK_BYTES = 2**30


def backward_chunks(query_elements: int, kv_heads: int, limit: int | None = None) -> int:
    """Head groups of the distributed backward for a local query of ``query_elements`` numbers
    (batch x tokens x heads x head dim) with ``kv_heads`` key/value heads."""
    limit = BACKWARD_CHUNK_BYTES if limit is None else limit
    accumulator = query_elements * 4
    for chunks in range(1, kv_heads + 1):
        if kv_heads % chunks == 0 and accumulator <= limit * chunks:
            return chunks
    return kv_heads


def group_handle(group: dist.ProcessGroup | None) -> str:
    """The name standing for ``group`` (``None``: the default group) in op arguments.

    ``""`` without torch.distributed (a single process).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return (group if group is not None else dist.group.WORLD).group_name


def _resolve(handle: str) -> dist.ProcessGroup | None:
    if not handle:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(handle)


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in ``group``; (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _context(handle: str, device: torch.device) -> tuple[int, int, PeerComm]:
    group = _resolve(handle)
    rank, world = group_rank_and_size(group)
    key = (handle, str(device))
    if key not in _comms or _comms[key].group is not group:  # a name reused by a re-created group
        _comms[key] = PeerComm(group, device)
    return rank, world, _comms[key]


def release_comms() -> int:
    """Drop the cached :class:`PeerComm` objects and the groups they hold (at exit: see ``teardown``);
    how many there were."""
    held = len(_comms)
    _comms.clear()
    return held


def _plan(world: int, mask: SequenceMask, schedule: str,
          device: torch.device) -> tuple[Schedule, tuple[torch.Tensor, torch.Tensor] | None]:
    """The schedule and (for packed documents or a window) the global key ranges on ``device``."""
    if mask.segments is None:
        return build_schedule(world, mask.causal, schedule), None
    ranges = key_ranges(mask.segments, causal=mask.causal, window=mask.window, device=device)
    return build_segment_schedule(world, mask.segments, mask.causal, mask.window), ranges


def _task_masks(kernel: AttentionKernel, mask: SequenceMask, ranges: tuple[torch.Tensor, torch.Tensor] | None,
                chunk: int, device: torch.device) -> TaskMasks:
    """How each task's mask reaches ``kernel``: document blocks for kernels taking them (packed rows
    without a window), else the global key ``ranges`` (None for plain rows). The backend was chosen for
    this mask (``select_backend``), so one of the two fits."""
    seg, causal = mask.segments, mask.causal
    if seg is not None and mask.window is None and kernel.capabilities.supports_doc_blocks:
        return TaskMasks(blocks_of=lambda task: task_doc_blocks(seg, task, chunk, causal, device),
                         softcap=mask.softcap)
    return TaskMasks(ranges=ranges, window=mask.window, softcap=mask.softcap)


def _setup(q, group, schedule, backend, mask_args: OpMaskArgs):
    """The kernel, this rank's place, the schedule, the call's mask (decoded from the op arguments, once)
    and the task masks of one op call."""
    mask = SequenceMask.from_op_args(*mask_args)
    kernel = kernel_named(backend)
    rank, world, comm = _context(group, q.device)
    plan, ranges = _plan(world, mask, schedule, q.device)
    masks = _task_masks(kernel, mask, ranges, q.shape[1], q.device)
    return kernel, rank, world, comm, plan, mask, masks


def _whole(q: torch.Tensor, causal: bool) -> SpanTask:
    """The single task of a group of one: every row against every key."""
    return SpanTask(0, 0, 0, q.shape[1], 0, diagonal=causal)


@torch.library.custom_op("lightseq_hf::dist_attn_fwd", mutates_args=())
def dist_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    group: str,
    schedule: str,
    backend: str,
    causal: bool,
    segments: list[int],
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (out, lse); ``backend`` is the registered backend :func:`select_backend` chose; the last
    four arguments are the call's mask (:meth:`SequenceMask.op_args`)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kernel, rank, world, comm, plan, mask, masks = _setup(q, group, schedule, backend,
                                                          (causal, segments, window, softcap))
    if world == 1:
        return kernel.forward(q, k, v, scale=scale, mask=masks.for_task(_whole(q, mask.causal), q.shape[1]))
    return dist_attn_forward(q, k, v, scale=scale, schedule=plan, rank=rank, comm=comm, kernel=kernel,
                             masks=masks)


@dist_attn_fwd.register_fake
def _(q, k, v, scale, group, schedule, backend, causal, segments, window, softcap):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=lse_dtype)


@torch.library.custom_op("lightseq_hf::dist_attn_bwd", mutates_args=())
def dist_attn_bwd(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    group: str,
    schedule: str,
    backend: str,
    causal: bool,
    segments: list[int],
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # autograd saved the caller's q/k/v, which may be views (transposes, slices): k and v are sent
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    kernel, rank, world, comm, plan, _, masks = _setup(q, group, schedule, backend,
                                                       (causal, segments, window, softcap))

    def backward(dout, q, k, v, out, lse, dlse):
        if world == 1:
            return _one_rank_backward(kernel, dout, q, k, v, out, lse, dlse, scale,
                                      masks.for_task(_whole(q, causal), q.shape[1]))
        return dist_attn_backward(dout, q, k, v, out, lse, dlse=dlse, scale=scale, schedule=plan, rank=rank,
                                  comm=comm, kernel=kernel, masks=masks)

    # head groups bound what the backward holds at once: the ring's float32 accumulators, or on one rank
    # the kernel's own gradients and workspace (at 64K tokens and 32 x 128 query dims, one group)
    chunks = backward_chunks(q.numel(), k.shape[2])
    if chunks == 1:
        return backward(dout, q, k, v, out, lse, dlse)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    q_per, kv_per = q.shape[2] // chunks, k.shape[2] // chunks
    for c in range(chunks):
        qh, kvh = slice(c * q_per, (c + 1) * q_per), slice(c * kv_per, (c + 1) * kv_per)
        part = backward(*(t[:, :, qh].contiguous() for t in (dout, q)),
                        *(t[:, :, kvh].contiguous() for t in (k, v)), out[:, :, qh].contiguous(),
                        lse[:, qh].contiguous(), None if dlse is None else dlse[:, qh].contiguous())
        for full, piece, heads in zip(grads, part, (qh, kvh, kvh)):
            full[:, :, heads] = piece
    return grads


def _one_rank_backward(kernel: AttentionKernel, dout, q, k, v, out, lse, dlse, scale: float,
                       mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group of one: the kernel's own backward over every row and key (no accumulators), the gradients in
    the input dtype. A gradient ``dlse`` of the lse folds into delta (:func:`lse_folded_delta`)."""
    delta = None if dlse is None else lse_folded_delta(kernel, dout, out, dlse)
    grads = kernel.backward(dout, q, k, v, out, lse, scale=scale, mask=mask, delta=delta)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


@dist_attn_bwd.register_fake
def _(dout, dlse, q, k, v, out, lse, scale, group, schedule, backend, causal, segments, window, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)  # scale, group, schedule, backend and the mask's op arguments
    ctx.set_materialize_grads(False)  # an unused lse gets no (zero) gradient tensor


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = dist_attn_bwd(dout.contiguous(), dlse, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


dist_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
