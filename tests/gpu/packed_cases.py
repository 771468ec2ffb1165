"""Packed-document cases shared by the GPU tests of the packed backends (Triton with key ranges,
FlashAttention-2 varlen, cuDNN varlen): document layouts, float64 inputs, the error bound, and one
distributed worker that runs any of them on 2 GPUs against a float64 reference."""

from __future__ import annotations

import torch
from distributed import rel_err

from lightseq_hf.kernels import KernelRequest, MaskKind, select_backend
from lightseq_hf.kernels.reference import ReferenceKernel
from lightseq_hf.parallel.segments import Segments, key_ranges, local_key_range

PACKED_BACKENDS = ("triton", "flash_varlen", "cudnn_fe")
TINY_LSE = "key lengths 64 mod 128"  # the layout whose inputs also push the lse below -88.7


def random_docs(n: int, seed: int, *, pad: bool = False, max_len: int = 1500) -> tuple:
    """Documents of random lengths (1 to ``max_len``) over ``n`` tokens; ``pad``: padding before the first,
    after the last, and gaps of 0-2 padding tokens between documents."""
    g = torch.Generator().manual_seed(seed)
    t, docs = (37 if pad else 0), []
    end = n - (53 if pad else 0)
    while t < end:
        size = int(torch.randint(1, max_len, (1,), generator=g))
        docs.append((t, min(end, t + size)))
        t += size + (int(torch.randint(0, 3, (1,), generator=g)) if pad else 0)
    return tuple(d for d in docs if d[1] > d[0])


def layouts(n: int):
    """(name, documents per row) for rows of ``n`` tokens: every layout each packed backend must serve."""
    yield "random lengths, batch 2 with padding", (random_docs(n, 1), random_docs(n, 2, pad=True))
    short = tuple((a + 64, b + 64) for a, b in random_docs(n - 64, 3, max_len=40))
    yield "one-token documents among short ones", (tuple((t, t + 1) for t in range(64)) + short,)
    yield "one document", (((0, n),),)
    yield "one document + all-padding row", (((5, n - 7),), ())
    half = n // 2  # key lengths 64 mod 128 whole and across the shard boundary (192 tokens from n/2 - 64)
    yield TINY_LSE, (((0, 64), (64, half - 64), (half - 64, half + 128), (half + 128, n)),)


def bound(b_err: float, rounded_to_bf16: bool = False) -> float:
    """At most twice the error of the reference kernel on the same bf16 inputs, plus a floor: 1e-4, or 2e-3
    where the op writes bf16 (gradients: 2^-9 relative rounding, ~1.1e-3 rms) and the reference float32."""
    return 2 * b_err + (2e-3 if rounded_to_bf16 else 1e-4)


def inputs(b: int, n: int, h: int, hk: int, d: int, seed: int, device: torch.device, tiny_lse: bool = False):
    """Float64 q, k, v and the output gradient; ``tiny_lse``: every score near -40 * 40 / sqrt(d)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q, dout = (torch.randn(b, n, h, d, device=device, generator=g, dtype=torch.float64) for _ in "qd")
    k, v = (torch.randn(b, n, hk, d, device=device, generator=g, dtype=torch.float64) for _ in "kv")
    if tiny_lse:
        q[..., 0], k[..., 0] = -40.0, 40.0
    return q, k, v, dout


def unusable(backend: str, device: torch.device, d: int = 128) -> str | None:
    """Why ``backend`` cannot serve packed bf16 rows on ``device`` (None when it can)."""
    try:
        select_backend(backend, KernelRequest(device, torch.bfloat16, d, d, MaskKind.DOCUMENTS))
    except (ValueError, ImportError) as e:
        return str(e)
    return None


def reference(q, k, v, dout, seg: Segments, window: int | None = None) -> list:
    """Float64 output, lse and gradients of causal attention within the documents of ``seg``."""
    rng = local_key_range(*key_ranges(seg, causal=True, window=window, device=q.device), 0, q.shape[1])
    ref, scale = ReferenceKernel(block_q=1024, block_k=1024), q.shape[-1] ** -0.5
    out, lse = ref.forward(q, k, v, causal=False, scale=scale, key_range=rng)
    return [out, lse, *ref.backward(dout, q, k, v, out, lse, causal=False, scale=scale, key_range=rng)]


def attend(backend: str, q, k, v, dout, seg: Segments, rows: slice, group=None, window: int | None = None):
    """``dist_flash_attn`` in bf16 over ``rows`` of the float64 inputs: output, lse and gradients."""
    import lightseq_hf

    qs, ks, vs = (t[:, rows].bfloat16().requires_grad_() for t in (q, k, v))
    out, lse = lightseq_hf.dist_flash_attn(qs, ks, vs, segments=seg, window=window, backend=backend,
                                           return_lse=True, group=group)
    out.backward(dout[:, rows].bfloat16())
    return [out, lse, qs.grad, ks.grad, vs.grad]


def cases(backend: str, n: int):
    """(name, documents, window): every layout, and for the backend that takes windows two windowed ones."""
    for name, docs in layouts(n):
        yield name, docs, None
    if backend == "triton":
        yield "random lengths, window 700", (random_docs(n, 5),), 700
        yield "padding inside, window 900", (random_docs(n, 6, pad=True),), 900


def worker_packed(rank: int, world: int, backend: str) -> list[str]:
    """On GPU ``rank`` of ``world``: each case split over the ranks against the float64 reference, within
    twice the error of the same backend on one GPU over the whole rows (plus 1e-4)."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    failures = []
    n, h, hk, d = 4096 * world, 8, 2, 128
    solo = [torch.distributed.new_group([r]) for r in range(world)][rank]
    loc = slice(rank * n // world, (rank + 1) * n // world)
    for i, (name, docs, window) in enumerate(cases(backend, n)):
        seg = Segments(n, docs)
        q, k, v, dout = inputs(len(docs), n, h, hk, d, 20 + i, dev, tiny_lse=name == TINY_LSE)
        refs = [x[:, :, loc] if x.dim() == 3 else x[:, loc] for x in reference(q, k, v, dout, seg, window)]
        got = attend(backend, q, k, v, dout, seg, loc, window=window)
        whole = attend(backend, q, k, v, dout, seg, slice(0, n), solo, window)
        single = [x[:, :, loc] if x.dim() == 3 else x[:, loc] for x in whole]
        for label, x, s, r in zip(("out", "lse", "dq", "dk", "dv"), got, single, refs):
            err, limit = rel_err(x, r), 2 * rel_err(s, r) + 1e-4
            if not err <= limit:
                failures.append(f"[{backend}, {name}] rank {rank}: {label} rel err {err:.2e} > {limit:.2e}")
    return failures
