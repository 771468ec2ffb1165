"""DistFlashAttn forward and backward loops over a schedule.

Each rank holds its contiguous chunk of q, k, v. The loops walk the schedule's steps;
before computing step ``t`` they post the transfers for step ``t + 1`` (prefetch) and
ship the partial results of step ``t - 1`` to their owners, so at most one remote
key/value (or query) chunk and one prefetch buffer are alive at a time. A task moves only
the query rows it computes and the keys they see (``task.rows``, ``task.keys``: packed
documents need a part of a chunk), and the gradients of those keys come back.

Forward keeps a float32 running (out, lse) per rank, which the local kernel updates in
place for the rank's own query rows; a helper computes a partial result and sends it
back (out in the input dtype, lse in float32), where it is merged in float32. Backward
mirrors the forward: whoever computed a block computes its gradient, dq goes to the
query owner and dk/dv to the key owner (in the input dtype), all accumulated in float32.
The query side of a backward task is q, dout, the lse and delta = rowsum(dout * out) (one
number per row and head); a kernel that takes the output rows instead of delta (SDPA) gets,
for another rank's rows, a stand-in with the same row sums (:func:`stand_in_output`), so the
output rows themselves never travel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.base import AttentionKernel, AttentionMask, DocBlocks, KeyRange
from ..kernels.row_stats import attention_delta, stand_in_output
from .comm import PeerComm, Transfers
from .merge import empty_running, merge_into
from .schedule import Schedule, SpanTask, Task
from .segments import local_key_range

__all__ = ["TaskMasks", "dist_attn_backward", "dist_attn_forward", "lse_folded_delta"]

_Bundle = dict[str, torch.Tensor]
#: ``task -> DocBlocks``: the documents of a task as blocks, for kernels with ``supports_doc_blocks``.
_BlocksOf = Callable[[SpanTask], DocBlocks]


@dataclass(frozen=True)
class TaskMasks:
    """How the mask of every task reaches the kernel: plain rows (causal on diagonal tasks), or the key
    range of the task's rows cut from the global ``ranges`` ``(lo, hi)`` ``(batch, seq)``, or the task's
    document blocks (``blocks_of``); with the ``window`` the ranges encode and the ``softcap``."""

    ranges: KeyRange | None = None
    blocks_of: _BlocksOf | None = None
    window: int | None = None
    softcap: float | None = None

    def for_task(self, task: Task | SpanTask, chunk: int) -> AttentionMask:
        if self.blocks_of is not None:
            return AttentionMask(doc_blocks=self.blocks_of(task), softcap=self.softcap)
        if self.ranges is None:
            return AttentionMask(causal=task.diagonal, softcap=self.softcap)
        start, stop = task.rows(chunk)
        rows = slice(task.q_owner * chunk + start, task.q_owner * chunk + stop)
        lo, hi = self.ranges
        key_start, key_stop = task.keys(chunk)
        key_range = local_key_range(lo[:, rows], hi[:, rows], task.kv_owner * chunk + key_start,
                                    key_stop - key_start)
        return AttentionMask(key_range=key_range, window=self.window, softcap=self.softcap)


def _rows(t: torch.Tensor, task: Task, seq_dim: int) -> torch.Tensor:
    start, stop = task.rows(t.shape[seq_dim])
    return t.narrow(seq_dim, start, stop - start)


def _keys(t: torch.Tensor, task: Task) -> torch.Tensor:
    """The keys of ``t`` (``(batch, seq, heads, dim)``) that ``task`` reads."""
    start, stop = task.keys(t.shape[1])
    return t.narrow(1, start, stop - start)


def _buffer_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)


def _run_steps(
    comm: PeerComm,
    num_steps: int,
    plan_inputs: Callable[[int], tuple[Transfers, Any]],
    compute: Callable[[int, Any], Any],
    plan_results: Callable[[int, Any], tuple[Transfers, list[Callable[[], None]]]],
) -> None:
    """Drive the steps: prefetch step t+1 and ship step t-1's results while computing t."""
    transfers, inputs = plan_inputs(0)
    if transfers:
        raise AssertionError("step 0 of a schedule must be local")
    pending, next_inputs, on_arrival, produced = None, None, [], None
    for t in range(num_steps):
        if t > 0:
            pending.wait()
            for merge in on_arrival:
                merge()
            inputs = next_inputs
        transfers, next_inputs, on_arrival = Transfers(), None, []
        if t + 1 < num_steps:
            tr, next_inputs = plan_inputs(t + 1)
            transfers.sends += tr.sends
            transfers.recvs += tr.recvs
        if t > 0:
            tr, on_arrival = plan_results(t - 1, produced)
            transfers.sends += tr.sends
            transfers.recvs += tr.recvs
        pending = comm.post(transfers)
        produced = compute(t, inputs)
    pending.wait()
    for merge in on_arrival:
        merge()
    tr, on_arrival = plan_results(num_steps - 1, produced)
    comm.post(tr).wait()
    for merge in on_arrival:
        merge()


def _plan_fetch(
    schedule: Schedule,
    t: int,
    rank: int,
    q_rows: Callable[[Task], _Bundle],
    kv_side: _Bundle,
) -> tuple[Transfers, tuple[Task | None, _Bundle, _Bundle]]:
    """Transfers bringing step ``t``'s query-side and key-side tensors to whoever computes.

    ``q_rows(task)`` gives views of this rank's query-side tensors for the task's rows, ``kv_side`` this
    rank's keys and values (the task's keys are cut from them); sent and locally used rows are made
    contiguous, received ones land in fresh contiguous buffers.
    """

    def q_side(task: Task) -> _Bundle:
        return {name: x.contiguous() for name, x in q_rows(task).items()}

    def kv_rows(task: Task) -> _Bundle:
        return {name: _keys(x, task) for name, x in kv_side.items()}

    step = schedule.steps[t]
    transfers = Transfers()
    for peer, task in enumerate(step):
        if peer == rank or task is None:
            continue
        if task.q_owner == rank:
            transfers.sends += [(peer, x) for x in q_side(task).values()]
        if task.kv_owner == rank:
            transfers.sends += [(peer, x.contiguous()) for x in kv_rows(task).values()]
    task = step[rank]
    q_in: _Bundle = {}
    kv_in: _Bundle = kv_side
    if task is not None:
        if task.q_owner != rank:
            q_in = {name: _buffer_like(x) for name, x in q_rows(task).items()}
            transfers.recvs += [(task.q_owner, x) for x in q_in.values()]
        else:
            q_in = q_side(task)
        if task.kv_owner != rank:
            kv_in = {name: _buffer_like(x) for name, x in kv_rows(task).items()}
            transfers.recvs += [(task.kv_owner, x) for x in kv_in.values()]
        else:
            kv_in = kv_rows(task)
    return transfers, (task, q_in, kv_in)


def dist_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    schedule: Schedule,
    rank: int,
    comm: PeerComm,
    kernel: AttentionKernel,
    masks: TaskMasks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule loop of the forward: this rank's (out in q.dtype, lse float32) of attention over the
    whole sequence. ``masks``: how each task's mask reaches ``kernel`` (packed documents, padding and
    windows come with a schedule built from the same segments)."""
    out, lse = empty_running(q, v.shape[-1])
    chunk = q.shape[1]
    # The first task on this rank's own rows may copy its result instead of merging it into the empty
    # running (out, lse) when it covers every row (kernels that merge in place keep their float32
    # accumulate mode; a separate merge pass would cost more than the copy).
    own = [s[rank] for s in schedule.steps if s[rank] is not None and s[rank].q_owner == rank]
    copy_first = (own[0] if own and own[0].rows(chunk) == (0, chunk)
                  and not kernel.capabilities.merges_in_kernel else None)

    def q_rows(task: Task) -> _Bundle:
        return {"q": _rows(q, task, 1)}

    def plan_inputs(t: int):
        return _plan_fetch(schedule, t, rank, q_rows, {"k": k, "v": v})

    def compute(t: int, inputs) -> _Bundle | None:
        task, q_in, kv_in = inputs
        if task is None:
            return None
        qt, kt, vt = q_in["q"], kv_in["k"], kv_in["v"]
        mask = masks.for_task(task, chunk)
        if task.q_owner == rank:
            if task is copy_first:
                part_out, part_lse = kernel.forward(qt, kt, vt, scale=scale, mask=mask)
                out.copy_(part_out)
                lse.copy_(part_lse)
            else:
                kernel.forward(qt, kt, vt, scale=scale, mask=mask, out=_rows(out, task, 1),
                               lse=_rows(lse, task, 2))
            return None
        # A helper's partial result travels in the input dtype (lse in the running precision) and is
        # merged in float32 by the query owner.
        part_out, part_lse = kernel.forward(qt, kt, vt, scale=scale, mask=mask)
        return {"out": part_out.to(q.dtype), "lse": part_lse.to(lse.dtype)}

    def plan_results(t: int, produced: _Bundle | None):
        transfers, merges = Transfers(), []
        step = schedule.steps[t]
        mine = step[rank]
        if mine is not None and mine.q_owner != rank:
            transfers.sends += [(mine.q_owner, produced["out"]), (mine.q_owner, produced["lse"])]
        for peer, task in enumerate(step):
            if peer != rank and task is not None and task.q_owner == rank:
                rows_out, rows_lse = _rows(out, task, 1), _rows(lse, task, 2)
                buf_out, buf_lse = _buffer_like(rows_out, q.dtype), _buffer_like(rows_lse)
                transfers.recvs += [(peer, buf_out), (peer, buf_lse)]
                merges.append(lambda o=rows_out, s=rows_lse, bo=buf_out, bs=buf_lse: merge_into(o, s, bo, bs))
        return transfers, merges

    _run_steps(comm, len(schedule.steps), plan_inputs, compute, plan_results)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def _plan_gradients(
    schedule: Schedule,
    t: int,
    rank: int,
    produced: _Bundle | None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
) -> tuple[Transfers, list[Callable[[], None]]]:
    """Transfers of step ``t``'s gradients: this rank's partial dq/dk/dv of another's rows or keys go out
    (``produced``), the partials of its own come in (in the input ``dtypes``) and are added into the float32
    ``grads`` on arrival."""
    dq, dk, dv = grads
    transfers, merges = Transfers(), []
    step = schedule.steps[t]
    mine = step[rank]
    if mine is not None:
        if mine.q_owner != rank:
            transfers.sends.append((mine.q_owner, produced["dq"]))
        if mine.kv_owner != rank:
            transfers.sends += [(mine.kv_owner, produced["dk"]), (mine.kv_owner, produced["dv"])]
    for peer, task in enumerate(step):
        if peer == rank or task is None:
            continue
        if task.q_owner == rank:
            target = _rows(dq, task, 1)
            buf = _buffer_like(target, dtypes[0])
            transfers.recvs.append((peer, buf))
            merges.append(lambda x=target, b=buf: x.add_(b))
        if task.kv_owner == rank:
            keys_k, keys_v = _keys(dk, task), _keys(dv, task)
            bk, bv = _buffer_like(keys_k, dtypes[1]), _buffer_like(keys_v, dtypes[2])
            transfers.recvs += [(peer, bk), (peer, bv)]
            merges.append(lambda x=keys_k, b=bk: x.add_(b))
            merges.append(lambda x=keys_v, b=bv: x.add_(b))
    return transfers, merges


def lse_folded_delta(kernel: AttentionKernel, dout: torch.Tensor, out: torch.Tensor,
                     dlse: torch.Tensor | None) -> torch.Tensor:
    """The backward's row sums ``delta = rowsum(dout * out)``, with a gradient ``dlse`` of the lse folded in:
    d lse_i / d s_ij = p_ij, so the score gradient p * (dp - delta) becomes p * (dp - (delta - dlse)).
    ValueError for ``dlse`` with a kernel whose backward recomputes delta from ``out``."""
    if dlse is not None and kernel.capabilities.needs_out_in_backward:
        raise ValueError(
            f"backend {kernel.name!r} cannot back-propagate through the returned lse; use "
            "backend='triton' or 'reference', or do not use the lse in the loss."
        )
    delta = attention_delta(dout, out)
    return delta if dlse is None else delta - dlse.to(delta.dtype)


def dist_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    dlse: torch.Tensor | None = None,
    scale: float,
    schedule: Schedule,
    rank: int,
    comm: PeerComm,
    kernel: AttentionKernel,
    masks: TaskMasks,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The schedule loop of the backward: this rank's (dq, dk, dv) in the input dtype; ``out``/``lse`` are
    this rank's global results.

    A gradient ``dlse`` of the lse folds into delta (:func:`lse_folded_delta`).
    """
    needs_out = kernel.capabilities.needs_out_in_backward
    delta = lse_folded_delta(kernel, dout, out, dlse)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dout = dout.contiguous()
    chunk = q.shape[1]

    def q_rows(task: Task) -> _Bundle:
        return {
            "q": _rows(q, task, 1),
            "dout": _rows(dout, task, 1),
            "lse": _rows(lse, task, 2),
            "delta": _rows(delta, task, 2),
        }

    def plan_inputs(t: int):
        return _plan_fetch(schedule, t, rank, q_rows, {"k": k, "v": v})

    def compute(t: int, inputs) -> _Bundle | None:
        task, q_in, kv_in = inputs
        if task is None:
            return None
        own_q, own_kv = task.q_owner == rank, task.kv_owner == rank
        row_out, row_delta = None, q_in["delta"]
        if needs_out:  # kernels that cannot take delta (SDPA) get output rows with the same row sums
            row_out = _rows(out, task, 1) if own_q else stand_in_output(q_in["dout"], row_delta)
            row_delta = None
        grads = kernel.backward(
            q_in["dout"], q_in["q"], kv_in["k"], kv_in["v"], row_out, q_in["lse"],
            scale=scale, mask=masks.for_task(task, chunk), delta=row_delta,
            dq=_rows(dq, task, 1) if own_q else None,
            dk=_keys(dk, task) if own_kv else None,
            dv=_keys(dv, task) if own_kv else None,
        )
        # gradients for another rank travel in the input dtype and are added in float32 there
        return {
            "dq": None if own_q else grads[0].to(q.dtype),
            "dk": None if own_kv else grads[1].to(k.dtype),
            "dv": None if own_kv else grads[2].to(v.dtype),
        }

    def plan_results(t: int, produced: _Bundle | None):
        return _plan_gradients(schedule, t, rank, produced, (dq, dk, dv), (q.dtype, k.dtype, v.dtype))

    _run_steps(comm, len(schedule.steps), plan_inputs, compute, plan_results)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
