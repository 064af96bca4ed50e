"""The RNG states of every rank in a tuning checkpoint, so that a resumed run draws the dropout
masks the uninterrupted run would have drawn.

`rng.safetensors` holds, for each global rank r, `rank{r}/cpu` (torch's default CPU generator),
`rank{r}/tracker...` (the model-parallel tracker's states, `core.parallel.random`) and, where
CUDA is used, `rank{r}/cuda`; its metadata names the world size and the tp x pp x cp layout. A
run restores its rank's states only on the same world size and layout (elsewhere the ranks
hold other parts of the model, and fresh states are as good as any).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.random import load_rank_rng_states, rank_rng_states

RNG_FILE = "rng.safetensors"


def _layout(groups: ParallelGroups) -> dict[str, str]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"world_size": str(world),
            "layout": f"tp{groups.tp_size} pp{groups.pp_size} cp{groups.cp_size}"}


def gather_rng_states() -> dict[str, torch.Tensor] | None:
    """Every rank's RNG states, keyed `rank{r}/...`, on global rank 0; None on the other ranks.
    Collective when distributed."""
    if not dist.is_initialized():
        return {f"rank0/{k}": v for k, v in rank_rng_states().items()}
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rank_rng_states(), gathered, dst=0)
    if gathered is None:
        return None
    return {f"rank{r}/{k}": v for r, states in enumerate(gathered) for k, v in states.items()}


def write_rng_states(directory: Path, states: dict[str, torch.Tensor],
                     groups: ParallelGroups) -> None:
    """Write `gather_rng_states()`'s result into a checkpoint directory (on global rank 0)."""
    save_file({k: v.contiguous() for k, v in states.items()}, str(directory / RNG_FILE),
              metadata=_layout(groups))


def restore_rng_states(directory: Path, groups: ParallelGroups) -> bool:
    """Set this rank's RNG states from the checkpoint `directory` when it was saved on this
    world size and layout; return whether it was (a checkpoint without the file: False)."""
    file = directory / RNG_FILE
    if not file.is_file():
        return False
    rank = dist.get_rank() if dist.is_initialized() else 0
    prefix = f"rank{rank}/"
    with safe_open(str(file), framework="pt") as f:
        if f.metadata() != _layout(groups):
            return False
        mine = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    load_rank_rng_states(mine)
    return True
