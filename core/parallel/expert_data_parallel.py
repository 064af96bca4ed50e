"""Gradients of expert banks under expert parallelism: which ranks reduce them, and the norm.

Dense parameters are replicated over the dp x cp ranks of a (tp, pp) coordinate and their
gradients averaged there (`data_parallel.allreduce_gradients`). An expert bank's piece (ep
rank, etp rank) is replicated only over the *expert-data-parallel* group (`ParallelGroups.
edp_group`, the ranks with the same expert-grid coordinate); its ep and etp peers hold other
pieces, so averaging over dp x cp would mix different experts. Each piece's gradient already
sums the contributions of every token the dispatchers brought to it from its ep x etp block,
and each rank's loss is scaled so that the mean over dp x cp is the true loss; so the true
gradient is the sum over the edp group divided by dp x cp (`reduce_expert_gradients`). With
ep x etp = 1 nothing here applies: the banks are plain replicated parameters.

The global gradient norm must count every expert element once (Megatron-LM PR #5916 fixed an
undercount when ep > 1 and tp > 1): the squares of the expert pieces are summed over the ep
and etp groups and the pipeline, never over edp (identical copies) nor over tp (the tp peers
of a rank are ep or edp peers here, not holders of other slices of the same piece)
(`expert_grad_norm_squared`).

ZeRO-1 shards the optimizer state of dense parameters over dp x cp and that of expert pieces
over edp, where their gradients are reduced (`data_parallel.build_zero_optimizer` with
`experts`), as Megatron-LM's distributed optimizer does. FSDP shards every parameter's rows
over dp x cp, which for expert banks would exchange rows of different experts; it is refused
with ep x etp > 1 (`expert_schedule_problems`), naming zero1 as the alternative.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.config import Layout, TrainSchedule
from tessera.core.parallel.grad_buckets import average_gradients
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import is_expert_param


def expert_parallel(groups: ParallelGroups) -> bool:
    return groups.ep_size * groups.etp_size > 1


def expert_parameters(modules: Sequence[nn.Module], groups: ParallelGroups
                      ) -> list[nn.Parameter]:
    """The trainable expert-bank parameters of `modules` (empty without expert parallelism)."""
    if not expert_parallel(groups):
        return []
    return [p for m in modules for n, p in m.named_parameters()
            if p.requires_grad and is_expert_param(n)]


def reduce_expert_gradients(modules: Sequence[nn.Module], groups: ParallelGroups) -> None:
    """Sum the expert-bank gradients over the edp group and divide by dp x cp (see the module
    docstring). Missing gradients become zeros first, so every edp rank reduces one buffer."""
    params = expert_parameters(modules, groups)
    if not params:
        return
    average_gradients(params, groups.edp_group, groups.dp_cp_size)


def expert_grad_norm_squared(grads: list[torch.Tensor], groups: ParallelGroups,
                             device: torch.device) -> torch.Tensor:
    """The squared L2 norm of every expert bank's whole gradient (fp32, the same on every
    rank): this rank's pieces `grads` summed over the ep, etp and pp groups."""
    total = (torch.nn.utils.get_total_norm(grads, foreach=True).float().square() if grads
             else torch.zeros((), dtype=torch.float32, device=device))
    for group in (groups.ep_group, groups.etp_group, groups.pp_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total


def expert_schedule_problems(layout: Layout, schedule: TrainSchedule) -> list[str]:
    """Why `schedule` cannot train expert-parallel `layout` (empty when it can)."""
    kind = getattr(schedule, "moe_dispatcher", "alltoall")
    if kind not in ("alltoall", "allgather"):
        return [f"unknown moe_dispatcher {kind!r}; choose 'alltoall' or 'allgather'"]
    if getattr(layout, "ep", 1) * getattr(layout, "etp", 1) == 1:
        return []
    if schedule.data_parallel == "fsdp":
        return [f"data_parallel 'fsdp' shards every parameter over dp x cp, which would mix the "
                f"experts of ep {layout.ep} x etp {layout.etp} ranks; use data_parallel 'zero1' "
                "(--data-parallel zero1: optimizer state sharded, expert banks' over the "
                "expert-data-parallel group) or 'ddp' with expert parallelism"]
    return []
