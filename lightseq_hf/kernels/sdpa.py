"""torch's fused SDPA kernels (cuDNN or FlashAttention-2) behind the kernel contract.

These aten ops return the log-sum-exp and their backward accepts an out and lse, which
is all the distributed loop needs. They have no accumulate mode (a separate merge runs
after each chunk) and need ``out`` itself in backward (not just ``delta``). GQA key/value
heads go to the ops as they are (cuDNN and FlashAttention-2 read each group's key/value
head in place and return its summed gradient), which keeps the step's largest GQA
temporaries (keys and values repeated to every query head, and their per-head
gradients) out of memory. A torch whose op refuses unequal head counts gets them
expanded for the duration of one call, with one warning.
"""

from __future__ import annotations

import warnings

import torch

from .base import Capabilities, KernelBase
from .row_stats import merge_into
from .working_memory import BackwardMemory, Workspace

__all__ = ["FLAVORS", "SdpaKernel", "sdpa_backward", "sdpa_forward"]

FLAVORS = ("cudnn", "flash")


# --- the ops (the kernel contract test replaces these two with a CPU emulation) -------------------------

def sdpa_forward(flavor: str, qt, kt, vt, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of torch's fused op in the ``(batch, heads, seq, dim)`` layout; cuDNN's lse may come
    as ``(batch, heads, seq, 1)``."""
    if flavor == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def sdpa_backward(flavor: str, dot, qt, kt, vt, ot, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` of torch's fused op (``lse`` in the layout its forward returned)."""
    lq, lk = qt.shape[2], kt.shape[2]
    empty = torch.empty(0, device=qt.device)
    if flavor == "cudnn":
        # None stands for the undefined tensors the forward returns (no bias, not nested).
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, ot, lse, empty, empty, None, None, None, lq, lk, 0.0, causal, scale=scale
        )[:3]
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dot, qt, kt, vt, ot, lse, None, None, lq, lk, 0.0, causal, empty, empty, scale=scale
    )[:3]


class SdpaKernel(KernelBase):
    """Local attention through ``aten._scaled_dot_product_{cudnn,flash}_attention``."""

    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dim_multiple=8,
        max_head_dim=256,
        needs_out_in_backward=True,
        # dq/dk/dv in the input dtype (GQA key/value heads read in place, so dk/dv are the key/value
        # heads' size); under GQA two float32 query-sized tensors (each query head's dk/dv before the sum
        # over its group), fitted to the measured peaks of
        # benchmarks/results/bytes-per-token-h100-x1-2026-11-26-8b*.json and within 5% of
        # bytes-per-token-h200-x1-2026-11-28-8b-4-layers.json (without GQA none: the committed 7B peaks
        # leave no room for one)
        backward_memory=BackwardMemory("SDPA kernel", partials="input", workspace=(
            Workspace("dq/dk/dv (compute dtype)", "qkv"),
            Workspace("GQA backward workspace (float32)", "q", "float32", 2, "gqa"))),
    )

    def __init__(self, flavor: str = "cudnn") -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"unknown SDPA flavor {flavor!r}; choose one of {', '.join(FLAVORS)}.")
        self.flavor = flavor
        self.name = f"sdpa_{flavor}"
        self._cudnn_backward_failed = False
        self._lse_ndim = 4  # cuDNN's (b, h, s, 1) layout until a forward reports its own
        self.native_gqa = True  # False once an op refused unequal query and key/value head counts

    @staticmethod
    def _check(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
        if causal and q.shape[1] != k.shape[1]:
            raise ValueError(
                "the SDPA backends align causal masks top-left, which differs from this library's "
                "bottom-right rule when q_len != kv_len; use backend='triton' or 'reference'."
            )

    @staticmethod
    def _expand(t: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
        group = heads // t.shape[dim]
        return t if group == 1 else t.repeat_interleave(group, dim=dim)

    def _refused_gqa(self, err: RuntimeError, where: str) -> None:
        """Record that this torch's op refused GQA heads (never an out-of-memory, which is re-raised)."""
        if isinstance(err, torch.OutOfMemoryError):
            raise err
        warnings.warn(f"torch's {self.flavor} attention {where} refused unequal query and key/value head "
                      f"counts ({err}); expanding key/value heads for every call, which costs two "
                      "query-sized tensors more in the backward.", stacklevel=4)
        self.native_gqa = False

    def _forward(self, q, k, v, mask, *, scale, out, lse):
        self._check(q, k, mask.causal)
        h = q.shape[2]
        res = None
        if self.native_gqa or k.shape[2] == h:
            try:
                res = sdpa_forward(self.flavor, *(x.transpose(1, 2) for x in (q, k, v)), mask.causal, scale)
            except RuntimeError as err:
                if k.shape[2] == h:
                    raise
                self._refused_gqa(err, "forward")
        if res is None:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, self._expand(k, h), self._expand(v, h)))
            res = sdpa_forward(self.flavor, qt, kt, vt, mask.causal, scale)
        res_out, res_lse = res
        chunk_out = res_out.transpose(1, 2)
        self._lse_ndim = res_lse.dim()  # cuDNN may return (b, h, s, 1); its backward wants the same
        chunk_lse = res_lse.reshape(q.shape[0], h, q.shape[1]).float()
        if out is None:
            return chunk_out, chunk_lse
        merge_into(out, lse, chunk_out, chunk_lse)
        return out, lse

    def _op_backward(self, dot, qt, kt, vt, ot, lse, causal, scale):
        if self.flavor == "cudnn" and not self._cudnn_backward_failed:
            stats = lse.unsqueeze(-1) if self._lse_ndim == 4 else lse
            try:
                return sdpa_backward("cudnn", dot, qt, kt, vt, ot, stats, causal, scale)
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, TypeError) as err:  # an aten signature this torch does not take
                warnings.warn(f"cuDNN attention backward failed ({err}); using the flash backward, "
                              "which takes the same out and lse.", stacklevel=3)
                self._cudnn_backward_failed = True
        return sdpa_backward("flash", dot, qt, kt, vt, ot, lse, causal, scale)

    def _native_backward(self, dot, qt, kt, vt, ot, lse, causal, scale):
        """``(dq, dk, dv)`` with key/value heads read in place (dk/dv per key/value head), or None when
        this torch's op refuses unequal head counts."""
        try:
            return self._op_backward(dot, qt, kt, vt, ot, lse, causal, scale)
        except RuntimeError as err:
            self._refused_gqa(err, "backward")
            return None

    def _expanded_backward(self, dot, qt, kt, vt, ot, lse, causal, scale):
        """``(dq, dk, dv)`` through key/value heads repeated to every query head; each key/value head's
        gradient sums over its group in float32 (float64 for float64 inputs)."""
        h, hk = qt.shape[1], kt.shape[1]
        gq, gk, gv = self._op_backward(dot, qt, self._expand(kt, h, dim=1), self._expand(vt, h, dim=1), ot,
                                       lse, causal, scale)
        if h == hk:
            return gq, gk, gv
        acc = torch.float64 if qt.dtype == torch.float64 else torch.float32
        b, _, lk, d = kt.shape
        return (gq, *(g.reshape(b, hk, h // hk, lk, d).sum(2, dtype=acc) for g in (gk, gv)))

    def _backward(self, dout, q, k, v, out, lse, mask, *, scale, delta, dq, dk, dv):
        self._check(q, k, mask.causal)
        if out is None:
            raise ValueError("the SDPA backends need the attention output in backward (not only delta).")
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, out.to(q.dtype), dout.to(q.dtype)))
        args = (dot, qt, kt, vt, ot, lse.float().contiguous(), mask.causal, scale)
        grads = None
        if self.native_gqa and k.shape[2] != q.shape[2]:
            grads = self._native_backward(*args)
        if grads is None:
            grads = self._expanded_backward(*args)
        result = []
        for given, computed in zip((dq, dk, dv), grads):
            computed = computed.transpose(1, 2)
            if given is None:
                result.append(computed)  # the input dtype (float32 for expanded GQA key/value heads)
            else:
                given += computed  # one pass: bf16 read, float32 accumulate
                result.append(given)
        return tuple(result)
