"""Sequence sharding: global label shift, padding, contiguous slices, global positions, the group's loss
(the fused chunked cross-entropy itself is in ``fused_loss``).

Every rank of a sequence-parallel group of ``P`` ranks holds the same full batch of length ``N``.
The sequence is right-padded to ``N_pad`` (a multiple of ``P``) and rank ``r`` keeps tokens
``[r * N_pad / P, (r + 1) * N_pad / P)``. Labels are shifted globally *before* slicing, so the
token at a shard's last position predicts the first token of the next shard, and padding gets
label ``-100``: exact, because under causal attention no real token sees a later pad.

The loss of a group is ``sum of its token losses / denominator`` where the sum is all-reduced
through a differentiable all-reduce (its backward all-reduces the gradient too). Every rank of a
group then holds the same loss, and the gradients of the ``P`` replicas add up to ``P`` times the
gradient of that loss, so the data-parallel *average* over all ``P * D`` ranks (what DDP and
FSDP do) is the gradient of the mean of the ``D`` group losses: with one group, exactly the
full-sequence gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._values import is_positive_int
from .fused_loss import IGNORE_INDEX, chunked_loss_sum

__all__ = [
    "IGNORE_INDEX", "SequenceShard", "chunked_loss_sum", "gather_sequence", "global_position_ids",
    "group_sum", "num_loss_tokens", "pad_to_multiple", "sequence_parallel_loss", "shard_for", "shift_labels",
    "take_shard",
]


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's slice lies: tokens ``[start, end)`` of the padded length ``padded_len``."""

    rank: int
    world: int
    seq_len: int
    padded_len: int

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world

    @property
    def start(self) -> int:
        return self.rank * self.local_len

    @property
    def end(self) -> int:
        return self.start + self.local_len

    @property
    def real_end(self) -> int:
        """End of the slice without the right padding."""
        return min(self.end, self.seq_len)


def shard_for(seq_len: int, rank: int, world: int) -> SequenceShard:
    """The slice of rank ``rank`` of ``world`` for a sequence of ``seq_len`` tokens."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world} ranks.")
    padded = -(-seq_len // world) * world
    return SequenceShard(rank, world, seq_len, padded)


def pad_to_multiple(x: torch.Tensor, multiple: int, *, dim: int = 1, value: float = 0) -> torch.Tensor:
    """Right-pad ``x`` along ``dim`` with ``value`` to a length that is a multiple of ``multiple``."""
    if not is_positive_int(multiple):
        raise ValueError(f"multiple must be a positive int (the group size); got {multiple!r}.")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is not a dimension of x, of shape {tuple(x.shape)}; the sequence is "
                         "dim 1 of (batch, seq, ...) rows: add a batch dimension (x[None]) or pass dim=0.")
    n = x.shape[dim]
    extra = -n % multiple
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Global shift along dim 1: ``out[:, t] = labels[:, t + 1]``, the last position ``ignore_index``."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be 2-D (batch, length) like input_ids; got shape "
                         f"{tuple(labels.shape)}.")
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def take_shard(x: torch.Tensor, shard: SequenceShard, *, dim: int = 1, value: float = 0) -> torch.Tensor:
    """Pad ``x`` (full length along ``dim``) to ``shard.padded_len`` and return this rank's slice."""
    if x.shape[dim] != shard.seq_len:
        raise ValueError(f"expected length {shard.seq_len} along dim {dim}, got {x.shape[dim]}.")
    return pad_to_multiple(x, shard.world, dim=dim, value=value).narrow(dim, shard.start, shard.local_len)


def _counting_positions(position_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``position_ids`` as ``(rows, seq_len)``; ValueError unless they count up by one along each row."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] != seq_len:
        raise ValueError(f"position_ids have length {position_ids.shape[-1]} but the inputs have {seq_len} "
                         "tokens.")
    if seq_len > 1 and not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError(
            "position_ids restart or skip inside a row, so the row holds packed documents: pass their "
            "segments (segments_from_hf reads them from position_ids) and shard the positions as they are "
            "with take_shard; global_position_ids is for plain rows counting up by one."
        )
    return position_ids


def global_position_ids(
    position_ids: torch.Tensor | None, batch: int, shard: SequenceShard, device: torch.device
) -> torch.Tensor:
    """This rank's slice of the global position ids of plain rows (``arange`` by default). The right
    padding repeats the last position: no real token sees a pad, and a learned position table (GPT-2's
    ``n_positions``) has a row for it even when the row fills the table.

    ``position_ids`` must count up by one along each row (an offset start is fine). Packed rows, whose
    positions restart at every document, take another path: :func:`~lightseq_hf.parallel.segments.
    segments_from_hf` reads their documents from the positions, and the model patch shards the positions as
    they are (:func:`take_shard`).
    """
    if position_ids is None:
        position_ids = torch.arange(shard.seq_len, device=device).unsqueeze(0)
    else:
        position_ids = _counting_positions(position_ids, shard.seq_len)
    extra = shard.padded_len - shard.seq_len
    if extra:
        position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(-1, extra)], dim=-1)
    return position_ids[:, shard.start:shard.end].expand(batch, -1)


def num_loss_tokens(shifted_labels: torch.Tensor) -> torch.Tensor:
    """How many (already shifted) labels are not ``-100``: the per-group loss denominator.

    A tensor on the labels' device, so computing the loss never waits on the host.
    """
    return (shifted_labels != IGNORE_INDEX).sum()


class _GatherSequence(torch.autograd.Function):
    """All-gather this rank's slice along dim 1; backward: this rank's slice of the group-summed gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, shard: SequenceShard) -> torch.Tensor:
        ctx.group, ctx.shard = group, shard
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(shard.world)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)[:, :shard.seq_len].contiguous()  # clients .view() it

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard = ctx.shard
        grad = pad_to_multiple(grad.contiguous(), shard.world, dim=1)
        # sequence-major and contiguous: rank r's slice is rows [r * local_len, (r + 1) * local_len).
        # NCCL reads and writes raw row-major memory, so neither side may be a permuted view.
        by_position = grad.movedim(1, 0).contiguous()
        mine = torch.empty((shard.local_len, *by_position.shape[1:]), dtype=grad.dtype, device=grad.device)
        try:
            dist.reduce_scatter_tensor(mine, by_position, group=ctx.group)
        except RuntimeError as err:  # a backend without reduce-scatter (older gloo): sum all, keep ours
            if "support" not in str(err).lower():
                raise
            grad = grad.clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
            return grad.narrow(1, shard.start, shard.local_len).contiguous(), None, None
        return mine.movedim(0, 1).contiguous(), None, None


def gather_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None, shard: SequenceShard
) -> torch.Tensor:
    """This rank's slice ``x`` (``(batch, shard.local_len, ...)``) -> the whole sequence, without padding.

    Differentiable: the backward sums the gradients of the group's ranks (each rank holds the
    whole sequence and runs the same head and loss on it) and keeps this rank's slice, so the
    gradients of the ``P`` replicas add up to ``P`` times the full-sequence gradient, the same
    convention as :func:`sequence_parallel_loss`; the data-parallel average makes it exact.
    """
    if x.shape[1] != shard.local_len:
        raise ValueError(f"expected a slice of {shard.local_len} tokens along dim 1, got {x.shape[1]}.")
    if shard.world == 1:
        return x[:, :shard.seq_len]
    return _GatherSequence.apply(x, group, shard)


class _GroupSum(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces (sums) the incoming gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def group_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable sum over ``group``; its backward sums the gradients over the group too.

    With no process group (or a group of one) it returns ``x``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    return _GroupSum.apply(x, group)


def sequence_parallel_loss(
    local_sum: torch.Tensor,
    num_tokens: int | torch.Tensor,
    group: dist.ProcessGroup | None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The group's loss: all-reduced token-loss sum / (``num_items_in_batch`` or the group's token count).

    ``num_items_in_batch`` has the Trainer's meaning: the model divides the summed loss of the
    tokens it holds (for us: its sequence-parallel group's) by it, so gradient accumulation and
    ``average_tokens_across_devices`` stay exact.
    """
    total = group_sum(local_sum, group)
    if num_items_in_batch is None:
        return total / num_tokens
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
