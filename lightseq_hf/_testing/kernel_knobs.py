"""Kernel knobs for the test suite and the benchmarks. Private: not API, may change without notice.

The library reads no environment variable for these; a test or benchmark calls the function it needs:

- :func:`single_triton_config`: each Triton attention kernel keeps only its first (default) autotune
  config, so a run compiles one variant per kernel (fast GPU tests).
- :func:`force_dkdv_split`: the ``triton`` backend splits the dk/dv kernel of key-range calls into a fixed
  number of parts instead of choosing per call (``None``: choose again).
"""

from __future__ import annotations


def single_triton_config() -> None:
    """Autotune the Triton attention kernels over their first config only (this process, from now on)."""
    from ..kernels import triton_bwd, triton_fwd

    for kernel in (triton_fwd._attn_fwd, triton_bwd._attn_bwd_dkdv, triton_bwd._attn_bwd_dq):
        kernel.configs = kernel.configs[:1]


def force_dkdv_split(parts: int | None) -> None:
    """Split the ``triton`` backend's dk/dv kernel of key-range calls into ``parts`` (None: per call)."""
    from ..kernels import kernel_named

    if parts is not None and parts < 1:
        raise ValueError(f"parts must be a positive count (or None); got {parts}.")
    kernel_named("triton").dkdv_split = parts
