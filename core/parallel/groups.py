"""Explicit process groups, built once from the world and passed to constructors.

Rank order is tp fastest, then dp, then pp (documented on `core.config.Layout`, with where
context and expert parallelism will slot in): global rank = pp_rank * (dp * tp) + dp_rank * tp +
tp_rank. Tensor-parallel peers are therefore neighbours (same node), as Megatron lays them out.
With no distributed world every group is `None` and every size is 1, so each parallel layer
becomes a plain layer and the whole model runs in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.core.config import Layout


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's coordinates and groups. A `None` group means size 1 (nothing to communicate)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    # Ranks holding the first and last pipeline stage at this tp rank (tied-embedding gradients).
    embedding_group: dist.ProcessGroup | None = None
    # Global ranks of this rank's pipeline peers, by pp rank (for point-to-point sends).
    pp_ranks: tuple[int, ...] = (0,)
    # The tp ranks holding the same replicated kv head (tp > num_kv_heads, see sharding): the
    # gradients of its rows are summed over this group. None: no replication.
    kv_replica_group: dist.ProcessGroup | None = None
    kv_replicas: int = 1  # size of that group

    @property
    def is_first_pp(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, par: Layout) -> int:
    """Global rank of the given coordinates (tp fastest, then dp, then pp; see `Layout`)."""
    return (pp_rank * par.dp + dp_rank) * par.tp + tp_rank


def init_groups(par: Layout, kv_replicas: int = 1) -> ParallelGroups:
    """Build every group of the layout. Collective: all ranks must call it, in the same order.

    `kv_replicas` (`sharding.kv_replicas(model, tp)`): how many consecutive tp ranks share
    each kv head; above 1 it builds the replica groups whose kv gradients are summed (training
    needs them; `pipeline.sync_kv_replica_grads` refuses to run without).
    Without an initialized process group this returns the single-process `ParallelGroups()`.
    """
    if not dist.is_available() or not dist.is_initialized():
        if par.world_size != 1:
            raise RuntimeError(
                f"layout tp={par.tp} pp={par.pp} dp={par.dp} needs {par.world_size} processes but "
                "torch.distributed is not initialized; launch with torchrun or --nproc-per-node"
            )
        return ParallelGroups()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != par.world_size:
        raise RuntimeError(
            f"world size {world} != tp {par.tp} x pp {par.pp} x dp {par.dp} = {par.world_size}"
        )
    tp_rank = rank % par.tp
    dp_rank = (rank // par.tp) % par.dp
    pp_rank = rank // (par.tp * par.dp)
    mine: dict[str, dist.ProcessGroup | None] = {}

    def make(kind: str, ranks: list[int]) -> None:
        # new_group is collective over the world: every rank creates every group.
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine[kind] = group

    for p in range(par.pp):
        for d in range(par.dp):
            make("tp", [rank_of(t, d, p, par) for t in range(par.tp)])
    for p in range(par.pp):
        for t in range(par.tp):
            make("dp", [rank_of(t, d, p, par) for d in range(par.dp)])
    for d in range(par.dp):
        for t in range(par.tp):
            make("pp", [rank_of(t, d, p, par) for p in range(par.pp)])
            make("embedding", sorted({rank_of(t, d, 0, par), rank_of(t, d, par.pp - 1, par)}))
    if kv_replicas > 1:
        if par.tp % kv_replicas:
            raise ValueError(f"kv_replicas {kv_replicas} does not divide tp {par.tp}")
        for p in range(par.pp):
            for d in range(par.dp):
                for first in range(0, par.tp, kv_replicas):
                    make("kv", [rank_of(t, d, p, par) for t in range(first, first + kv_replicas)])
    return ParallelGroups(
        tp_rank=tp_rank, tp_size=par.tp, tp_group=mine.get("tp"),
        pp_rank=pp_rank, pp_size=par.pp, pp_group=mine.get("pp"),
        dp_rank=dp_rank, dp_size=par.dp, dp_group=mine.get("dp"),
        embedding_group=mine.get("embedding"),
        pp_ranks=tuple(rank_of(tp_rank, dp_rank, p, par) for p in range(par.pp)),
        kv_replica_group=mine.get("kv"), kv_replicas=max(1, kv_replicas),
    )


def resolve_device(name: str) -> torch.device:
    """"auto", "cpu" or "cuda" as this rank's device: a CUDA rank uses GPU `LOCAL_RANK`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)
