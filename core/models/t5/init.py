"""Building T5 stages with layout-independent initialization (as `core.init` does for GPT).

Each global parameter is drawn whole from its own generator, seeded from the run seed and its
name, then sliced by the sharding rules: a T5 built with seed S under any tp/pp layout equals the
single-process one built with seed S, shard for shard. Norm weights start at 1; every other
weight (embedding, linears, relative position biases) is normal with std `init_std`, the
residual projections (`wo`, `w2`) scaled down by sqrt(2 x layers) as GPT-2 does.
"""

from __future__ import annotations

import math
import zlib

import torch

from tessera.core.config import ConfigError, Layout, ModelConfig, TrainSchedule
from tessera.core.models.t5.layout import decoder_layers
from tessera.core.models.t5.model import T5Model
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import global_param_shapes, shard_tensor


def init_t5_tensor(name: str, config: ModelConfig, seed: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 initial value of the global T5 parameter `name` for run seed `seed`."""
    shape = global_param_shapes(config)[name]
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    std = config.init_std
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std /= math.sqrt(2 * (config.num_layers + decoder_layers(config)))
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, device=device) * std


@torch.no_grad()
def init_t5_weights(model: T5Model, seed: int) -> None:
    """Fill every parameter of one T5 stage (one tp rank) from the global initialization."""
    g = model.groups
    for local_name, param in model.named_parameters():
        name = model.global_name(local_name)
        full = init_t5_tensor(name, model.config, seed, param.device)
        param.copy_(shard_tensor(name, full, model.config, g.tp_rank, g.tp_size))


def build_t5_model(config: ModelConfig, layout: Layout | None = None,
                   groups: ParallelGroups | None = None, *,
                   schedule: TrainSchedule | None = None, stage_id: int = 0,
                   num_stages: int = 1, encoder_stages: int | None = None,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   seed: int = 0, init: bool = True) -> T5Model:
    """One T5 stage for this rank, built on the meta device then materialized (as
    `core.init.build_model`); `init=False` leaves the weights for a checkpoint to fill."""
    with torch.device("meta"):
        model = T5Model(config, layout, groups, stage_id, num_stages, schedule, encoder_stages)
    marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    model.to_empty(device=device)
    for name, p in model.named_parameters():  # to_empty drops the sequence-parallel marks
        if name in marked:
            p.sequence_parallel = True
    if init:
        init_t5_weights(model, seed)
    return model.to(dtype)


def build_t5_stages(config: ModelConfig, layout: Layout, groups: ParallelGroups, *,
                    schedule: TrainSchedule | None = None, encoder_stages: int | None = None,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0, init: bool = True) -> list[T5Model]:
    """This rank's T5 stage (one per pipeline rank), as a list like `pipeline.build_stages`."""
    layout.validate(config)  # with the T5 checks (`t5_sharding.t5_layout_problems`)
    return [build_t5_model(config, layout, groups, schedule=schedule, stage_id=groups.pp_rank,
                           num_stages=layout.num_stages, encoder_stages=encoder_stages,
                           device=device, dtype=dtype, seed=seed, init=init)]


def load_t5_checkpoint(path: str, dtype: torch.dtype | str | None = None,
                       device: torch.device | str = "cpu") -> T5Model:
    """A single-process T5 with the checkpoint's weights (any saved layout), in eval mode."""
    from tessera.core.checkpoint import dtype_from_name, load_weights, read_manifest

    manifest = read_manifest(path)
    if manifest.model.family != "t5":
        raise ConfigError(f"{path} holds a {manifest.model.family!r} model, not a T5")
    dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    model = build_t5_model(manifest.model, device=device,
                           dtype=dtype or dtype_from_name(manifest.dtype), init=False)
    load_weights(model, path)
    return model.eval()
