"""Sequence sharding: global label shift, padding, contiguous slices, global positions, the exact loss.

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

IGNORE_INDEX = -100


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


def global_position_ids(
    position_ids: torch.Tensor | None, batch: int, shard: SequenceShard, device: torch.device
) -> torch.Tensor:
    """This rank's slice of the global position ids (``arange`` by default; pads continue counting).

    ``position_ids`` must count up by one along the sequence (an offset start is fine); packed
    sequences (positions that restart) are refused.
    """
    if position_ids is None:
        return torch.arange(shard.start, shard.end, device=device).unsqueeze(0).expand(batch, -1)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] != shard.seq_len:
        raise ValueError(
            f"position_ids have length {position_ids.shape[-1]} but the inputs have {shard.seq_len} tokens."
        )
    if shard.seq_len > 1 and not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError(
            "position_ids restart or skip inside a sequence (packed sequences); lightseq_hf's sequence "
            "parallelism supports one contiguous sequence per row for now: pass position_ids=None or "
            "0..N-1 per row, and do not pack several documents into one row."
        )
    extra = shard.padded_len - shard.seq_len
    if extra:
        tail = position_ids[:, -1:] + torch.arange(1, extra + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=-1)
    return position_ids[:, shard.start:shard.end].expand(batch, -1)


def num_loss_tokens(shifted_labels: torch.Tensor) -> torch.Tensor:
    """How many (already shifted) labels are not ``-100``: the per-group loss denominator.

    A tensor on the labels' device, so computing the loss never waits on the host.
    """
    return (shifted_labels != IGNORE_INDEX).sum()


def _innermost(module: torch.nn.Module) -> torch.nn.Module:
    """The module that computes ``module``'s output, inside wrapper modules that only forward the call.

    Wrappers (FSDP1's ``FullyShardedDataParallel``, DDP, activation-checkpoint wrappers) keep the
    real module under ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module`` / ``module``; their
    own forward (unshard, hooks) must still run, so the call goes to the outer module and the forward
    is replaced on the inner one. FSDP2's ``fully_shard`` and PEFT's LoRA layers are not wrappers in
    this sense: the module itself (a subclass of ``nn.Linear``, or LoRA's ``Linear``) computes.
    """
    for _ in range(8):
        inner = None
        for name in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "module"):
            candidate = module._modules.get(name)
            if isinstance(candidate, torch.nn.Module) and len(module._modules) == 1:
                inner = candidate
                break
        if inner is None:
            return module
        module = inner
    return module


def _head_parameters(target: torch.nn.Module, probe: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad that the head's output depends on, as this forward call sees them.

    The module's own parameters first (under FSDP2 these are the unsharded parameters its
    pre-forward hook registered, the tensors whose gradients FSDP2 reduces). Only a head whose
    parameters are hidden from ``parameters()`` (FSDP1 with ``use_orig_params`` exposes views as
    plain attributes during forward) falls back to the leaves of the autograd graph of ``probe``.
    """
    own = [p for p in target.parameters() if p.requires_grad]
    if own or not probe.requires_grad:
        return own
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [probe.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            leaves.setdefault(id(variable), variable)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class _HeadCrossEntropySum(torch.autograd.Function):
    """Sum of cross-entropies of ``head_fn(hidden)``, a chunk of rows at a time, gradients made in forward.

    For every chunk the head runs once, the float32 log-softmax gradient of the chunk's logits is
    formed at once, and ``autograd.grad`` turns it into the chunk's gradients for the hidden rows
    and for the head's parameters (``params``: passed as inputs so that their gradients arrive in
    backward through the ordinary ``AccumulateGrad`` path, where DDP and FSDP hooks expect them).
    Backward only scales the stored gradients: no logits are kept, none recomputed, and no
    parameter (which FSDP may have re-sharded after the forward) is read again.
    """

    @staticmethod
    def forward(ctx, hidden, labels, head_fn, chunk_rows, *params):
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = labels.reshape(-1)
        need_h = ctx.needs_input_grad[0]
        need_p = [ctx.needs_input_grad[4 + i] for i in range(len(params))]
        wrt_params = [p for p, need in zip(params, need_p) if need]
        acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
        grad_h = torch.empty_like(flat) if need_h else None
        grad_p = [torch.zeros(p.shape, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32,
                              device=p.device) for p in wrt_params]
        total = torch.zeros((), dtype=acc, device=flat.device)
        for i in range(0, flat.shape[0], chunk_rows):
            y = targets[i:i + chunk_rows]
            h = flat[i:i + chunk_rows].detach().requires_grad_(need_h)
            with torch.enable_grad():
                logits = head_fn(h)
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, torch.zeros_like(y))
            wide = logits.detach().to(acc)
            lse = torch.logsumexp(wide, dim=-1)
            picked = wide.gather(1, safe_y[:, None]).squeeze(1)
            total = total + ((lse - picked) * valid).sum()
            wrt = ([h] if need_h else []) + wrt_params
            if wrt and logits.requires_grad:
                dlogits = torch.exp(wide - lse[:, None])
                dlogits.scatter_add_(1, safe_y[:, None], -torch.ones_like(lse)[:, None])
                dlogits = (dlogits * valid[:, None]).to(logits.dtype)
                grads = torch.autograd.grad(logits, wrt, dlogits, allow_unused=True)
                if need_h:
                    grad_h[i:i + chunk_rows] = grads[0] if grads[0] is not None else 0
                for acc_p, g in zip(grad_p, grads[int(need_h):]):
                    if g is not None:
                        acc_p += g
            del logits
        ctx.save_for_backward(grad_h.view(hidden.shape) if need_h else None, *grad_p)
        ctx.need_p = need_p
        ctx.param_dtypes = [p.dtype for p in params]
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, *grad_p = ctx.saved_tensors
        dh = grad_h * grad_total.to(grad_h.dtype) if grad_h is not None else None
        stored = iter(grad_p)
        dparams = [(next(stored) * grad_total).to(dtype) if need else None
                   for need, dtype in zip(ctx.need_p, ctx.param_dtypes)]
        return (dh, None, None, None, *dparams)


def chunked_loss_sum(
    hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, vocab: int, chunk_size: int = 2048
) -> torch.Tensor:
    """Sum of token cross-entropies of ``head(hidden)`` against ``labels``, ``chunk_size`` tokens at a time.

    Works for any head module, however wrapped: the call goes through ``head.__call__`` (so FSDP2's
    and FSDP1's hooks unshard its weights, and the gradients they reduce arrive in backward), with
    the innermost module's forward temporarily replaced by the fused chunked loss
    (:class:`_HeadCrossEntropySum`). At most one chunk of full-vocabulary float32 logits is alive,
    logits are never recomputed, and no weight is read in backward. Chunks whose labels are all
    ignored still run: every rank's sum must be in the graph, or the backward all-reduce would
    wait forever. ``vocab`` is checked against the head's output width.
    """
    target = _innermost(head)
    compute = type(target).forward.__get__(target)  # the class's forward, bound: what head() would run
    chunk_rows = max(1, chunk_size)

    def fused_forward(h: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            with torch.enable_grad():  # one row through the head: its width, and what it reads
                probe = compute(h.reshape(-1, h.shape[-1])[:1].detach())
            params = _head_parameters(target, probe)
            _check_vocab(probe, vocab)
            del probe
        else:
            params = []
        return _HeadCrossEntropySum.apply(h, labels, compute, chunk_rows, *params)

    if "forward" in target.__dict__:
        raise RuntimeError(f"the loss head {type(target).__name__} already has an instance-level forward; "
                           "lightseq_hf's chunked loss cannot wrap it.")
    target.forward = fused_forward
    try:
        return head(hidden)
    finally:
        del target.forward


def _check_vocab(logits: torch.Tensor, vocab: int) -> None:
    if logits.shape[-1] != vocab:
        raise ValueError(f"the output head produces {logits.shape[-1]} logits per token but the model's "
                         f"vocab_size is {vocab}; fix config.vocab_size or the head.")


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
