"""Test-only CPU emulation of the ``nvidia-cudnn-frontend`` torch ops ``cudnn::sdpa_fwd`` /
``cudnn::sdpa_bwd`` (their packed ``(tokens, heads, dim)`` path), registered as the ops' CPU kernels under the
package's own schemas, in float64, and put behind ``lightseq_hf.kernels.varlen.cudnn``.

It follows the ops' contract and checks the caller keeps it: ``cu_seqlens_q/kv`` int32 on the tensors'
device, lengths within ``max_seqlen_q/kv``, token totals within the tensors' rows, ``causal_bottom_right``
only with a causal mask or band, a band's left bound counting the row itself (``window_left >= 1``), the
forward's lse ``(T, H, 1)`` float32, the backward's lse padded ``(B, H, max_seqlen_q[, 1])`` float32 (float64
inputs: float64 throughout). What a caller must never read is NaN: rows past ``cu_seqlens[-1]``, and rows
that see no key (what cuDNN does with them is not part of its contract). Graphs are counted as the op keys
its cache (``graphs``; a build appends ``builds``). ``nan_dq_hazard`` reproduces the cuDNN defect the
backend routes around: NaN dQ rows where a sequence's key length is 64 mod 128 and the row's lse is below
-88.7.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

FWD_SCHEMA = (
    "sdpa_fwd(Tensor q, Tensor k, Tensor v, float attn_scale, "
    "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
    "Tensor? sinks=None, "
    "Tensor? seq_len_q=None, Tensor? seq_len_kv=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
    "int max_seqlen_q=0, int max_seqlen_kv=0, "
    "bool return_lse=True) -> (Tensor, Tensor)"
)
BWD_SCHEMA = (
    "sdpa_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, float attn_scale, "
    "bool is_causal=False, bool causal_bottom_right=False, int window_left=-1, int window_right=-1, "
    "Tensor? sinks=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_kv=None, "
    "int max_seqlen_q=0, int max_seqlen_kv=0, "
    "bool is_deterministic=False) -> (Tensor, Tensor, Tensor)"
)
HALF = (torch.float16, torch.bfloat16)
CACHE_LIMIT = 128  # the op's graph cache


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _sequences(cu_q, cu_k, q, k, max_q, max_k):
    for cu, x in ((cu_q, q), (cu_k, k)):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == x.device, (cu.dtype, cu.device)
    assert cu_q.numel() == cu_k.numel() >= 2
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert cq[0] == ck[0] == 0 and cq == sorted(cq) and ck == sorted(ck)
    assert cq[-1] <= q.shape[0] and ck[-1] <= k.shape[0], "token totals beyond the tensors' rows"
    seqs = list(zip(cq, cq[1:], ck, ck[1:]))
    assert all(b - a <= max_q and d - c <= max_k for a, b, c, d in seqs), "a sequence exceeds max_seqlen"
    return seqs


def _visible(m, n, causal, bottom_right, window_left, window_right):
    """``(m, n)`` bool: the op's mask of one sequence (a band around the diagonal, aligned as asked)."""
    i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
    diag = i + (n - m if bottom_right else 0)
    seen = torch.ones(m, n, dtype=torch.bool)
    right = 0 if causal else (window_right if window_right >= 0 else None)
    if right is not None:
        seen &= j <= diag + right
    if window_left >= 0:
        assert window_left >= 1, "the band's left bound counts the row itself: window_left >= 1"
        seen &= j > diag - window_left
    return seen


def _storages(*tensors: torch.Tensor) -> tuple[int, ...]:
    """Where each tensor's storage is (a tensor and the views of it share one)."""
    return tuple(t.untyped_storage().data_ptr() for t in tensors)


class Emulation:
    """The two ops; ``calls`` records each call's sequences and shape, the storages of its tensor arguments
    (``storages``: forward q, k, v; backward grad_out, q, k, v, o) and of its results (``results``),
    ``graphs`` the op's cache keys."""

    def __init__(self, cudnn_version: int = 91900, nan_dq_hazard: bool = False) -> None:
        self.cudnn_version, self.nan_dq_hazard = cudnn_version, nan_dq_hazard
        self.calls: list[dict] = []
        self.graphs: dict[tuple, None] = {}
        self.builds = 0

    def _graph(self, key: tuple) -> None:
        if key not in self.graphs:
            self.builds += 1
            self.graphs[key] = None
            while len(self.graphs) > CACHE_LIMIT:
                self.graphs.pop(next(iter(self.graphs)))

    def _check(self, q, k, v, is_causal, bottom_right, window_left, window_right):
        assert q.dim() == k.dim() == v.dim() == 3 and q.dtype == k.dtype == v.dtype
        assert q.dtype in HALF or q.dtype in (torch.float32, torch.float64), q.dtype
        assert all(t.is_contiguous() for t in (q, k, v)) and q.shape[1] % k.shape[1] == 0
        assert k.shape[1] == v.shape[1] and k.shape[0] == v.shape[0]
        if bottom_right:
            assert is_causal or window_left >= 0 or window_right >= 0, "bottom-right needs a diagonal"
        assert not (is_causal and window_right > 0)

    def _scores(self, q, k, a, b, c, d, scale, mask_args):
        group = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[c:d].double().repeat_interleave(group, 1))
        seen = _visible(b - a, d - c, *mask_args)
        return (s * scale).masked_fill(~seen, -math.inf), seen.any(1)

    def forward(self, q, k, v, attn_scale, is_causal=False, causal_bottom_right=False, window_left=-1,
                window_right=-1, sinks=None, seq_len_q=None, seq_len_kv=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0, return_lse=True):
        self._check(q, k, v, is_causal, causal_bottom_right, window_left, window_right)
        assert sinks is None and seq_len_q is None and seq_len_kv is None and return_lse
        seqs = _sequences(cu_seqlens_q, cu_seqlens_kv, q, k, max_seqlen_q, max_seqlen_kv)
        mask_args = (is_causal, causal_bottom_right, window_left, window_right)
        self._record("forward", seqs, q, k, max_seqlen_q, max_seqlen_kv, is_causal, causal_bottom_right)
        self._graph(("sdpa_fwd", q.dtype, len(seqs), q.shape[1], k.shape[1], v.shape[1], max_seqlen_q,
                     max_seqlen_kv, q.shape[2], v.shape[2], attn_scale, *mask_args))
        h, group = q.shape[1], q.shape[1] // k.shape[1]
        stats_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.full((q.shape[0], h, v.shape[2]), math.nan, dtype=q.dtype)
        stats = torch.full((q.shape[0], h, 1), math.nan, dtype=stats_dtype)
        for a, b, c, d in seqs:
            if b == a:
                continue
            s, any_key = self._scores(q, k, a, b, c, d, attn_scale, mask_args)
            lse = torch.logsumexp(s, -1)  # (h, m)
            p = torch.exp(s - lse[..., None])
            o = torch.einsum("hqk,khd->qhd", p, v[c:d].double().repeat_interleave(group, 1))
            o[~any_key] = math.nan  # not part of the contract: a caller must not feed such rows
            lse[:, ~any_key] = math.nan
            out[a:b], stats[a:b, :, 0] = o.to(q.dtype), lse.t().to(stats_dtype)
        self.calls[-1]["storages"] = _storages(q, k, v)
        self.calls[-1]["results"] = _storages(out, stats)
        return out, stats

    def backward(self, grad_out, q, k, v, o, lse, attn_scale, is_causal=False, causal_bottom_right=False,
                 window_left=-1, window_right=-1, sinks=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                 max_seqlen_q=0, max_seqlen_kv=0, is_deterministic=False):
        self._check(q, k, v, is_causal, causal_bottom_right, window_left, window_right)
        assert sinks is None and grad_out.shape == o.shape == (q.shape[0], q.shape[1], v.shape[2])
        assert grad_out.dtype == o.dtype == q.dtype and grad_out.is_contiguous() and o.is_contiguous()
        seqs = _sequences(cu_seqlens_q, cu_seqlens_kv, q, k, max_seqlen_q, max_seqlen_kv)
        h = q.shape[1]
        assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32), lse.dtype
        assert lse.is_contiguous() and lse.shape in ((len(seqs), h, max_seqlen_q),
                                                     (len(seqs), h, max_seqlen_q, 1)), lse.shape
        lse = lse.reshape(len(seqs), h, max_seqlen_q).double()
        mask_args = (is_causal, causal_bottom_right, window_left, window_right)
        self._record("backward", seqs, q, k, max_seqlen_q, max_seqlen_kv, is_causal, causal_bottom_right)
        self._graph(("sdpa_bwd", q.dtype, len(seqs), h, k.shape[1], v.shape[1], _round64(q.shape[0]),
                     _round64(k.shape[0]), max_seqlen_q, max_seqlen_kv, q.shape[2], v.shape[2], attn_scale,
                     *mask_args, is_deterministic))
        grads = [torch.full(t.shape, math.nan, dtype=torch.float64) for t in (q, k, v)]
        for i, (a, b, c, d) in enumerate(seqs):
            grads[1][c:d] = grads[2][c:d] = 0
            if b > a:
                self._sequence_backward(grads, grad_out, q, k, v, o, lse[i, :, :b - a], attn_scale,
                                        mask_args, (a, b, c, d))
        grads = tuple(g.to(q.dtype) for g in grads)
        self.calls[-1]["storages"] = _storages(grad_out, q, k, v, o)
        self.calls[-1]["results"] = _storages(*grads)
        return grads

    def _sequence_backward(self, grads, grad_out, q, k, v, o, lse, scale, mask_args, seq):
        a, b, c, d = seq
        group, hk = q.shape[1] // k.shape[1], k.shape[1]
        s, _ = self._scores(q, k, a, b, c, d, scale, mask_args)
        p = torch.exp(s - lse[..., None])
        do = grad_out[a:b].double()
        delta = (do * o[a:b].double()).sum(-1).t()  # from o, as the op does
        ve = v[c:d].double().repeat_interleave(group, 1)
        ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - delta[..., None]) * scale
        dq = torch.einsum("hqk,khd->qhd", ds, k[c:d].double().repeat_interleave(group, 1))
        if self.nan_dq_hazard and (d - c) % 128 == 64:
            dq[(lse < -88.7).any(0)] = math.nan
        grads[0][a:b] = dq
        grads[1][c:d] = torch.einsum("hqk,qhd->khd", ds, q[a:b].double()).view(d - c, hk, group, -1).sum(2)
        grads[2][c:d] = torch.einsum("hqk,qhd->khd", p, do).view(d - c, hk, group, -1).sum(2)

    def _record(self, op, seqs, q, k, max_q, max_k, causal, bottom_right):
        self.calls.append({"op": op, "q_lens": tuple(b - a for a, b, _, _ in seqs),
                           "k_lens": tuple(d - c for _, _, c, d in seqs), "max_q": max_q, "max_k": max_k,
                           "rows": q.shape[0], "keys": k.shape[0], "heads": q.shape[1],
                           "kv_heads": k.shape[1], "causal": causal, "bottom_right": bottom_right})


_active: list[Emulation] = []
_library: list = []


def _register() -> None:
    """The emulation as the CPU kernels of ``cudnn::sdpa_fwd`` / ``sdpa_bwd`` (defined here under the
    package's schemas unless the package defined them), once per process."""
    if _library:
        return
    lib = torch.library.Library("cudnn", "FRAGMENT")
    for schema in (FWD_SCHEMA, BWD_SCHEMA):
        if not hasattr(torch.ops.cudnn, schema.split("(")[0]):
            lib.define(schema)
    lib.impl("sdpa_fwd", lambda *a, **kw: _active[-1].forward(*a, **kw), "CPU")
    lib.impl("sdpa_bwd", lambda *a, **kw: _active[-1].backward(*a, **kw), "CPU")
    _library.append(lib)


def install(setattr_=setattr, cudnn_version: int = 91900, nan_dq_hazard: bool = False) -> Emulation:
    """Put an :class:`Emulation` behind the ``cudnn_fe`` backend (``setattr_``: ``monkeypatch.setattr`` in
    pytest, plain ``setattr`` in spawned workers) with fresh graph shapes, and make the backend selectable
    off CUDA in float32/float64 (its declared capabilities widened to what the emulation takes)."""
    from lightseq_hf.kernels.varlen import cudnn as cudnn_fe

    _register()
    emu = Emulation(cudnn_version, nan_dq_hazard)
    _active.append(emu)
    ops = cudnn_fe.OpSet(torch.ops.cudnn.sdpa_fwd, torch.ops.cudnn.sdpa_bwd, emu.graphs, cudnn_version)
    caps = cudnn_fe.CudnnFeKernel.capabilities
    setattr_(cudnn_fe.CudnnFeKernel, "capabilities",
             replace(caps, devices=None, dtypes=caps.dtypes | {torch.float32, torch.float64}))
    setattr_(cudnn_fe, "load_ops", lambda: ops)
    setattr_(cudnn_fe, "_loaded", {})
    setattr_(cudnn_fe, "_shapes", cudnn_fe.GraphShapes())
    return emu


def distributed_check(rank: int, world: int) -> list[str]:
    """In a spawned gloo worker: ``dist_flash_attn(backend="cudnn_fe")`` over packed rows (emulated op,
    float64) against the per-document reference, with one forward op call per scheduled task of this rank;
    documents with key lengths 64 mod 128 and the emulated NaN-dQ defect included."""
    from doc_reference import packed_distributed_runs, random_docs

    from lightseq_hf.parallel.segment_schedule import build_segment_schedule

    emu = install(nan_dq_hazard=True)
    n_local = 160
    n = n_local * world
    gen = torch.Generator().manual_seed(70 + world)
    mixed = random_docs(gen, 2, n, max_len=40)
    # a document of 64 tokens in one shard; one of 192 whose first 64 are the keys of the next shard's rows
    hazard = ((0, 3), (3, 67), (67, 96), (96, 288), (288, n))
    cases = [("random lengths", mixed, True), ("non-causal", mixed, False),
             ("key lengths 64 mod 128, tiny lse", (hazard,), True),
             ("one document", (((0, n),), ((1, n),)), True)]
    failures = []

    def scores_far_below_exp_range(name, q, k):
        if "tiny" in name:  # scores far below -88.7: the rows' lse too
            q[..., 0], k[..., 0] = -40.0, 40.0

    runs = packed_distributed_runs(rank, world, n_local, cases, backend="cudnn_fe", seed=500,
                                   before_run=emu.calls.clear, adjust=scores_far_below_exp_range)
    for name, causal, seg, errors in runs:
        failures += [f"cudnn_fe world {world} rank {rank} [{name}]: {label} err {err:.2e}"
                     for label, err in errors.items() if not err < 1e-10]
        mine = sum(step[rank] is not None for step in build_segment_schedule(world, seg, causal).steps)
        forwards = [c for c in emu.calls if c["op"] == "forward"]
        backwards = [c for c in emu.calls if c["op"] == "backward"]
        if len(forwards) != mine or len(backwards) != mine:
            failures.append(f"cudnn_fe world {world} rank {rank} [{name}]: {len(forwards)} forward and "
                            f"{len(backwards)} backward calls for {mine} tasks")
        if any(n % 128 == 64 for c in backwards for n in c["k_lens"]):
            failures.append(f"cudnn_fe world {world} rank {rank} [{name}]: a backward key length 64 mod 128")
        dropped = sum(sum(c["k_lens"]) for c in forwards) - sum(sum(c["k_lens"]) for c in backwards)
        if "tiny" in name and rank == 0 and not dropped:  # first keys computed beside the op
            failures.append(f"cudnn_fe world {world} rank 0 [{name}]: the 64-token document was not split")
    return failures
