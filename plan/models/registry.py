"""Which planner model each family has, by name (keyed like `core.models.registry`), imported
on first use so that generic planner code imports no family module. The decoder-only families
share one entry, and so does BERT: an encoder layer runs the decoder layer's GEMMs and (full,
unmasked) attention, which the decoder's formulas count. A family without an entry is refused
with a message saying so.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tessera.core.config import ModelConfig
from tessera.plan.errors import PlanError

if TYPE_CHECKING:
    from tessera.plan.models.family import PlanFamily

_DECODER = "tessera.plan.models.decoder:DECODER"
_FAMILIES: dict[str, str] = {
    "gpt2": _DECODER, "llama": _DECODER, "nemotron": _DECODER, "qwen3": _DECODER,
    "mixtral": _DECODER, "qwen2_moe": _DECODER, "qwen3_moe": _DECODER, "bert": _DECODER,
    "t5": "tessera.plan.models.t5.family:T5",
}


def planned_families() -> tuple[str, ...]:
    """The families the planner models."""
    return tuple(_FAMILIES)


def plan_family(model: ModelConfig) -> PlanFamily:
    """The planner's model of `model`'s family; PlanError when the planner has none."""
    target = _FAMILIES.get(model.family)
    if target is None:
        raise PlanError(f"tessera plan does not model the {model.family} family (no planner "
                        f"formulas for it); it plans: {', '.join(_FAMILIES)}")
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)
