"""The shared model core: configs, the GPT model, parallel layers and rules, checkpoints.

The names below are imported on first use (PEP 562), so that `import tessera.core.config` (a
parser, `--help`) or a spawned rank does not pay for torch and the model until it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module defining it
_EXPORTS = {
    "load_checkpoint": "tessera.core.checkpoint",
    "save_checkpoint": "tessera.core.checkpoint",
    "ConfigError": "tessera.core.config",
    "ModelConfig": "tessera.core.config",
    "Layout": "tessera.core.config",
    "TrainSchedule": "tessera.core.config",
    "build_model": "tessera.core.init",
    "GPTModel": "tessera.core.models.decoder.model",
    "ParallelGroups": "tessera.core.parallel.groups",
    "init_groups": "tessera.core.parallel.groups",
}

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

if TYPE_CHECKING:
    from tessera.core.checkpoint import load_checkpoint, save_checkpoint
    from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
    from tessera.core.init import build_model
    from tessera.core.models.decoder.model import GPTModel
    from tessera.core.parallel.groups import ParallelGroups, init_groups


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later lookups skip this function
        return value
    raise AttributeError(f"module 'tessera.core' has no attribute {name!r}")
