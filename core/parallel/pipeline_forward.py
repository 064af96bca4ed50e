"""Forward-only passes across pipeline stages with plain point-to-point sends.

Training uses the `torch.distributed.pipelining` schedules; evaluation and generation need no
backward and no micro-batches, and the server must pass a KV cache and positions to every stage,
which the schedules cannot. Here stage s runs on the rank that holds it, receives the hidden
states of stage s - 1 and sends its own on, in stage order (so interleaved and V placements
work too). Hidden states travel as fp32 with a shape known on both ends, so no metadata is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.sharding import stage_owners


@torch.no_grad()
def pipeline_forward(stages: Sequence[nn.Module], groups: ParallelGroups, input_ids: torch.Tensor,
                     **kwargs: Any) -> torch.Tensor | None:
    """Run all stages once; return the last stage's output on the rank holding it, else None.

    Every pp rank calls this with the same `input_ids (B, T)` (their shape fixes the hidden
    shape) and the same `kwargs` (labels, positions, cache, slots, local_logits...), which are
    passed to each stage. Layout-wise, each stage's output keeps the model's own contract.
    """
    by_id = {m.stage_id: m for m in stages}
    layout, config = stages[0].layout, stages[0].config
    owners = stage_owners(layout)
    B, T = input_ids.shape
    sp = layout.sequence_parallel and kwargs.get("cache") is None
    T //= groups.cp_size  # context parallel: this cp rank's tokens (the model splits the ids)
    hidden_shape = (T // groups.tp_size if sp else T, B, config.hidden_size)
    device, dtype = input_ids.device, next(stages[0].parameters()).dtype
    x: torch.Tensor | None = None
    for s, owner in enumerate(owners):
        if owner != groups.pp_rank:
            continue
        if s == 0:
            x = input_ids
        elif owners[s - 1] != owner:
            buf = torch.empty(hidden_shape, dtype=torch.float32, device=device)
            dist.recv(buf, src=groups.pp_ranks[owners[s - 1]], group=groups.pp_group)
            x = buf.to(dtype)
        x = by_id[s](x, **(kwargs if by_id[s].is_last else _inner(kwargs)))
        if s + 1 < len(owners) and owners[s + 1] != owner:
            dist.send(x.float().contiguous(), dst=groups.pp_ranks[owners[s + 1]],
                      group=groups.pp_group)
    return x if owners[-1] == groups.pp_rank else None


def _inner(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments meant only for the last stage are dropped for the others."""
    return {k: v for k, v in kwargs.items() if k not in ("labels", "local_logits")}
