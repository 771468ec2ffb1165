"""Segments from HF inputs, key ranges, and the reference kernel with document masks."""

from __future__ import annotations

import pytest
import torch
from distributed import rel_err
from doc_reference import per_document_attention, random_docs

from lightseq_hf.kernels import ReferenceKernel
from lightseq_hf.parallel.merge import empty_running
from lightseq_hf.parallel.segments import (
    Segments,
    decode_segments,
    key_ranges,
    local_key_range,
    segments_from_hf,
    visible_pairs,
)


def brute_visible(segments, causal, window):
    """(batch, n, n) bool: the rule as stated, token by token."""
    b, n = segments.batch, segments.length
    doc = torch.full((b, n), -1)
    for r, row in enumerate(segments.docs):
        for d, (start, stop) in enumerate(row):
            doc[r, start:stop] = d
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    vis = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= i - j < window
        if not causal:
            vis &= j - i < window
    return vis


def test_packed_position_ids_give_documents():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    seg = segments_from_hf(batch=1, length=10, position_ids=pos)
    assert seg.docs == (((0, 3), (3, 5), (5, 6), (6, 10)),)
    assert segments_from_hf(batch=2, length=4, position_ids=torch.arange(4)) is None
    assert segments_from_hf(batch=1, length=4, position_ids=torch.arange(7, 11)[None]) is None  # offset start


def test_padding_masks_left_and_right():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    seg = segments_from_hf(batch=4, length=5, attention_mask=mask)
    assert seg.docs == (((0, 3),), ((2, 5),), (), ((0, 5),))
    # HF's left-padding positions (pads filled with 1) do not split the document
    pos = torch.tensor([[1, 1, 0, 1, 2]])
    seg = segments_from_hf(batch=1, length=5, attention_mask=mask[1:2], position_ids=pos)
    assert seg.docs == (((2, 5),),)
    assert segments_from_hf(batch=1, length=3, attention_mask=torch.ones(1, 3)) is None


def test_mask_with_holes_and_4d_masks_are_refused():
    with pytest.raises(ValueError, match="zeros between ones"):
        segments_from_hf(batch=1, length=5, attention_mask=torch.tensor([[1, 0, 1, 1, 0]]))
    with pytest.raises(ValueError, match="2-D padding mask"):
        segments_from_hf(batch=1, length=5, attention_mask=torch.ones(1, 1, 5, 5))


def test_cu_seq_lens_kwargs():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    seg = segments_from_hf(batch=1, length=10, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert seg.docs == (((0, 3), (3, 4), (4, 9)),)  # token 9 is padding
    assert Segments.from_cu_seqlens([0, 2, 4, 6], 2, 4).docs == (((0, 2), (2, 4)), ((0, 2),))
    with pytest.raises(ValueError, match="crosses from batch row"):
        Segments.from_cu_seqlens([0, 3, 8], 2, 4)
    with pytest.raises(ValueError, match="equal"):
        segments_from_hf(batch=1, length=10, cu_seq_lens_q=cu, cu_seq_lens_k=cu[:-1])
    with pytest.raises(ValueError, match="strictly increase"):
        Segments.from_cu_seqlens([0, 3, 3], 1, 4)


def test_invalid_segments_and_encoding_round_trip():
    with pytest.raises(ValueError, match="sorted, disjoint"):
        Segments(8, (((0, 4), (3, 6)),))
    seg = Segments(9, (((0, 4), (4, 9)), (), ((2, 3),)))
    assert decode_segments(seg.encode()) == seg
    assert seg.checksum() == Segments(9, seg.docs).checksum() != Segments.full(3, 9).checksum()
    assert Segments.full(2, 5).is_full() and not seg.is_full()


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
def test_key_ranges_are_the_rule_and_monotone(causal, window):
    gen = torch.Generator().manual_seed(0)
    seg = Segments(40, random_docs(gen, 3, 40, pad_left=True, pad_right=True, max_len=9))
    lo, hi = key_ranges(seg, causal=causal, window=window)
    j = torch.arange(40)[None, None, :]
    ranged = (j >= lo[..., None]) & (j < hi[..., None])
    assert torch.equal(ranged, brute_visible(seg, causal, window))
    assert bool((lo.diff(dim=-1) >= 0).all()) and bool((hi.diff(dim=-1) >= 0).all())
    # pair counts per key chunk add up to the mask's
    counts = sum(visible_pairs(lo, hi, a, a + 10).sum() for a in range(0, 40, 10))
    assert int(counts) == int(ranged.sum())


def test_local_key_range_stays_in_chunk():
    seg = Segments(12, (((0, 5), (5, 12)),))
    lo, hi = key_ranges(seg, causal=True)
    llo, lhi = local_key_range(lo[:, 6:], hi[:, 6:], 4, 4)  # rows 6.., keys [4, 8)
    assert llo.dtype == torch.int32
    assert llo.tolist() == [[1, 1, 1, 1, 1, 1]] and lhi.tolist() == [[3, 4, 4, 4, 4, 4]]


@pytest.mark.parametrize("causal, window", [(True, None), (True, 4), (False, None), (False, 3)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)])
def test_reference_kernel_with_documents_matches_per_document_float64(causal, window, heads):
    h, hk = heads
    gen = torch.Generator().manual_seed(1)
    n = 45
    seg = Segments(n, random_docs(gen, 3, n, pad_left=True, pad_right=True, max_len=14))
    seg = Segments(n, (*seg.docs[:2], ()))  # the last row is all padding
    q = torch.randn(3, n, h, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(3, n, hk, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(3, n, hk, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    ref_out, ref_lse = per_document_attention(q, k, v, seg.docs, causal=causal, window=window)
    dout = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    lo, hi = key_ranges(seg, causal=causal, window=window)
    rng = local_key_range(lo, hi, 0, n)
    kernel = ReferenceKernel(block_q=8, block_k=8)
    out, lse = kernel.forward(q, k, v, causal=False, scale=8 ** -0.5, key_range=rng)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())
    grads = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=8 ** -0.5, key_range=rng)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-12
    assert bool((grads[0][2] == 0).all()) and bool((grads[1][2] == 0).all())


def test_reference_kernel_key_chunks_accumulate():
    """Two key chunks with local ranges merged in accumulate mode equal the whole."""
    gen = torch.Generator().manual_seed(2)
    n = 32
    seg = Segments(n, random_docs(gen, 2, n, pad_right=True, max_len=12))
    q = torch.randn(2, n, 4, 8, dtype=torch.float64, generator=gen)
    kv = torch.randn(2, n, 2, 8, dtype=torch.float64, generator=gen)
    lo, hi = key_ranges(seg, causal=True, window=5)
    kernel = ReferenceKernel(block_q=8, block_k=8)
    out, lse = empty_running(q)
    for start in (16, 0):
        kernel.forward(q, kv[:, start:start + 16], kv[:, start:start + 16], causal=False, scale=0.3,
                       out=out, lse=lse, key_range=local_key_range(lo, hi, start, 16))
    ref_out, ref_lse = per_document_attention(q, kv, kv, seg.docs, window=5, scale=0.3)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12


def test_key_range_with_causal_is_refused():
    q = torch.randn(1, 4, 2, 8)
    rng = (torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="causal=False"):
        ReferenceKernel().forward(q, q, q, causal=True, scale=1.0, key_range=rng)
    with pytest.raises(ValueError, match="int32"):
        ReferenceKernel().forward(q, q, q, causal=False, scale=1.0, key_range=(rng[0].long(), rng[1]))
