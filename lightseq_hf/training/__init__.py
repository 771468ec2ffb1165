"""Fine-tuning: YAML config, data loading and packing, synthetic tasks, the accelerate loop."""

from .config import FinetuneConfig, config_from_dict, load_config
from .data import ParallelSampler, pack_token_lists
from .errors import ConfigError
from .synthetic import PasskeyDataset, PasskeySpec

__all__ = [
    "ConfigError", "FinetuneConfig", "ParallelSampler", "PasskeyDataset", "PasskeySpec", "config_from_dict",
    "load_config", "pack_token_lists",
]
