"""Data parallelism over the dp group: DDP, FSDP2, or ZeRO-1 (sharded optimizer state).

Every mode has one contract: after backward, each rank holds the gradient of the dp-averaged
loss (the mean over all dp ranks' batches), as if one process had run the whole batch.

- `ddp`: `DistributedDataParallel(process_group=dp_group)`; gradients are averaged by its
  bucketed all-reduce, overlapped with backward.
- `zero1`: the same DDP gradient averaging, plus `build_zero_optimizer`, a
  `zero.ShardedOptimizer` that keeps the optimizer state of rows `row_range(n, dp_rank, dp)`
  of every parameter on each dp rank and all-gathers the updated rows after the step; under
  expert parallelism the expert-bank pieces' rows are split over the expert-data-parallel
  group (where their gradients are reduced) and gathered there.
- `fsdp`: FSDP2 `fully_shard` over a 1-D mesh of the dp group, each transformer layer and then
  the whole stage; parameters and gradients become `DTensor` shards over dp (dim 0, the same
  rows as `zero1`), and `build_zero_optimizer` steps those local shards. The embedding hook
  (prompt tuning's virtual tokens) is left out of the sharding: it is small and read whole.

With pipeline parallelism (pp > 1) the stage modules are *not* wrapped for `ddp` and `zero1`:
the pipeline schedules run backward piecewise (`torch.autograd.grad` for inputs, then for
weights, in the zero-bubble schedules), which DDP's reducer hooks do not follow. Instead, call
`allreduce_gradients(stages, groups)` once after `pipeline_step` (one flat all-reduce per
dtype). FSDP2 modules are understood by `PipelineStage` (it defers the reduce-scatter to the
end of the step), so `fsdp` wraps stages under pipelining too. With the split-backward
(zero-bubble, V) schedules each stage is one FSDP2 unit, not one per layer: a layer's own unit
runs its post-backward (reduce-scatter, then reshard) when the gradient reaches the layer's
*inputs*, which the split schedules compute first (`stage_backward_input`); the weight pass
(`stage_backward_weight`) runs later, so its gradients land after the reduce-scatter and are
lost (on torch 2.13, 4 stages x 1 layer, 4 micro-batches: the last stage's layer got no
gradient at all, the middle ones 64-75% of its norm; the stage-level parameters were right).
The stage-level unit's post-backward is run by `PipelineStage` after the last weight pass, so
it sees every gradient; the price is that a whole stage is gathered at once, not a layer at a
time. `tests/distributed/test_data_parallel.py` keeps the per-layer reproducer as a strict
xfail. `wrap_data_parallel` returns the modules to call; the `GPTModel`s keep their parameter
names either way (FSDP2 wraps in place; a DDP wrapper's `.module` is the model).

All three work on gloo/CPU (`notes/torch-native-feasibility.md`, section 7).

With context parallelism the "dp group" of this module is `groups.dp_cp_group` (the dp x cp
ranks of one tp, pp coordinate): parameters are replicated over cp too. Each cp rank's loss
carries a gradient scaled so that the average over dp x cp is the true one (see
`context_parallel.global_mean_loss`), so every mode above averages over dp x cp unchanged, and
ZeRO-1 / FSDP shard rows over dp x cp. With cp 1 it is exactly the dp group.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from tessera.core.config import TrainSchedule
from tessera.core.parallel.expert_data_parallel import (
    expert_parameters,
    reduce_expert_gradients,
)
from tessera.core.parallel.grad_buckets import average_gradients
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.pipeline import SPLIT_BACKWARD_SCHEDULES

# One FSDP2 unit per layer even under split-backward schedules: wrong gradients (see the module
# docstring); only the reproducer test sets it.
SHARD_LAYERS_UNDER_SPLIT_BACKWARD = False


def wrap_data_parallel(
    modules: Sequence[nn.Module], schedule: TrainSchedule, groups: ParallelGroups
) -> list[nn.Module]:
    """Wrap each model chunk for `schedule.data_parallel`; returns what forward should call.

    Unchanged when dp is 1, and for `ddp`/`zero1` under pipelining (see the module docstring:
    use `allreduce_gradients` there).
    """
    modules = list(modules)
    if groups.dp_cp_size == 1:
        return modules
    kind = schedule.data_parallel
    if expert_parameters(modules, groups) and (kind == "fsdp" or groups.pp_size == 1):
        # DDP's reducer and FSDP2 would average trainable expert banks over dp x cp (other
        # experts); frozen ones (prompt tuning on an MoE base) are never reduced.
        raise ValueError(f"data_parallel {kind!r} wrapping does not know expert banks (ep "
                         f"{groups.ep_size} x etp {groups.etp_size}); leave the modules "
                         "unwrapped and call allreduce_gradients after backward, with "
                         "data_parallel 'ddp' or 'zero1'")
    if kind == "fsdp":
        split = groups.pp_size > 1 and schedule.schedule in SPLIT_BACKWARD_SCHEDULES
        per_layer = not split or SHARD_LAYERS_UNDER_SPLIT_BACKWARD
        return [_fully_shard(m, groups, per_layer) for m in modules]
    if kind not in ("ddp", "zero1"):
        raise ValueError(f"unknown data_parallel {kind!r}; choose ddp, fsdp or zero1")
    if groups.pp_size > 1:
        return modules
    from torch.nn.parallel import DistributedDataParallel

    return [DistributedDataParallel(m, process_group=groups.dp_cp_group) for m in modules]


def _fully_shard(module: nn.Module, groups: ParallelGroups, per_layer: bool = True) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = next(module.parameters()).device
    mesh = DeviceMesh.from_group(groups.dp_cp_group, device.type)
    # FSDP2 replaces each parameter with a DTensor one; carry the sequence-parallel mark over.
    marked = {n for n, p in module.named_parameters() if getattr(p, "sequence_parallel", False)}
    hook = getattr(module, "embedding_hook", None)
    ignored = set(hook.parameters()) if isinstance(hook, nn.Module) else set()
    for layer in getattr(module, "layers", {}).values() if per_layer else ():
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh, ignored_params=ignored or None)
    for name, p in module.named_parameters():
        if name in marked:
            p.sequence_parallel = True
    return module


def allreduce_gradients(modules: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Average every gradient over the dp x cp group (the manual path, used with pipelining).

    Parameters without a gradient get zeros first, so every dp rank reduces the same buffer.
    FSDP2 (`DTensor`) parameters are skipped: FSDP2 reduce-scatters their gradients itself.
    Under expert parallelism the expert banks are reduced over their expert-data-parallel
    group instead (`expert_data_parallel.reduce_expert_gradients`).
    """
    reduce_expert_gradients(modules, groups)  # nothing without expert parallelism
    if groups.dp_cp_group is None:
        return
    # FSDP2 imports DTensor; until something has, no parameter is one (and importing it here
    # would cost seconds in every process that never shards).
    dtensor = sys.modules.get("torch.distributed.tensor")
    experts = set(expert_parameters(modules, groups))
    params = [p for m in modules for p in m.parameters()
              if p.requires_grad and not (dtensor and isinstance(p, dtensor.DTensor))
              and p not in experts]
    average_gradients(params, groups.dp_cp_group, groups.dp_cp_size)


def build_zero_optimizer(
    params: Iterable[Any],
    groups: ParallelGroups,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    experts: Iterable[nn.Parameter] = (),
    **defaults: Any,
) -> Any:
    """ZeRO-1: `optimizer_class` over this dp rank's rows of every parameter (`zero.py`).

    With dp 1 this is simply `optimizer_class(params, **defaults)`. Plain parameters need
    dp-averaged gradients (`allreduce_gradients`); FSDP2 ones are stepped on their local shard.
    `experts` (`expert_data_parallel.expert_parameters`: the expert-bank pieces under expert
    parallelism) are sharded over the expert-data-parallel group instead of dp x cp, as their
    gradients are reduced there; with neither group larger than 1 nothing is sharded.
    """
    from tessera.core.parallel.zero import ShardedOptimizer, ShardGroup

    expert_ids = {id(p) for p in experts}
    edp = ShardGroup(groups.edp_group, groups.edp_rank, groups.edp_size)
    if groups.dp_cp_group is None and not (expert_ids and edp.size > 1):
        return optimizer_class(params, **defaults)
    return ShardedOptimizer(params, groups.dp_cp_group, groups.dp_cp_rank, groups.dp_cp_size,
                            optimizer_class, group_of=lambda p: edp if id(p) in expert_ids
                            else None, **defaults)
