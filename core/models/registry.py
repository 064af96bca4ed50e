"""The model families by name: `ModelConfig.family` -> its `Family` (`core.models.family`).

Each line names the module attribute that holds the family, imported on first use, so that
importing `core.config` stays cheap and no family module is imported by generic code. A new
family is one folder under `core/models/` and one line here.
"""

from __future__ import annotations

from typing import Any

from tessera.core.errors import ConfigError
from tessera.core.models.family import Family, import_named

_DECODER = "tessera.core.models.decoder.families"
FAMILIES: dict[str, str] = {
    "gpt2": f"{_DECODER}:GPT2",
    "llama": f"{_DECODER}:LLAMA",
    "nemotron": f"{_DECODER}:NEMOTRON",
    "qwen2": f"{_DECODER}:QWEN2",
    "qwen3": f"{_DECODER}:QWEN3",
    "phi3": f"{_DECODER}:PHI3",
    "olmo2": f"{_DECODER}:OLMO2",
    "gemma2": f"{_DECODER}:GEMMA2",
    "deepseek_v2": f"{_DECODER}:DEEPSEEK_V2",
    "deepseek_v3": f"{_DECODER}:DEEPSEEK_V3",
    "mixtral": f"{_DECODER}:MIXTRAL",
    "qwen2_moe": f"{_DECODER}:QWEN2_MOE",
    "qwen3_moe": f"{_DECODER}:QWEN3_MOE",
    "bert": "tessera.core.models.bert.family:BERT",
    "t5": "tessera.core.models.t5.family:T5",
    "scalenorm": "tessera.core.models.scalenorm.family:SCALENORM",
}

_loaded: dict[str, Family] = {}


def registered() -> list[str]:
    """Every family name, in registry order."""
    return list(FAMILIES)


def family(of: Any) -> Family:
    """The `Family` of a family name or of a config's `family` (raises `ConfigError` for an
    unknown one, listing the known)."""
    name = of if isinstance(of, str) else of.family
    found = _loaded.get(name)
    if found is not None:
        return found
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known families: "
                          f"{', '.join(FAMILIES)}")
    found = import_named(FAMILIES[name])
    if found.name != name:
        raise ConfigError(f"registry line {name!r} -> {FAMILIES[name]} holds family "
                          f"{found.name!r}; fix the line")
    _loaded[name] = found
    return found
