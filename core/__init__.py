"""The shared model core: configs, the GPT model, parallel layers and rules, checkpoints."""

from tessera.core.checkpoint import load_checkpoint, save_checkpoint
from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
from tessera.core.init import build_model
from tessera.core.model import GPTModel
from tessera.core.parallel.groups import ParallelGroups, init_groups

__all__ = [
    "ConfigError",
    "GPTModel",
    "Layout",
    "ModelConfig",
    "ParallelGroups",
    "TrainSchedule",
    "build_model",
    "init_groups",
    "load_checkpoint",
    "save_checkpoint",
]
