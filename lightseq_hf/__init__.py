"""lightseq_hf: DistFlashAttn sequence parallelism for Hugging Face Transformers.

The public surface is what ``__all__`` lists: patching a model (:func:`patch_llama`, :func:`patch_model`,
:func:`unpatch_llama`), the distributed attention (:func:`dist_flash_attn` with :class:`Segments` for
packed rows), the process groups (:func:`init_sequence_parallel`, :func:`current_groups`), the schedule
(:func:`build_schedule`), sharding helpers (:func:`pad_to_multiple`) and the checkpoint wrapper
(:func:`remat_checkpoint`), and the parity guard (:func:`check_parity`, :func:`sync_gradients`,
:class:`ParityCallback`). Everything else is internal; the local kernels and their contract live in
``lightseq_hf.kernels``. The fine-tune driver (``lightseq_hf.training``) needs ``pip install
lightseq_hf[train]``; this package imports without it.
"""

from .checkpoint import remat_checkpoint
from .guard import ParityError, check_parity, sync_gradients
from .notices import install_rank_zero_filter
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
from .patches import patch, patch_llama, patch_model, unpatch, unpatch_llama

install_rank_zero_filter()  # the library's notices are the same on every rank: printed by rank 0 only

__version__ = "0.1.0"

__all__ = [
    "ParallelGroups",
    "ParityCallback",
    "ParityError",
    "Segments",
    "build_schedule",
    "check_parity",
    "current_groups",
    "dist_flash_attn",
    "init_sequence_parallel",
    "pad_to_multiple",
    "patch",
    "patch_llama",
    "patch_model",
    "remat_checkpoint",
    "segments_from_hf",
    "sync_gradients",
    "unpatch",
    "unpatch_llama",
]


def __getattr__(name: str):
    if name == "ParityCallback":  # imports Transformers' Trainer: on first use only
        from .guard.callback import ParityCallback

        return ParityCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
