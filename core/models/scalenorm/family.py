"""The ScaleNorm family's registry entry: the decoder with `norm.ScaleNorm` as every norm."""

from __future__ import annotations

from tessera.core.config import ModelConfig
from tessera.core.models.decoder.families import decoder_family
from tessera.core.models.family import Lazy


def norm_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One ScaleNorm's parameters: its scalar scale."""
    return {"scale": (1,)}


SCALENORM = decoder_family("scalenorm", norm=Lazy("tessera.core.models.scalenorm.norm:ScaleNorm"),
                           norm_shapes=norm_shapes, traits=dict(position="rope"))
