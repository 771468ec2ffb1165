"""Fine-tuning: YAML config, data loading and packing, synthetic tasks, the accelerate loop."""

from .config import ConfigError, FinetuneConfig, config_from_dict, load_config
from .data import ParallelSampler, pack_token_lists
from .synthetic import PasskeyDataset, PasskeySpec

__all__ = [
    "ConfigError", "FinetuneConfig", "ParallelSampler", "PasskeyDataset", "PasskeySpec", "config_from_dict",
    "load_config", "pack_token_lists",
]
