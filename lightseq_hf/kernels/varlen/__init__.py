"""The variable-length backends: packed documents as one vendor op call per task.

- :mod:`.rows`: the document blocks (:class:`~lightseq_hf.kernels.base.DocBlocks`) built from host lists,
  cut into the calls an op computes exactly, and the rows they feed gathered into the ops' packed
  ``(tokens, heads, dim)`` layout and written back; shared by both backends.
- :mod:`.flash`: ``flash_varlen``, torch's FlashAttention-2 variable-length kernels.
- :mod:`.cudnn`: ``cudnn_fe``, cuDNN's variable-length attention from the optional
  ``nvidia-cudnn-frontend`` package, with its graph shapes and the cuDNN versions it routes around.

The backends are built by name through :data:`lightseq_hf.kernels.REGISTRY`; nothing is imported here.
"""

__all__: list[str] = []
