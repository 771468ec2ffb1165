"""The attention mask is one value from ``dist_flash_attn`` down to the kernels.

``dist_flash_attn`` builds a ``SequenceMask``; the custom ops take it as their trailing arguments and
decode it; the loops cut each task's ``AttentionMask`` from it (``TaskMasks``) and hand it
to the kernel as ``mask=``. Direct kernel calls may pass the mask's fields as keywords instead (one
``AttentionMask`` built at the call), never both.
"""

from __future__ import annotations

import pytest
import torch
from doc_reference import per_document_attention
from varlen_emulation import install as install_varlen

import lightseq_hf
from lightseq_hf.kernels import (
    MASK_KEYWORDS,
    AttentionMask,
    MaskKind,
    ReferenceKernel,
    kernel_named,
    register_backend,
    unregister_backend,
)
from lightseq_hf.parallel.comm import Pending
from lightseq_hf.parallel.dist_attn import TaskMasks, dist_attn_forward
from lightseq_hf.parallel.schedule import build_schedule
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range
from lightseq_hf.parallel.sequence_mask import SequenceMask


class Recording:
    """A backend wrapping ``kernel`` that records the keywords of every forward and backward call."""

    name = "recording"

    def __init__(self, kernel) -> None:
        self.kernel, self.capabilities, self.calls = kernel, kernel.capabilities, []

    def unavailable(self, device, dtype=None):
        return self.kernel.unavailable(device, dtype)

    def forward(self, *args, **kwargs):
        self.calls.append(("forward", kwargs))
        return self.kernel.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls.append(("backward", kwargs))
        return self.kernel.backward(*args, **kwargs)


@pytest.fixture
def recording():
    """``wrap(kernel)``: registers ``Recording(kernel)`` as backend ``"recording"``; returns its calls."""
    def wrap(kernel):
        recorder = Recording(kernel)
        register_backend("recording", lambda: recorder)
        return recorder.calls

    try:
        yield wrap
    finally:
        unregister_backend("recording")


def _inputs(seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, n, 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
    return q, k, v, torch.randn_like(q)


def _mask_only(calls) -> list[str]:
    """The calls that did not get their mask as one ``AttentionMask`` (and nothing else)."""
    return [f"{kind}: {sorted(kw)}" for kind, kw in calls
            if not isinstance(kw.get("mask"), AttentionMask) or set(kw) & set(MASK_KEYWORDS)]


def test_a_kernel_takes_the_mask_or_its_keywords_not_both():
    kernel = ReferenceKernel()
    q, k, v, dout = _inputs(1)
    rng = local_key_range(*key_ranges(Segments(16, (((0, 5), (5, 16)), ((2, 11),))), causal=True), 0, 16)
    keywords = {"causal": False, "key_range": rng, "softcap": 2.0}
    mask = AttentionMask(**keywords)
    by_keywords = kernel.forward(q, k, v, scale=0.3, **keywords)
    by_mask = kernel.forward(q, k, v, scale=0.3, mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(by_keywords, by_mask))
    grads = [kernel.backward(dout, q, k, v, *by_mask, scale=0.3, **call)
             for call in (keywords, {"mask": mask})]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(ValueError, match="pass mask= or the mask keywords, not both; got mask= and causal="):
        kernel.forward(q, k, v, scale=0.3, mask=mask, causal=False)
    with pytest.raises(ValueError, match="not both; got mask= and softcap="):
        kernel.backward(dout, q, k, v, *by_mask, scale=0.3, mask=mask, softcap=2.0)
    with pytest.raises(TypeError, match="a kernel call needs its mask"):
        kernel.forward(q, k, v, scale=0.3)
    with pytest.raises(TypeError, match="mask must be an AttentionMask; got dict"):
        kernel.forward(q, k, v, scale=0.3, mask=keywords)


def test_the_sequence_mask_crosses_the_op_boundary_unchanged():
    seg = Segments(12, (((0, 5), (5, 12)), ((3, 9),)))
    for mask in (SequenceMask(), SequenceMask(False), SequenceMask(True, seg),
                 SequenceMask(False, seg, 4, 2.5), SequenceMask(True, Segments.full(1, 12), 3)):
        assert SequenceMask.from_op_args(*mask.op_args()) == mask
    assert SequenceMask(True, seg, 4).kind is MaskKind.WINDOW
    assert SequenceMask(False, seg).kind is MaskKind.DOCUMENTS
    assert SequenceMask(False).kind is MaskKind.FULL and SequenceMask().kind is MaskKind.CAUSAL
    assert SequenceMask(True, seg).digest() != SequenceMask(True, seg, 4).digest() != \
        SequenceMask(True, seg, 4, 2.0).digest()
    with pytest.raises(ValueError, match="a window needs the segments of the rows"):
        SequenceMask(True, None, 4)


@pytest.mark.parametrize("representation", ["key_range", "doc_blocks"])
def test_one_mask_from_the_api_to_the_kernel(representation, recording, monkeypatch):
    """Packed rows (with a window and a soft-cap for the key-range kernel, as document blocks for the
    emulated varlen kernel), forward and backward: out and the gradients are each document's own attention
    (the float64 per-document reference), and every kernel call gets the task's AttentionMask as ``mask=``,
    with the call's window and soft-cap."""
    if representation == "doc_blocks":
        install_varlen(setattr_=monkeypatch.setattr)
        calls, options = recording(kernel_named("flash_varlen")), {}
    else:
        calls, options = recording(ReferenceKernel()), {"window": 5, "softcap": 3.0}
    q, k, v, dout = _inputs(2)
    docs = (((0, 7), (7, 16)), ((1, 13),))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lightseq_hf.dist_flash_attn(*leaves, segments=Segments(16, docs), backend="recording", **options)
    out.backward(dout)
    expected = [t.clone().requires_grad_() for t in (q, k, v)]
    reference, _ = per_document_attention(*expected, docs, **options)
    reference.backward(dout)
    torch.testing.assert_close(out, reference)
    for name, got, want in zip(("dq", "dk", "dv"), leaves, expected):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    assert [kind for kind, _ in calls] == ["forward", "backward"]
    assert not _mask_only(calls)
    for mask in (kw["mask"] for _, kw in calls):
        assert getattr(mask, representation) is not None and not mask.causal
        assert (mask.window, mask.softcap) == (options.get("window"), options.get("softcap"))


def test_the_loop_hands_each_task_its_mask():
    """Rank 0's tasks of a 2-rank causal schedule (nothing received: the mechanism, not the values): one
    kernel call per task, each with its own AttentionMask, causal on the diagonal task."""

    class Silent:
        def post(self, transfers):
            return Pending([])

    kernel = Recording(ReferenceKernel())
    q, k, v, _ = _inputs(3, n=8)
    plan = build_schedule(2, True, "ring")
    tasks = [step[0] for step in plan.steps if step[0] is not None]
    dist_attn_forward(q, k, v, scale=0.3, schedule=plan, rank=0, comm=Silent(), kernel=kernel,
                      masks=TaskMasks())
    assert len(kernel.calls) == len(tasks) and not _mask_only(kernel.calls)
    assert [kw["mask"].causal for _, kw in kernel.calls] == [task.diagonal for task in tasks]
