"""lightseq_hf: DistFlashAttn sequence parallelism for Hugging Face Transformers.

The public surface is what ``__all__`` lists: patching a model (:func:`patch_llama`, :func:`patch_model`,
:func:`unpatch_llama`), the distributed attention (:func:`dist_flash_attn` with :class:`Segments` for
packed rows), the process groups (:func:`init_sequence_parallel`, :func:`current_groups`), the schedule
(:func:`build_schedule`), sharding helpers (:func:`pad_to_multiple`) and the checkpoint wrapper
(:func:`remat_checkpoint`). Everything else is internal; the local kernels and their contract live in
``lightseq_hf.kernels``. The fine-tune driver (``lightseq_hf.training``) needs ``pip install
lightseq_hf[train]``; this package imports without it.
"""

from .checkpoint import remat_checkpoint
from .parallel import (
    ParallelGroups,
    Segments,
    build_schedule,
    current_groups,
    dist_flash_attn,
    init_sequence_parallel,
    segments_from_hf,
)
from .parallel.sharding import pad_to_multiple
from .patches import patch_llama, patch_model, unpatch_llama

__version__ = "0.1.0"

__all__ = [
    "ParallelGroups",
    "Segments",
    "build_schedule",
    "current_groups",
    "dist_flash_attn",
    "init_sequence_parallel",
    "pad_to_multiple",
    "patch_llama",
    "patch_model",
    "remat_checkpoint",
    "segments_from_hf",
    "unpatch_llama",
]
