"""Which module maps each model family to Hugging Face, by name, so the generic converters
import no family module: the family's `HfFamily` is imported on first use.

A new family's mapping is one line in `_FAMILIES` (its core family name -> `module:attribute`)
plus the HF model types it reads in `_MODEL_TYPES`.
"""

from __future__ import annotations

from tessera.converters.hf.family import ConversionError, HfFamily
from tessera.core.models.family import import_named

_P = "tessera.converters.hf."
_FAMILIES: dict[str, str] = {
    "gpt2": _P + "gpt2:GPT2",
    "llama": _P + "llama:LLAMA",
    "nemotron": _P + "nemotron:NEMOTRON",
    "qwen2": _P + "qwen2:QWEN2",
    "qwen3": _P + "qwen3:QWEN3",
    "phi3": _P + "phi3:PHI3",
    "olmo2": _P + "olmo2:OLMO2",
    "gemma2": _P + "gemma2:GEMMA2",
    "deepseek_v2": _P + "deepseek:DEEPSEEK_V2",
    "deepseek_v3": _P + "deepseek:DEEPSEEK_V3",
    "mixtral": _P + "moe:MIXTRAL",
    "qwen2_moe": _P + "moe:QWEN2_MOE",
    "qwen3_moe": _P + "moe:QWEN3_MOE",
    "bert": _P + "bert:BERT",
    "t5": _P + "t5:T5",
}

# HF `model_type` -> the family whose `config_from_hf` reads it (in the order error messages
# list them).
_MODEL_TYPES: dict[str, str] = {
    "gpt2": "gpt2", "llama": "llama", "mistral": "llama", "nemotron": "nemotron", "t5": "t5",
    "bert": "bert", "mixtral": "mixtral", "qwen2": "qwen2", "qwen2_moe": "qwen2_moe",
    "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "phi3": "phi3",
    "olmo2": "olmo2", "gemma2": "gemma2", "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
}


def mapped_families() -> tuple[str, ...]:
    """The families with a Hugging Face mapping."""
    return tuple(_FAMILIES)


def model_types() -> tuple[str, ...]:
    """The HF model types an import reads."""
    return tuple(_MODEL_TYPES)


def hf_family(family: str) -> HfFamily:
    """The Hugging Face mapping of `family`; ConversionError when it has none."""
    target = _FAMILIES.get(family)
    if target is None:
        raise ConversionError(f"family {family!r} has no Hugging Face mapping; families with "
                              f"one: {', '.join(_FAMILIES)}")
    found = import_named(target)
    if found.family != family:
        raise ConversionError(f"registry line {family!r} -> {target} holds the mapping of "
                              f"{found.family!r}; fix the line")
    return found


def family_of_model_type(model_type: str | None) -> str | None:
    """The family that reads HF `model_type`, or None."""
    return _MODEL_TYPES.get(model_type) if model_type is not None else None
