"""Which rows of each parameter's optimizer state this rank holds, and how saved row pieces
are put back together: shared by the dense moment files (`training.moments`), the expert ones
(`training.expert_moments`) and prompt tuning's checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.core.checkpoint import CheckpointError
from tessera.core.parallel.zero import ShardedOptimizer


def optimizer_slots(models: list[nn.Module], optimizer: Any) -> list[tuple[str, Any, int, int, int]]:
    """(global name, state key, start, stop, rows) for each parameter this rank's optimizer
    steps: the key is the tensor `optimizer.state` is indexed by (a row view for a
    `ShardedOptimizer`), rows `start:stop` of the parameter's dim 0 (of `rows`) are its part.
    """
    shards = {id(s.param): s for s in optimizer} if isinstance(optimizer, ShardedOptimizer) \
        else None
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    slots = []
    for model in models:
        for local, p in model.named_parameters():
            name = model.global_name(local)
            if shards is not None:
                if id(p) in shards:
                    s = shards[id(p)]
                    slots.append((name, s.view, s.start, s.stop, s.rows))
            elif id(p) in stepped:
                slots.append((name, p, 0, p.shape[0], p.shape[0]))
    return slots


def join_rows(parts: list[tuple[int, int, int, Any]], what: str) -> torch.Tensor:
    """The tensor of `rows` rows from pieces `(start, stop, rows, read)` (`read()` gives rows
    `start:stop`), in any order; raises `CheckpointError` unless they cover it exactly once."""
    parts = sorted(parts, key=lambda x: x[0])
    at, total = 0, parts[0][2]
    for start, stop, rows, _ in parts:
        if start != at or rows != total:
            raise CheckpointError(f"{what}: rows from {at} are missing or saved twice; the "
                                  "checkpoint is incomplete")
        at = stop
    if at != total:
        raise CheckpointError(f"{what}: rows {at}:{total} are missing; the checkpoint is "
                              "incomplete")
    tensors = [read() for start, stop, _, read in parts if stop > start]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
