"""The T5 family's registry entry (`core.models.registry`)."""

from __future__ import annotations

from types import MappingProxyType

from tessera.core.config import ModelConfig
from tessera.core.models.family import Family, Lazy
from tessera.core.models.t5.layout import t5_layout_problems, t5_stage_layers
from tessera.core.models.t5.options import T5Options

_HERE = "tessera.core.models.t5"


def stage_layers(config: ModelConfig, stage_id: int, num_stages: int) -> tuple[range, range]:
    """(encoder layers, decoder layers) of stage `stage_id` (`layout.t5_stage_layers`)."""
    return t5_stage_layers(stage_id, num_stages, config)


T5 = Family(
    name="t5",
    stage_class=Lazy(f"{_HERE}.model:T5Model"),
    param_shapes=Lazy(f"{_HERE}.sharding:t5_param_shapes"),
    shard_spec=Lazy(f"{_HERE}.sharding:t5_shard_spec"),
    init_tensor=Lazy(f"{_HERE}.init:init_t5_tensor"),
    stage_layers=stage_layers,
    layout_problems=t5_layout_problems,  # encoder and decoder share out the stages
    objective="span-corruption",
    traits=MappingProxyType(dict(norm="rmsnorm", position="relative", bias=False)),
    lora_modules=Lazy(f"{_HERE}.sharding:t5_lora_modules"),
    transformer_engine=False,
    options=T5Options,
)
