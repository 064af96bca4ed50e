"""AdamW with weight-decay groups, the learning-rate schedule, and global-norm clipping that is
correct across tensor, pipeline and data parallel ranks.

The global gradient norm counts every element of the global model once: tensor-parallel shards
are summed over the tp group, replicated parameters (norms, row biases) are counted on tp rank 0
only, stages are summed over the pp group, and a tied embedding's output copy on the last stage
is skipped (its gradient was already summed into the embedding's). Data-parallel replicas hold
identical (averaged) gradients, so nothing is summed over dp, except under FSDP2, whose
gradients are row shards over dp: their squares are summed over the dp group too. Under expert
parallelism the expert banks' squares are summed over the ep and etp groups instead
(`core.parallel.expert_data_parallel`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.core.parallel.data_parallel import build_zero_optimizer
from tessera.core.parallel.expert_data_parallel import (
    expert_grad_norm_squared,
    expert_parallel,
    expert_parameters,
)
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import is_expert_param, shard_spec, stored_shard
from tessera.training.run_plan import OptimizerSettings


def param_groups(models: list[nn.Module], weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decay; biases, norms and 1-D tensors do not."""
    decay, no_decay = [], []
    for model in models:
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(models: list[nn.Module], cfg: OptimizerSettings,
                    shard_over: ParallelGroups | None = None) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused (one kernel per tensor) where torch has the kernel.

    `shard_over` given (data-parallel `zero1` or `fsdp`): each dp rank keeps the state of its
    rows only (`core.parallel.zero.ShardedOptimizer`, AdamW inside); under expert parallelism
    each expert-data-parallel rank keeps the state of its rows of the expert-bank pieces.

    The fused kernel reads and writes each parameter and moment once per step; the `foreach`
    path makes one pass per arithmetic op, which on CPU made the update 4-6x slower (a third of
    a bf16 step at hidden 2048, see bench/README). Hugging Face's Trainer defaults to the same
    fused kernel, so the training benchmark compares like with like.
    """
    device = next((p.device for m in models for p in m.parameters()), torch.device("cpu"))
    fused = device.type in ("cpu", "cuda")
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.adam_eps,
              "fused": fused, "foreach": None if fused else True}
    groups = param_groups(models, cfg.weight_decay)
    experts = expert_parameters(models, shard_over) if shard_over is not None else []
    if shard_over is not None and (shard_over.dp_cp_size > 1 or
                                   (experts and shard_over.edp_size > 1)):
        return build_zero_optimizer(groups, shard_over, torch.optim.AdamW, experts=experts,
                                    **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def learning_rate(step: int, cfg: OptimizerSettings) -> float:
    """Linear warmup to `lr`, then cosine / linear decay to `min_lr` at `steps` (or constant).
    Never above `lr`: the plan's `min_lr` is at most `lr` (`config.resolved_min_lr`)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.decay == "linear":
        factor = 1.0 - progress
    elif cfg.decay == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay {cfg.decay!r}; use cosine, linear or constant")
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def global_grad_norm(models: list[nn.Module]) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, identical on every rank of the job."""
    g = models[0].groups
    device = next(models[0].parameters()).device
    counted, dp_sharded, experts = [], False, []
    for model in models:
        for local_name, p in model.named_parameters():
            if p.grad is None:
                continue
            name = model.global_name(local_name)
            if name != local_name:  # tied output copy: counted through the embedding
                continue
            if expert_parallel(g) and is_expert_param(name):  # summed over ep x etp below
                experts.append(p.grad.detach())
                continue
            replicated = shard_spec(name, model.config).dim is None
            if replicated and g.tp_rank != 0:
                continue
            grad = p.grad.detach()
            if isinstance(grad, DTensor):  # an FSDP2 row shard: the other rows are on dp peers
                # (FSDP2 refuses kv-head replication, so there is no replica to count once.)
                counted.append(grad.to_local())
                dp_sharded = True
            else:
                # A replicated kv head counts once, on the first rank of its replica group.
                counted.append(stored_shard(name, grad, model.config, g.tp_rank, g.tp_size))
    # One multi-tensor kernel per dtype instead of a norm per parameter.
    local = (torch.nn.utils.get_total_norm(counted, foreach=True).float() if counted
             else torch.zeros((), dtype=torch.float32, device=device))
    total = local.square()
    for group in (g.tp_group, g.pp_group, g.dp_cp_group if dp_sharded else None):
        if group is not None:
            dist.all_reduce(total, group=group)
    if expert_parallel(g):  # every expert piece once: over ep x etp (and pp), not edp or tp
        total = total + expert_grad_norm_squared(experts, g, device)
    return total.sqrt()


def clip_gradients(models: list[nn.Module], max_norm: float) -> torch.Tensor:
    """Scale every gradient so the global norm is at most `max_norm`; return the norm before,
    a 0-d float32 tensor on the gradients' device (reading it waits for the device)."""
    norm = global_grad_norm(models)
    if max_norm > 0:
        params = [p for model in models for p in model.parameters() if p.grad is not None]
        shards = [p.grad.to_local() for p in params if isinstance(p.grad, DTensor)]
        if shards:  # FSDP2: scale the local shards, as clip_grads_with_norm_ would scale all
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(shards, coef.to(shards[0].device))
            params = [p for p in params if not isinstance(p.grad, DTensor)]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
