"""Model patches: sequence-parallel decoder-only causal LMs of Transformers 5.x."""

from .architectures import Architecture, UnsupportedModel, describe
from .model import patch, patch_llama, patch_model, unpatch, unpatch_llama
from .state import ATTN_IMPLEMENTATION, resolve_sp_group
from .trainer import data_parallel_coordinates, shard_by_data_parallel_rank

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Architecture",
    "UnsupportedModel",
    "data_parallel_coordinates",
    "describe",
    "patch",
    "patch_llama",
    "patch_model",
    "resolve_sp_group",
    "shard_by_data_parallel_rank",
    "unpatch",
    "unpatch_llama",
]
