"""lightseq_hf: DistFlashAttn sequence parallelism for Hugging Face Transformers."""

from .guard import ParityError, check_parity, sync_gradients
from .parallel import build_schedule, dist_flash_attn
from .parallel.sharding import pad_to_multiple
from .patches import patch_llama, patch_model, unpatch_llama

__version__ = "0.1.0"

__all__ = [
    "ParityCallback", "ParityError", "check_parity", "sync_gradients",
    "build_schedule", "dist_flash_attn", "pad_to_multiple", "patch_llama", "patch_model", "unpatch_llama",
]


def __getattr__(name: str):
    if name == "ParityCallback":  # imports Transformers' Trainer: on first use only
        from .guard.callback import ParityCallback

        return ParityCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
