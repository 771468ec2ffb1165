"""lightseq_hf: DistFlashAttn sequence parallelism for Hugging Face Transformers."""

from .parallel import build_schedule, dist_flash_attn

__version__ = "0.1.0"

__all__ = ["build_schedule", "dist_flash_attn"]
