"""Kernel knobs for the test suite and the benchmarks. Private: not API, may change without notice.

The library reads no environment variable for these; a test or benchmark calls the function it needs:

- :func:`single_triton_config`: each Triton attention kernel keeps only its first (default) autotune
  config, so a run compiles one variant per kernel (fast GPU tests).
- :func:`force_dkdv_split`: the ``triton`` backend splits the dk/dv kernel of key-range calls into a fixed
  number of parts instead of choosing per call (``None``: choose again).
- :func:`triton_kernels`: the Triton kernels themselves, for compile checks and resource reports.
- :func:`cudnn_backward_fell_back`: whether the ``sdpa_cudnn`` backend's backward has switched to flash.
- :func:`cudnn_fe_op_calls`: the calls the ``cudnn_fe`` backend makes to the nvidia-cudnn-frontend ops.
- :func:`cudnn_fe_unloaded`: the ``cudnn_fe`` backend with that package not yet loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

__all__ = [
    "AUTOTUNED", "cudnn_backward_fell_back", "cudnn_fe_op_calls", "cudnn_fe_unloaded", "force_dkdv_split",
    "single_triton_config", "triton_kernels",
]

#: the autotuned Triton attention kernels, by name
AUTOTUNED = ("fwd", "dkdv", "dq")


def triton_kernels() -> dict[str, Any]:
    """The Triton attention kernels by name: ``fwd``, ``dkdv`` and ``dq`` are autotuned (``.fn`` the jit
    function, ``.configs`` its configs, ``.cache`` the choices made so far); ``delta`` is a jit function."""
    from ..kernels import triton_bwd, triton_fwd

    return {"fwd": triton_fwd._attn_fwd, "dkdv": triton_bwd._attn_bwd_dkdv, "dq": triton_bwd._attn_bwd_dq,
            "delta": triton_bwd._delta_kernel}


def single_triton_config() -> None:
    """Autotune the Triton attention kernels over their first config only (this process, from now on)."""
    kernels = triton_kernels()
    for name in AUTOTUNED:
        kernels[name].configs = kernels[name].configs[:1]


def force_dkdv_split(parts: int | None) -> None:
    """Split the ``triton`` backend's dk/dv kernel of key-range calls into ``parts`` (None: per call)."""
    from ..kernels import kernel_named

    if parts is not None and parts < 1:
        raise ValueError(f"parts must be a positive count (or None); got {parts}.")
    kernel_named("triton").dkdv_split = parts


def cudnn_backward_fell_back() -> bool:
    """True once the ``sdpa_cudnn`` backend's backward failed in this process and switched to the flash
    backward (it warns once when it does)."""
    from ..kernels import kernel_named

    return bool(kernel_named("sdpa_cudnn")._cudnn_backward_failed)


@contextmanager
def cudnn_fe_op_calls() -> Iterator[list[dict]]:
    """Inside, every call of the ``cudnn_fe`` backend to the nvidia-cudnn-frontend ops is recorded as
    ``{"op": "forward" | "backward", "k_lens": the key length of every sequence}`` (a host read of its
    ``cu_seqlens_kv``) in the list it yields. The ops must be loadable (``cudnn_fe.ops()``)."""
    from ..kernels.varlen import cudnn as cudnn_fe

    ops, calls = cudnn_fe.ops(), []

    def recording(kind: str, op):
        def call(*args, **kw):
            cu = kw["cu_seqlens_kv"]
            calls.append({"op": kind, "k_lens": tuple((cu[1:] - cu[:-1]).tolist())})
            return op(*args, **kw)
        return call

    cudnn_fe._loaded["ops"] = replace(ops, forward=recording("forward", ops.forward),
                                      backward=recording("backward", ops.backward))
    try:
        yield calls
    finally:
        cudnn_fe._loaded["ops"] = ops


@contextmanager
def cudnn_fe_unloaded() -> Iterator[None]:
    """Inside, the ``cudnn_fe`` backend has not loaded the nvidia-cudnn-frontend package yet: its next use
    calls ``cudnn_fe.load_ops`` (replace that to see how a failed load is reported). What it had loaded
    comes back when the block ends."""
    from ..kernels.varlen import cudnn as cudnn_fe

    saved = dict(cudnn_fe._loaded)
    cudnn_fe._loaded.clear()
    try:
        yield
    finally:
        cudnn_fe._loaded.clear()
        cudnn_fe._loaded.update(saved)
