"""Model patches: sequence-parallel Llama, Mistral, Qwen2 and Qwen3 causal LMs in Transformers 5.x."""

from .llama import (
    ARCHITECTURES,
    ATTN_IMPLEMENTATION,
    patch_llama,
    patch_model,
    resolve_sp_group,
    unpatch_llama,
)
from .trainer import data_parallel_coordinates, shard_by_data_parallel_rank

__all__ = [
    "ARCHITECTURES",
    "ATTN_IMPLEMENTATION",
    "data_parallel_coordinates",
    "patch_llama",
    "patch_model",
    "resolve_sp_group",
    "shard_by_data_parallel_rank",
    "unpatch_llama",
]
