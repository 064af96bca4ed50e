"""Per-step router statistics of an MoE model, over every rank, and the expert-bias update.

While tracking is on (`track_router_stats`), each MoE layer appends one `RouterRecord` per
training forward. `router_step_end(stages, groups)` is collective over the whole world (every
rank calls it once per step, whatever its pipeline stage holds): it sums the records of the
step over all ranks, clears them, moves the aux-loss-free expert biases (when configured), and
returns the step's metrics:

- `moe_aux_loss`, `moe_z_loss`: the load-balancing and z losses (without their coefficients),
  mean over the MoE layers and micro-batches (and data-parallel ranks); with
  `moe.aux_loss_pooling = "model"` the load-balancing loss is the one pooled over the layers
  (`core.moe.pooled_aux`), mean over micro-batches;
- `moe_tokens_per_expert_min` / `_max`: over every (MoE layer, expert), the token copies the
  expert processed in the step (all micro-batches, all ranks);
- `moe_tokens_per_expert_cv`: the coefficient of variation (std / mean) of those counts over the
  experts of a layer, mean over layers (0: perfect balance);
- `moe_dropped_tokens`: assignments dropped by capacity in the step, all layers and ranks.

Token counts are summed over ranks that hold different tokens (dp, cp, and tp under sequence
parallelism); tp ranks without sequence parallelism see the same tokens and count once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.moe.layer import MoEFeedForward
from tessera.core.moe.shapes import moe_layers


def moe_modules(stages: Sequence[nn.Module]) -> list[MoEFeedForward]:
    """The MoE layers of this rank's stages."""
    return [m for s in stages for m in s.modules() if isinstance(m, MoEFeedForward)]


def track_router_stats(stages: Sequence[nn.Module], on: bool = True) -> None:
    """Start (or stop) recording routing statistics on every MoE layer of `stages`."""
    for m in moe_modules(stages):
        m.track = on
        if not on:
            m.records.clear()


def router_step_end(stages: Sequence[nn.Module], groups, sequence_parallel: bool,
                    micro_batches: int | None = None) -> dict[str, float]:
    """The step's router metrics over all ranks (see the module docstring); collective.

    `micro_batches`: count only each layer's last that many records. A pipeline schedule's
    first step also runs every stage once on example inputs to learn the shapes it sends
    (`torch.distributed.pipelining` metadata inference), which the layers cannot tell apart
    from a training forward; its records come first."""
    config = stages[0].config
    if not config.moe.num_experts:
        return {}
    index = {layer: i for i, layer in enumerate(moe_layers(config))}
    n_layers, n_experts = len(index), config.moe.num_experts
    device = next(stages[0].parameters()).device
    # One flat buffer, one all-reduce: counts (L, E), then dropped, aux, z and calls per layer.
    buf = torch.zeros(n_layers * (n_experts + 4), dtype=torch.float64, device=device)
    counts = buf[: n_layers * n_experts].view(n_layers, n_experts)
    dropped, aux, z, calls = buf[n_layers * n_experts:].view(4, n_layers)
    modules = moe_modules(stages)
    for m in modules:
        for r in m.records[-micro_batches:] if micro_batches else m.records:
            i = index[r.layer]
            counts[i] += r.counts.to(buf)
            dropped[i] += r.dropped.to(buf)
            aux[i] += r.aux_loss.to(buf)
            z[i] += r.z_loss.to(buf)
            calls[i] += 1
        m.records.clear()
    if dist.is_initialized():
        dist.all_reduce(buf)
    if not bool((calls > 0).all()):
        return {}
    # Without SP, the tp ranks of one layer route the same tokens: count them once. With SP,
    # each holds its share of the whole sequence's losses (the shares add up); so does each cp
    # rank (`layer.MoEFeedForward`).
    same_tokens = 1 if sequence_parallel else groups.tp_size
    shares = (groups.tp_size if sequence_parallel else 1) * groups.cp_size
    counts /= same_tokens
    dropped /= same_tokens
    mean = counts.mean(dim=1)
    cv = counts.std(dim=1, unbiased=False) / mean.clamp(min=1)
    _update_expert_bias(modules, counts, index, config.moe.expert_bias_rate)
    aux = aux * shares / calls  # per layer: mean over micro-batches
    # "model" pooling: the layers' records hold their terms of one pooled loss, which add up.
    aux = aux.sum() if config.moe.aux_loss_pooling == "model" else aux.mean()
    return {"moe_aux_loss": float(aux),
            "moe_z_loss": float((z * shares / calls).mean()),
            "moe_tokens_per_expert_min": float(counts.min()),
            "moe_tokens_per_expert_max": float(counts.max()),
            "moe_tokens_per_expert_cv": float(cv.mean()),
            "moe_dropped_tokens": float(dropped.sum())}


@torch.no_grad()
def _update_expert_bias(modules: list[MoEFeedForward], counts: torch.Tensor,
                        index: dict[int, int], rate: float) -> None:
    """Aux-loss-free balancing (Wang et al. 2024): raise the bias of under-loaded experts and
    lower it for over-loaded ones by `rate`, from the step's global counts, so every replica of
    a layer takes the same update."""
    for m in modules:
        bias = m.router.expert_bias
        if bias is None:
            continue
        load = counts[index[m.layer]]
        bias += (rate * torch.sign(load.mean() - load)).to(bias)
