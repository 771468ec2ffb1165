"""lightseq_hf: DistFlashAttn sequence parallelism for Hugging Face Transformers."""

from .parallel import build_schedule, dist_flash_attn
from .parallel.sharding import pad_to_multiple
from .patches import patch, patch_llama, patch_model, unpatch, unpatch_llama

__version__ = "0.1.0"

__all__ = [
    "build_schedule", "dist_flash_attn", "pad_to_multiple", "patch", "patch_llama", "patch_model", "unpatch",
    "unpatch_llama",
]
