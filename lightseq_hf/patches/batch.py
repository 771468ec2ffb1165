"""A batch of full rows -> this rank's slice, after checking every rank of the group holds the same batch."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.ops import group_rank_and_size
from ..parallel.segments import Segments, segments_from_hf
from ..parallel.sharding import IGNORE_INDEX, SequenceShard, global_position_ids, shard_for, take_shard
from .attention import SequenceParallelContext, chunked_documents
from .state import PatchSettings, resolve_sp_group

__all__ = ["SplitBatch", "check_same_batch", "split_batch"]

#: the parts of a batch the fingerprint covers, in its order (each: presence, dtype, two checksums)
_FINGERPRINT_FIELDS = ("input_ids", "labels", "inputs_embeds", "position_ids", "attention_mask")
_DTYPES = (None, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
           torch.float32, torch.float16, torch.bfloat16)
_BIT_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@dataclass(frozen=True)
class SplitBatch:
    """This rank's part of a batch of full rows: what the decoder stack runs on."""

    group: dist.ProcessGroup | None
    shard: SequenceShard
    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    position_ids: torch.Tensor
    context: SequenceParallelContext
    last_position: torch.Tensor  # of the whole rows (0-d): what length-dependent rotary embeddings read


def _segments_of(attention_mask, position_ids, kwargs: dict, batch: int, seq: int) -> Segments | None:
    """Documents of the full rows from HF inputs (restarting ``position_ids``, ``cu_seq_lens_*`` kwargs,
    2-D padding masks); ``None`` for plain rows. Pops the flash-attn varlen kwargs, which describe the
    full rows, not this rank's slice."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    for key in ("max_length_q", "max_length_k", "seq_idx"):
        kwargs.pop(key, None)
    return segments_from_hf(batch=batch, length=seq, attention_mask=attention_mask,
                            position_ids=position_ids, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)


def _check_padding_labels(attention_mask: torch.Tensor | None, shifted: torch.Tensor | None) -> None:
    """Padding is exact only if no padding position is a prediction target (its output is zero)."""
    if attention_mask is None or shifted is None or attention_mask.dim() != 2:
        return
    padding = ~attention_mask.bool()
    if bool(padding.any()) and bool((shifted[padding] != IGNORE_INDEX).any()):
        raise ValueError(
            "the labels of padding positions (attention_mask 0) predict tokens (with left padding, the last "
            "padding position predicts the first real token); set their shifted labels to -100 "
            "(Transformers' and TRL's collators do for right padding) so the loss ignores padding."
        )


def _check_labels_in_documents(segments: Segments | None, shifted: torch.Tensor | None) -> None:
    """Tokens in no document (after the last ``cu_seq_lens`` boundary) have no attention output, so they
    may not be prediction targets; costs nothing when every token is in a document."""
    if segments is None or shifted is None:
        return
    gaps = [(r, start, stop) for r, row in enumerate(segments.docs)
            for start, stop in zip([0] + [b for _, b in row], [a for a, _ in row] + [segments.length])
            if stop > start]
    if not gaps:
        return
    outside = torch.zeros(tuple(shifted.shape[:2]), dtype=torch.bool)
    for r, start, stop in gaps:
        outside[r, start:stop] = True
    bad = (shifted != IGNORE_INDEX) & outside.to(shifted.device)
    if bool(bad.any()):
        r, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"the label of token {t} of row {r} predicts a token, but token {t} lies in no document (after "
            "the last cu_seq_lens_q/k boundary of its row, or between documents), so the model computes no "
            "output there; set the labels of tokens outside the documents to -100, or extend "
            "cu_seq_lens_q/k over them.")


def _dtype_code(x: torch.Tensor) -> int:
    return _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)


def _fingerprint(x: torch.Tensor | None, where: torch.device) -> torch.Tensor:
    """Presence, dtype code and two sums of the bits of ``x``: plain, and weighted by position + 1
    (never 0, no modulus), so two tensors that differ at one position differ in the second sum."""
    if x is None:
        return torch.zeros(4, dtype=torch.int64, device=where)
    code = _dtype_code(x)
    x = x.detach()
    if x.is_floating_point():
        x = x.contiguous().view(_BIT_VIEWS[x.element_size()])  # the exact bits, not a rounded sum
    x = x.to(where).long().flatten()
    weights = torch.arange(1, x.numel() + 1, device=where, dtype=torch.int64)
    return torch.stack([torch.ones((), dtype=torch.int64, device=where),
                        torch.full((), code, dtype=torch.int64, device=where), x.sum(), (x * weights).sum()])


def _weights_digest(model: torch.nn.Module | None) -> int:
    """A 32-bit digest of the dtypes of the model's parameters, in order."""
    if model is None:
        return 0
    return zlib.crc32(",".join(str(p.dtype) for p in model.parameters()).encode())


def check_same_batch(group, batch: int, seq: int, input_ids, labels, device: torch.device,
                     segments: Segments | None = None, *, inputs_embeds=None, position_ids=None,
                     attention_mask=None, model: torch.nn.Module | None = None) -> None:
    """All-gather a fingerprint of the batch: every rank of the group must hold the same one.

    It covers the shape, every input that shapes the result (ids, shifted labels, embeddings bit for
    bit, position ids, the attention mask, the documents) with their dtypes, and the dtypes of the
    model's weights; a mismatch raises the same ValueError on every rank, naming what differs.
    """
    where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    labels_ok = labels is None or tuple(labels.shape) == (batch, seq)
    tensors = (input_ids, labels if labels_ok else None, inputs_embeds, position_ids, attention_mask)
    parts = [torch.tensor([batch, seq, int(labels is not None), int(labels_ok)], device=where,
                          dtype=torch.int64)]
    parts += [_fingerprint(x, where) for x in tensors]
    parts.append(torch.tensor([0 if segments is None else segments.checksum(), _weights_digest(model)],
                              device=where, dtype=torch.int64))
    parts.append(_id_range(input_ids, where))
    parts.append(_id_range(labels if labels_ok else None, where, ignore=IGNORE_INDEX))
    parts.append(_first_weights_sum(model, where))
    mine = torch.cat(parts)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(t[:-1].tolist()) for t in gathered]
    if not labels_ok:  # raised after the all-gather, so that no rank is left waiting in it
        raise ValueError(f"labels have shape {tuple(labels.shape)}; expected length {seq} and batch {batch} "
                         "like input_ids: labels must be (batch, length).")
    if len(set(rows)) > 1:
        _raise_different(rows)
    _check_vocabulary(rows[0][-4:-2], rows[0][-2:], model)
    _check_same_weights([t[-1:].view(torch.float64).item() for t in gathered], model)


def _first_weights_sum(model: torch.nn.Module | None, where: torch.device) -> torch.Tensor:
    """At a model's first forward, the float64 sum of its parameters that every rank holds whole (its bits
    as one int64; DDP/FSDP-sharded and ZeRO parameters are left out); 0 at later forwards."""
    total = torch.zeros((), dtype=torch.float64, device=where)
    if model is not None and not model.__dict__.get("_lightseq_weights_checked"):
        from torch.distributed.tensor import DTensor

        for p in model.parameters():
            if p.numel() and not isinstance(p, DTensor) and not hasattr(p, "_fsdp_flattened") \
                    and not hasattr(p, "ds_id"):
                total += p.detach().sum(dtype=torch.float64).to(where)
    return total.reshape(1).view(torch.int64)


def _check_same_weights(sums: list[float], model: torch.nn.Module | None) -> None:
    """Every rank of the group must start from the same weights: they train as one model."""
    if model is None or model.__dict__.get("_lightseq_weights_checked"):
        return
    if max(abs(a - sums[0]) for a in sums) > 1e-6 * max(1.0, *(abs(a) for a in sums)):
        shown = ", ".join(f"rank {r}: {a:.9g}" for r, a in enumerate(sums))
        raise ValueError(
            f"the ranks of a sequence-parallel group hold different weights at their first forward (sums of "
            f"the parameters: {shown}); every rank must start from the same weights: seed every rank alike "
            "before building the model (transformers.set_seed), or load the same checkpoint (DDP and FSDP "
            "copy rank 0's weights to the others when they wrap the model).")
    model.__dict__["_lightseq_weights_checked"] = True


def _id_range(input_ids: torch.Tensor | None, where: torch.device, ignore: int | None = None) -> torch.Tensor:
    """The smallest and largest token id (0, 0 without ids; ``ignore`` read as 0), gathered with the
    fingerprint so that the vocabulary checks cost no synchronisation of their own."""
    if input_ids is None or input_ids.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=where)
    ids = input_ids.detach()
    if ignore is not None:  # ignored positions read as id 0, always in range (no host synchronisation)
        ids = ids.masked_fill(ids == ignore, 0)
    return torch.stack([ids.min(), ids.max()]).to(where, torch.int64)


def _hf_model(model: torch.nn.Module | None) -> bool:
    from transformers import PreTrainedModel  # loaded once a model exists; the core imports without it

    return isinstance(model, PreTrainedModel)


def _check_id_range(id_range: tuple[int, ...], rows: int, what: str, outside: str, fix: str,
                    also: str = "") -> None:
    """Ids outside a table of ``rows`` fail deep in the embedding or the loss (on a GPU, as a device-side
    assert); refuse them on every rank with the fix instead."""
    low, high = id_range
    if low < 0 or high >= rows:
        raise ValueError(f"{what} hold token id {low if low < 0 else high}, {outside} of {rows} (ids 0 to "
                         f"{rows - 1}{also}): {fix}")


def _check_vocabulary(id_range: tuple[int, ...], label_range: tuple[int, ...],
                      model: torch.nn.Module | None) -> None:
    """Token ids against the input embedding's rows, labels against the head's."""
    if not _hf_model(model):
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, torch.nn.Embedding):
        _check_id_range(id_range, embedding.num_embeddings, "input_ids", "outside the model's vocabulary",
                        "the tokenizer does not match the model; use the model's own tokenizer, or grow the "
                        "embeddings to the tokenizer with model.resize_token_embeddings(len(tokenizer)).")
    if isinstance(head, torch.nn.Linear):
        _check_id_range(label_range, head.out_features, "labels",
                        "outside the model's output vocabulary",
                        f"mark ignored positions with {IGNORE_INDEX}, and take labels from the model's own "
                        "tokenizer.", also=f", or {IGNORE_INDEX} where no loss is taken")


def _raise_different(rows: list[tuple[int, ...]]) -> None:
    names = (["batch size", "length", "labels given", "labels shape"]
             + [f"{name} {part}" for name in _FINGERPRINT_FIELDS for part in ("presence", "dtype", "values",
                                                                             "values")]
             + ["documents (segments)", "weight dtypes", "token id range", "token id range", "label id range",
       "label id range"])
    differ = list(dict.fromkeys(n.replace(" values", "") if n.endswith("values") else n
                                for i, n in enumerate(names) if len({r[i] for r in rows}) > 1))
    described = "; ".join(f"rank {r}: batch {x[0]}, length {x[1]}, labels {bool(x[2])}"
                          + ("" if x[3] else " (wrong shape)") for r, x in enumerate(rows))
    fix = ("Load the model in one dtype on every rank (the same torch_dtype / .to(dtype))."
           if differ == ["weight dtypes"] else
           "Every rank of the group must get the same full batch and the patch slices it: call "
           "lightseq_hf.patch() before building the Trainer, or shard your data by the data-parallel rank "
           "(lightseq_hf.parallel.current_groups().dp_rank), not by the global rank.")
    raise ValueError(f"the ranks of a sequence-parallel group received different batches (differ: "
                     f"{', '.join(differ)}; {described}). {fix}")


def _check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
    """Raise ValueError unless the inputs are (batch, seq) token ids or (batch, seq, hidden) embeddings
    of at least one token."""
    if input_ids is not None and (input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"input_ids must be a 2-D (batch, seq) integer tensor; got shape "
                         f"{tuple(input_ids.shape)}, dtype {input_ids.dtype} (add a batch dimension with "
                         "input_ids[None]; token ids are int64).")
    if inputs_embeds is not None and inputs_embeds.dim() != 3:
        raise ValueError(f"inputs_embeds must be 3-D (batch, seq, hidden); got shape "
                         f"{tuple(inputs_embeds.shape)}.")
    full = input_ids if input_ids is not None else inputs_embeds
    if full.shape[1] == 0:
        raise ValueError(f"the inputs hold no tokens (shape {tuple(full.shape)}); a sequence-parallel "
                         "forward needs at least one token per row.")


def _check_no_layerdrop(model: torch.nn.Module) -> None:
    """LayerDrop skips decoder layers at random in training, a different draw on each rank: the ranks'
    collectives would no longer match (a hang). Refuse it by name on every rank instead."""
    if not model.training:
        return
    holders = model.__dict__.get("_lightseq_layerdrop")
    if holders is None:
        holders = [(name, m) for name, m in model.named_modules() if hasattr(m, "layerdrop")]
        model.__dict__["_lightseq_layerdrop"] = holders
    for name, module in holders:
        if isinstance(module.layerdrop, (int, float)) and module.layerdrop > 0:
            where = f"{name}.layerdrop" if name else "layerdrop"
            raise ValueError(
                f"{where} = {module.layerdrop}: LayerDrop skips decoder layers at random in training, a "
                "different draw on each rank, which sequence parallelism cannot split. Load the model with "
                f"layerdrop=0.0 (from_pretrained(..., layerdrop=0.0)) or set model.{where} = 0.0.")


def _shard_pad_id(model: torch.nn.Module) -> int:
    """The token that right-pads the last slice: the model's pad token when it is an id of its vocabulary,
    else 0 (no real token sees a pad, so any id is exact; one outside the embedding would fail)."""
    pad, vocab = getattr(model.config, "pad_token_id", None), getattr(model.config, "vocab_size", None)
    return pad if isinstance(pad, int) and 0 <= pad < (vocab if isinstance(vocab, int) else pad + 1) else 0


def split_batch(model: torch.nn.Module, settings: PatchSettings, input_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, kwargs: dict[str, Any],
                shifted_labels: torch.Tensor | None = None, layer_kinds: tuple[str, ...] = (),
                positions_from_mask: bool = False) -> SplitBatch:
    """Check a batch of full rows and cut this rank's slice of it (every rank of the group must call).
    ``positions_from_mask``: the model counts absent positions along the padding mask (OPT); the slice
    gets those positions."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds.")
    full = input_ids if input_ids is not None else inputs_embeds
    _check_inputs(input_ids, inputs_embeds)
    _check_no_layerdrop(model)
    batch, seq = full.shape[:2]
    device = full.device
    group = resolve_sp_group(settings)
    rank, world = group_rank_and_size(group)
    shard = shard_for(seq, rank, world)
    segments = _segments_of(attention_mask, position_ids, kwargs, batch, seq)
    _check_padding_labels(attention_mask, shifted_labels)
    _check_labels_in_documents(segments, shifted_labels)
    if world > 1:
        check_same_batch(group, batch, seq, input_ids, shifted_labels, device, segments,
                         inputs_embeds=inputs_embeds, position_ids=position_ids,
                         attention_mask=attention_mask, model=model)
    chunked = None
    if "chunked_attention" in layer_kinds:
        chunked = chunked_documents(segments, batch, seq, shard.padded_len, model.config.attention_chunk_size)
    if positions_from_mask and position_ids is None and attention_mask is not None:
        mask = attention_mask.long()
        local_pos = take_shard(mask.cumsum(1) * mask - 1, shard)  # padding -1, as the model counts them
    elif segments is not None and position_ids is not None:  # packed: positions restart per document
        local_pos = take_shard(position_ids.reshape(-1, seq).expand(batch, seq), shard)
    else:
        local_pos = global_position_ids(position_ids, batch, shard, device)
    context = SequenceParallelContext(
        group, settings.backend, seq, None if segments is None else segments.padded(shard.padded_len),
        layer_kinds, chunked, getattr(model.config, "model_type", ""))
    last = position_ids.max() if position_ids is not None else torch.tensor(seq - 1, device=device)
    return SplitBatch(
        group=group, shard=shard, last_position=last,
        input_ids=take_shard(input_ids, shard, value=_shard_pad_id(model)) if input_ids is not None else None,
        inputs_embeds=take_shard(inputs_embeds, shard) if inputs_embeds is not None else None,
        position_ids=local_pos, context=context,
    )
