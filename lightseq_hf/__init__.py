"""lightseq_hf: DistFlashAttn sequence parallelism for Hugging Face Transformers."""

from .guard import ParityError, check_parity, sync_gradients
from .parallel import build_schedule, dist_flash_attn
from .parallel.sharding import pad_to_multiple
from .patches import patch_llama, patch_model, unpatch_llama

__version__ = "0.1.0"

__all__ = [
    "ParityError", "check_parity", "sync_gradients",
    "build_schedule", "dist_flash_attn", "pad_to_multiple", "patch_llama", "patch_model", "unpatch_llama",
]
