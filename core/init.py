"""Layout-independent initialization and model building on the meta device.

Each global parameter is drawn from its own generator, seeded from the run seed and the
parameter's name, as one full tensor which is then sliced by the sharding rules. So a model
built with seed S under any tp/pp layout equals the single-process model built with seed S,
shard for shard, and peak memory is one global tensor, never the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.core.config import Layout, ModelConfig, TrainSchedule
from tessera.core.expert_checkpoint import expert_sharded
from tessera.core.models.registry import family as model_family
from tessera.core.moe.layer import set_dispatchers
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import shard_expert_tensor, shard_tensor


def init_global_tensor(name: str, config: ModelConfig, seed: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 initial value of global parameter `name` for run seed `seed` (the family's
    `init_tensor`)."""
    return model_family(config).init_tensor(name, config, seed, device)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` (one stage, one tp rank) from the global initialization."""
    g = model.groups
    for local_name, param in model.named_parameters():
        if local_name.startswith("embedding_hook."):
            continue
        name = model.global_name(local_name)
        full = init_global_tensor(name, model.config, seed, param.device)
        if expert_sharded(name, g):  # expert parallelism: this rank's piece of the grid
            param.copy_(shard_expert_tensor(name, full, model.config, g.ep_rank, g.ep_size,
                                            g.etp_rank, g.etp_size))
            continue
        param.copy_(shard_tensor(name, full, model.config, g.tp_rank, g.tp_size))


def build_model(
    config: ModelConfig,
    layout: Layout | None = None,
    groups: ParallelGroups | None = None,
    *,
    schedule: TrainSchedule | None = None,
    stage_id: int = 0,
    num_stages: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    init: bool = True,
    backend: str = "auto",
) -> nn.Module:
    """Build one stage of the model for this rank: on the meta device, then materialized.

    `layout` says where the weights live (sequence parallelism; tp and pp come from `groups`),
    `schedule` how training steps run (only its recomputation matters here; None: none).
    With `init=False` the weights are left uninitialized (a checkpoint will be loaded into them).
    `backend`: "torch" (plain PyTorch), "te" (Transformer Engine linears; CUDA only), or "auto"
    (TE when it imports on a CUDA device, else plain PyTorch; only for a family whose
    `transformer_engine` is set). Parameter names and shapes are the same for both, so
    checkpoints move freely between them. The stage is the family's (`Family.stage`).
    """
    from tessera.core.te_backend import apply_transformer_engine, transformer_engine_available

    if backend not in ("auto", "torch", "te"):
        raise ValueError(f"unknown backend {backend!r}; use auto, torch or te")
    family = model_family(config)
    if backend == "te" and not family.transformer_engine:
        raise ValueError(f"backend 'te' is not available for a {config.family} model; use "
                         "auto or torch")
    use_te = backend == "te" or (backend == "auto" and family.transformer_engine
                                 and transformer_engine_available(device))
    if use_te and not transformer_engine_available(device):
        raise RuntimeError("backend 'te' needs a CUDA device and transformer_engine installed "
                           '(pip install --no-build-isolation "tessera[te]")')
    with torch.device("meta"):
        model = family.stage(config, layout, groups, stage_id, num_stages, schedule)
    if schedule is not None and config.moe.num_experts:  # the expert-parallel token dispatcher
        set_dispatchers(model, model.groups, schedule.moe_dispatcher)
    # to_empty replaces each meta parameter with a new one, dropping Python attributes such as
    # the `sequence_parallel` mark that the gradient sync looks for: carry it over.
    marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        if name in marked:
            p.sequence_parallel = True
    if init:
        init_weights(model, seed)
    model = model.to(dtype)
    if use_te:
        apply_transformer_engine(model)
    return model


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
