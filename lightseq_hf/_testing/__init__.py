"""Private hooks for the test suite and benchmarks: fault injection, kernel knobs, views of internal state
and trainer variants.

Nothing here is public API. It is the one internal surface that ``scripts/`` and ``tests/gpu/`` may use
besides the public names of ``lightseq_hf``: where they need what the library keeps private (Triton kernel
handles, a host buffer pool's free buffers, a trainer's gradient synchronisation), a function here
reaches it, and the CPU suite runs that function (``tests/test_script_surface.py``). The library never
reads an environment variable for these; tests and benchmarks call the functions in this package.

- :mod:`.faults`: kill, freeze or poison one rank of a real fine-tune.
- :mod:`.kernel_knobs`: the Triton kernels' handles and autotune configs, the dk/dv split, whether the
  cuDNN backward fell back to flash.
- :mod:`.views`: read-only views of internal state (the offloader's pooled host buffers).
- :mod:`.offload_cache`: the offloader's hand-back of a cached attention tensor, on the CPU.
- :mod:`.trainer_variants`: the fine-tune's trainer with one behaviour changed, for memory checks.
"""

__all__ = []
