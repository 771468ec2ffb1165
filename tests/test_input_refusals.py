"""Inputs to the public surface that would fail deep inside torch or give a quietly wrong result, each
refused with one line that names the problem and the fix, while well-formed inputs beside them still give
the unpatched model's numbers: labels outside the vocabulary, ``position_ids`` that restart where
``cu_seq_lens`` start no document, groups this rank is not in or of the wrong kind, cu_seqlens that are not
whole numbers, Segments of the wrong types, non-boolean flags and non-numeric scales, malformed ids,
embeddings and labels for the patched model, ``check_parity`` options that would pass anything, and a
padding multiple without its dimension."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import rel_err, run_distributed
from tiny_models import VOCAB, make_batch, make_model

import lightseq_hf
from lightseq_hf import Segments


def _one_line(excinfo: pytest.ExceptionInfo, needle: str) -> None:
    text = str(excinfo.value)
    assert needle in text, text
    assert "\n" not in text, text


def _labels_worker(rank: int, world: int) -> list[str]:
    failures = []
    model = make_model(layers=1)
    ids, labels = make_batch(2, 12, 0)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(input_ids=ids, labels=labels).loss
    lightseq_hf.patch(model)
    try:
        for bad, token in ((labels.clamp(max=0) + VOCAB + 3, VOCAB + 3), (torch.full_like(labels, -1), -1)):
            try:
                model(input_ids=ids, labels=bad)
                failures.append(f"rank {rank}: labels holding {token} were not refused")
            except ValueError as e:
                text = str(e)
                needle = f"labels hold token id {token}, outside the model's output vocabulary of {VOCAB}"
                if needle not in text or "\n" in text:
                    failures.append(f"rank {rank}: {text}")
        with torch.no_grad():
            got = model(input_ids=ids, labels=labels).loss  # -100 and in-vocabulary ids still pass
            none = model(input_ids=ids, labels=torch.full_like(labels, -100)).loss
        if rel_err(got, want) > 1e-5 or not torch.isnan(none):
            failures.append(f"rank {rank}: loss {got} vs {want}; all-ignored loss {none}")
    finally:
        lightseq_hf.unpatch()
    return failures


def test_labels_outside_the_vocabulary_are_refused_on_every_rank() -> None:
    assert run_distributed(_labels_worker, 2) == [[], []]


def test_position_ids_must_restart_where_cu_seq_lens_start_documents() -> None:
    ids, _ = make_batch(1, 12, 3)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]  # documents [0, 5) and [5, 12)
    model = make_model(layers=1)
    ref = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        want = torch.cat([ref(input_ids=ids[:, :5]).logits, ref(input_ids=ids[:, 5:]).logits], 1)
    lightseq_hf.patch(model)
    try:
        model.eval()
        with torch.no_grad(), pytest.raises(ValueError) as e:
            other = torch.tensor([0, 6, 12])
            model(input_ids=ids, position_ids=pos, cu_seq_lens_q=other, cu_seq_lens_k=other)
        _one_line(e, "position_ids restart at token 5 of row 0, where cu_seq_lens_q/k start no document")
        same = torch.tensor([0, 5, 12], dtype=torch.int32)
        with torch.no_grad():
            for kwargs in (dict(position_ids=pos), dict(position_ids=torch.arange(12)[None]), {}):
                got = model(input_ids=ids, cu_seq_lens_q=same, cu_seq_lens_k=same, **kwargs).logits
                assert rel_err(got, want) < 1e-5, kwargs  # agreeing (or continuous) positions are fine
    finally:
        lightseq_hf.unpatch()


def test_a_group_this_rank_is_not_in_is_named() -> None:
    outside = dist.GroupMember.NON_GROUP_MEMBER  # what new_group returns on the ranks it leaves out
    q = torch.randn(1, 8, 2, 8)
    needle = "this rank is not a member of the process group passed"
    for call in (lambda: lightseq_hf.dist_flash_attn(q, q, q, group=outside),
                 lambda: lightseq_hf.sync_gradients(torch.nn.Linear(2, 2), group=outside),
                 lambda: lightseq_hf.patch(make_model(layers=1), sp_group=outside)):
        with pytest.raises(ValueError) as e:
            call()
        _one_line(e, needle)


def test_pad_to_multiple_names_a_missing_dimension() -> None:
    with pytest.raises(ValueError) as e:
        lightseq_hf.pad_to_multiple(torch.arange(5), 4)  # 1-D: there is no sequence dim 1
    _one_line(e, "dim=1 is not a dimension of x, of shape (5,); the sequence is dim 1 of (batch, seq, ...)")
    assert lightseq_hf.pad_to_multiple(torch.arange(5), 4, dim=0).tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert lightseq_hf.pad_to_multiple(torch.ones(1, 5), 4, dim=-1).shape == (1, 8)


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 8, 2, 8, generator=g) for _ in range(3))


CU_MESSAGE = "cu_seqlens must be a 1-D list or tensor of whole token counts"


@pytest.mark.parametrize("cu", [
    torch.tensor([0.0, 3.5, 8.0]),          # int() would cut it to [0, 3, 8]
    [0, 3.5, 8],
    torch.tensor([[0, 3, 8]]),
    torch.tensor([False, True]),            # int() would read it as [0, 1]
    "0,3,8",
    torch.tensor([0, 3, 8], device="meta"),
], ids=["float-tensor", "float-list", "2-D", "bool", "string", "meta"])


def test_cu_seqlens_must_be_whole_numbers(cu) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=cu)
    _one_line(e, CU_MESSAGE)


def test_whole_number_cu_seqlens_of_any_kind_agree() -> None:
    import numpy as np

    q, k, v = _qkv()
    want = lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 8])
    for cu in (torch.tensor([0.0, 3.0, 8.0]), torch.tensor([0, 3, 8], dtype=torch.int32), (0, 3, 8),
               np.array([0, 3, 8])):
        torch.testing.assert_close(lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=cu), want)


@pytest.mark.parametrize("length, docs", [
    (8.0, (((0, 3), (3, 8)),)),
    (8, (((0, 3.5), (3.5, 8)),)),
    (8, ((0, 3), (3, 8))),                  # one row without its nesting
])


def test_segments_need_int_pairs_per_row(length, docs) -> None:
    with pytest.raises(ValueError) as e:
        Segments(length, docs)
    _one_line(e, "Segments takes an int length and, per batch row, a sequence of (start, stop) int pairs")


def test_segments_normalise_lists_and_integer_tensors() -> None:
    seg = Segments(8, [[(torch.tensor(0), torch.tensor(3)), [3, 8]]])
    assert seg == Segments(8, (((0, 3), (3, 8)),)) and isinstance(seg.docs[0][0][1], int)
    q, k, v = _qkv()
    torch.testing.assert_close(lightseq_hf.dist_flash_attn(q, k, v, segments=seg),
                               lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 8]))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(causal=None), "causal must be True or False; got None"),        # falsy: would mean non-causal
    (dict(causal="False"), "causal must be True or False; got 'False'"),
    (dict(softmax_scale="0.3"), "softmax_scale must be a number (or None); got '0.3'"),
])


def test_flag_and_scale_types(kwargs: dict, needle: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        lightseq_hf.dist_flash_attn(q, k, v, **kwargs)
    _one_line(e, needle)


def test_group_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError) as e:
        lightseq_hf.pad_to_multiple(torch.zeros(1, 5), 0)
    _one_line(e, "multiple must be a positive int (the group size); got 0")
    with pytest.raises(ValueError) as e:
        lightseq_hf.pad_to_multiple(torch.zeros(1, 5), -2)
    _one_line(e, "multiple must be a positive int")
    for world in ("3", 2.0):
        with pytest.raises(ValueError) as e:
            lightseq_hf.build_schedule(world)
        _one_line(e, f"world size must be an int >= 1, got {world!r}")
    with pytest.raises(ValueError) as e:
        lightseq_hf.segments_from_hf(batch=1, length=4, position_ids=torch.tensor([[0, 0.5, 1, 2]]))
    _one_line(e, "position_ids must be whole numbers")  # .long() would read [0, 0, 1, 2]: two documents
    assert lightseq_hf.segments_from_hf(batch=1, length=4, position_ids=torch.tensor([[0.0, 1, 0, 1]])) == \
        Segments(4, (((0, 2), (2, 4)),))
    with pytest.raises(ValueError) as e:
        lightseq_hf.init_sequence_parallel(0)
    _one_line(e, "sp_size must be a positive int (ranks per sequence) or None (every rank); got 0")


def test_groups_must_be_process_groups() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        lightseq_hf.dist_flash_attn(q, k, v, group=3)
    _one_line(e, "group must be a torch.distributed.ProcessGroup or None (the world); got int")
    with pytest.raises(ValueError) as e:
        lightseq_hf.sync_gradients(torch.nn.Linear(2, 2), group=3)
    _one_line(e, "group must be a torch.distributed.ProcessGroup or None (all ranks); got int")


@pytest.fixture


def patched():
    from tiny_models import make_model

    model = lightseq_hf.patch(make_model(layers=1))
    try:
        yield model
    finally:
        lightseq_hf.unpatch()


def test_patched_model_refuses_malformed_inputs(patched) -> None:
    from tiny_models import make_batch

    ids, labels = make_batch(2, 12, 0)
    cases = [
        (dict(input_ids=ids[0]), "input_ids must be a 2-D (batch, seq) integer tensor; got shape (12,)"),
        (dict(input_ids=ids.float()), "input_ids must be a 2-D (batch, seq) integer tensor; got shape "
                                      "(2, 12), dtype torch.float32"),
        (dict(input_ids=ids.to(torch.uint8)), "dtype torch.uint8 (add a batch dimension"),
        (dict(inputs_embeds=torch.randn(12, 64)), "inputs_embeds must be 3-D (batch, seq, hidden); got shape "
                                                  "(12, 64)"),
        (dict(input_ids=ids[:, :0]), "the inputs hold no tokens (shape (2, 0))"),
        (dict(input_ids=ids, labels=labels.float()), "labels must be integer token ids (int64, -100 where no "
                                                     "loss is taken); got dtype torch.float32"),
        (dict(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, 5.5, 12]),
              cu_seq_lens_k=torch.tensor([0, 5.5, 12])), CU_MESSAGE),  # int() would split at 5
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError) as e:
            patched(**kwargs)
        _one_line(e, needle)
    out = patched(input_ids=ids, labels=labels)  # the well-formed call still runs
    assert torch.isfinite(out.loss)


def test_check_parity_refuses_options_that_pass_anything(patched) -> None:
    from tiny_models import make_batch

    ids, _ = make_batch(2, 12, 0)
    cases = [
        (dict(rtol=float("nan")), "rtol must be a positive finite number"),   # no error exceeds nan
        (dict(rtol=-1.0), "rtol must be a positive finite number"),
        (dict(max_tokens=0), "max_tokens must be a positive int"),
        (dict(max_tokens=-5), "max_tokens must be a positive int"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError) as e:
            lightseq_hf.check_parity(patched, {"input_ids": ids}, **kwargs)
        _one_line(e, needle)
    for length in (0, 1):  # no next-token label: the losses are NaN
        with pytest.raises(ValueError) as e:
            lightseq_hf.check_parity(patched, {"input_ids": ids[:, :length]})
        _one_line(e, "the parity check needs rows of at least 2 tokens (a next-token loss); the batch's "
                     f"rows have {length}")


def _shard_inputs_worker(rank: int, world: int) -> list[str]:
    """On two ranks: a shard's own cu_seqlens is refused on every rank, the full rows' and explicit
    Segments run; token ids outside the vocabulary are refused on every rank before any work."""
    from tiny_models import VOCAB, make_batch, make_model

    failures: list[str] = []

    def refused(call, needle: str) -> None:
        try:
            call()
            failures.append(f"rank {rank}: accepted, expected {needle!r}")
        except ValueError as e:
            if needle not in str(e) or "\n" in str(e):
                failures.append(f"rank {rank}: {e}")

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=g) for _ in range(3))
    refused(lambda: lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 8]),
            "cu_seqlens ends at 8, the size of one rank's shard (1 x 8 tokens)")
    padded = lightseq_hf.dist_flash_attn(q, k, v, segments=Segments.from_cu_seqlens([0, 3, 8], 1, 16))
    if rank == 1 and bool(padded.any()):
        failures.append("rank 1: the padding of explicit Segments did not output 0")
    if not torch.isfinite(lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 16])).all():
        failures.append(f"rank {rank}: the full rows' cu_seqlens gave non-finite output")

    model = lightseq_hf.patch(make_model(layers=1))
    ids, labels = make_batch(1, 12, 0)
    for bad, shown in ((VOCAB, VOCAB), (-1, -1)):
        wrong = ids.clone()
        wrong[0, 9] = bad  # on rank 1's half: rank 0 alone would never see it
        refused(lambda: model(input_ids=wrong, labels=labels),
                f"input_ids hold token id {shown}, outside the model's vocabulary of {VOCAB}")
    if not torch.isfinite(model(input_ids=ids, labels=labels).loss):
        failures.append(f"rank {rank}: the well-formed batch after the refusals did not run")
    lightseq_hf.unpatch()
    return failures


def test_shard_cu_seqlens_and_unknown_token_ids_are_refused_on_every_rank() -> None:
    from distributed import run_distributed

    assert run_distributed(_shard_inputs_worker, 2) == [[], []]
