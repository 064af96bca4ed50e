"""The decoder's initialization: each global parameter drawn whole from its own generator,
seeded from the run seed and its name (`core.init` slices it for a rank)."""

from __future__ import annotations

import math
import zlib

import torch

from tessera.core.config import ModelConfig
from tessera.core.parallel.sharding import global_param_shapes


def init_decoder_tensor(name: str, config: ModelConfig, seed: int,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 initial value of global parameter `name` for run seed `seed`: norm weights 1
    (LayerNorm1P and RMSNorm1P store weight - 1: 0), biases 0, every other weight normal with std
    `init_std`, the residual projections scaled down by sqrt(2 x layers) as GPT-2 does."""
    shape = global_param_shapes(config)[name]
    leaf = name.rsplit(".", 1)[-1]
    is_norm = name.startswith("norm.") or "_norm." in name
    if leaf in ("bias", "expert_bias"):
        return torch.zeros(shape, device=device)
    if is_norm:  # LayerNorm1P stores weight - 1
        offset = config.norm in ("layernorm1p", "rmsnorm1p")
        return torch.full(shape, 0.0 if offset else 1.0, device=device)
    std = config.init_std
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2",
                      "shared_expert.w2.weight")):
        std /= math.sqrt(2 * config.num_layers)  # GPT-2's scaled init of residual projections
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, device=device) * std
