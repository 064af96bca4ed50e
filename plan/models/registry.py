"""Which planner model each family has, by name (keyed like `core.models.registry`), imported
on first use so that generic planner code imports no family module. Every family built on the
decoder's stage (`core.models.decoder`: GPT-2, Llama, the MoE families, one that only swaps the
norm, ...) gets the decoder's model without a line here; BERT shares it too, as an encoder
layer runs the decoder layer's GEMMs and (full, unmasked) attention, which the decoder's
formulas count. Any other family without a line is refused with a message saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.core.config import ModelConfig
from tessera.core.models.family import import_named
from tessera.core.models.registry import family as core_family
from tessera.core.models.registry import registered
from tessera.plan.errors import PlanError

if TYPE_CHECKING:
    from tessera.plan.models.family import PlanFamily

_DECODER = "tessera.plan.models.decoder:DECODER"
_DECODER_STAGE = "tessera.core.models.decoder.model:GPTModel"
# Families whose planner model is not found from their stage.
_FAMILIES: dict[str, str] = {
    "bert": _DECODER,
    "t5": "tessera.plan.models.t5.family:T5",
}


def _target(family: str) -> str | None:
    if family in _FAMILIES:
        return _FAMILIES[family]
    if family in registered() and core_family(family).stage_class.path == _DECODER_STAGE:
        return _DECODER
    return None


def planned_families() -> tuple[str, ...]:
    """The families the planner models, in the core registry's order."""
    return tuple(f for f in registered() if _target(f) is not None)


def plan_family(model: ModelConfig) -> PlanFamily:
    """The planner's model of `model`'s family; PlanError when the planner has none."""
    target = _target(model.family)
    if target is None:
        raise PlanError(f"tessera plan does not model the {model.family} family (no planner "
                        f"formulas for it); it plans: {', '.join(planned_families())}")
    return import_named(target)
