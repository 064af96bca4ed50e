"""Explicit process groups, built once from the world and passed to constructors.

Rank order is tp fastest, then cp, then dp, then pp (documented on `core.config.Layout`, with
why): global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank, the named mesh
(pp, dp, cp, tp) of `layout_mesh`, whose sub-meshes are the groups. Tensor-parallel
peers are therefore neighbours (same node), then context-parallel peers, as Megatron lays them
out. Parameters are replicated over cp as over dp, so gradients are averaged (and ZeRO-1 / FSDP
shard) over the dp x cp ranks of one (tp, pp) coordinate: `dp_cp_group`, which is the dp group
itself when cp is 1.
With no distributed world every group is `None` and every size is 1, so each parallel layer
becomes a plain layer and the whole model runs in one process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.core.config import Layout
from tessera.core.parallel.expert_groups import edp_size, expert_mesh
from tessera.core.parallel.launch import collective_timeout
from tessera.core.parallel.mesh import RankMesh


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
    # Context parallelism: this rank's share of every sequence (`core.parallel.context_parallel`).
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: dist.ProcessGroup | None = None
    cp_ranks: tuple[int, ...] = (0,)  # global ranks of the cp peers, by cp rank (ring p2p)
    # The ranks a replicated parameter's gradient is averaged over: dp x cp at this (tp, pp);
    # rank within it = dp_rank * cp_size + cp_rank. With cp 1: the dp group, rank and size.
    dp_cp_rank: int = 0
    dp_cp_size: int = 1
    dp_cp_group: dist.ProcessGroup | None = None
    # --- Expert parallelism (`core.parallel.expert_groups`): the expert grid folded
    # over the stage's tp x cp x dp ranks. Without it (ep = etp = 1) these stay at their
    # defaults and the expert layer's parameters are plain replicated ones.
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None  # ranks holding the other experts
    etp_rank: int = 0
    etp_size: int = 1
    etp_group: dist.ProcessGroup | None = None  # ranks holding other FFN slices of my experts
    edp_rank: int = 0
    edp_size: int = 1
    edp_group: dist.ProcessGroup | None = None  # ranks holding my expert shards: grads reduced

    @property
    def is_first_pp(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def layout_mesh(par: Layout) -> RankMesh:
    """The layout's ranks as a named mesh (pp, dp, cp, tp), tp fastest (see `Layout`)."""
    return RankMesh.of(pp=par.pp, dp=par.dp, cp=par.cp, tp=par.tp)


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, par: Layout, cp_rank: int = 0) -> int:
    """Global rank of the given coordinates (tp fastest, then cp, dp, pp; see `Layout`)."""
    return layout_mesh(par).rank(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)


def new_groups(rank_lists: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """Create a process group for each rank list of two or more ranks and return the one that
    holds this rank (None when its list is itself alone or it is in none).

    Collective over the whole world (`new_group` is): every rank must call it with the same
    lists, in the same order. The groups' collectives time out as the world's do
    (`launch.collective_timeout`); torch's own default for new groups is 30 minutes.
    """
    rank, mine, timeout = dist.get_rank(), None, collective_timeout()
    for ranks in rank_lists:
        if len(ranks) < 2:
            continue
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def init_groups(par: Layout, kv_replicas: int = 1) -> ParallelGroups:
    """Build every group of the layout. Collective: all ranks must call it, in the same order.

    `kv_replicas` (`sharding.kv_replicas(model, tp)`): how many consecutive tp ranks share
    each kv head; above 1 it builds the replica groups whose kv gradients are summed (training
    needs them; `pipeline.sync_kv_replica_grads` refuses to run without).
    Without an initialized process group this returns the single-process `ParallelGroups()`.
    With expert parallelism (ep x etp > 1) it also builds the ep, etp and edp groups of the
    expert grid (`core.parallel.expert_groups`), after all the others.
    """
    if not dist.is_available() or not dist.is_initialized():
        if par.world_size != 1:
            raise RuntimeError(
                f"layout tp={par.tp} cp={par.cp} pp={par.pp} dp={par.dp} needs {par.world_size} "
                "processes but torch.distributed is not initialized; launch with torchrun or "
                "--nproc-per-node"
            )
        return ParallelGroups()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != par.world_size:
        raise RuntimeError(
            f"world size {world} != tp {par.tp} x cp {par.cp} x pp {par.pp} x dp {par.dp} = "
            f"{par.world_size}"
        )
    if kv_replicas > 1 and par.tp % kv_replicas:
        raise ValueError(f"kv_replicas {kv_replicas} does not divide tp {par.tp}")
    mesh = layout_mesh(par)
    at = mesh.coords(rank)
    # Every rank creates every group (new_group is collective), in this order; a size-1
    # dimension creates none and its group is None.
    tp_group = new_groups(mesh.groups("tp"))
    dp_group = new_groups(mesh.groups("dp"))
    pp_group = new_groups(mesh.groups("pp"))
    # The first and last pipeline stage at each (dp, cp, tp): tied-embedding gradients.
    embedding_group = new_groups([sorted({ranks[0], ranks[-1]}) for ranks in mesh.groups("pp")])
    kv_group = None
    if kv_replicas > 1:  # blocks of kv_replicas consecutive tp ranks
        kv_mesh = mesh.regroup(["tp"], kv_block=par.tp // kv_replicas, kv=kv_replicas)
        kv_group = new_groups(kv_mesh.groups("kv"))
    cp_group = new_groups(mesh.groups("cp"))
    dp_cp_group = new_groups(mesh.groups("dp", "cp")) if par.cp > 1 else dp_group
    return ParallelGroups(
        tp_rank=at["tp"], tp_size=par.tp, tp_group=tp_group,
        pp_rank=at["pp"], pp_size=par.pp, pp_group=pp_group,
        dp_rank=at["dp"], dp_size=par.dp, dp_group=dp_group,
        embedding_group=embedding_group,
        pp_ranks=tuple(mesh.group_of(rank, "pp")),
        kv_replica_group=kv_group, kv_replicas=max(1, kv_replicas),
        cp_rank=at["cp"], cp_size=par.cp, cp_group=cp_group,
        cp_ranks=tuple(mesh.group_of(rank, "cp")),
        dp_cp_rank=at["dp"] * par.cp + at["cp"], dp_cp_size=par.dp * par.cp,
        dp_cp_group=dp_cp_group,
        **_expert_groups(par, mesh, rank),
    )


def _expert_groups(par: Layout, dense: RankMesh, rank: int) -> dict[str, Any]:
    """The ep, etp and edp groups of every stage (collective) and `rank`'s expert fields of
    `ParallelGroups`; without expert parallelism none, and the fields keep their defaults."""
    if par.ep * par.etp == 1:
        return {}
    mesh = expert_mesh(par, dense)
    ep_group = new_groups(mesh.groups("ep"))
    etp_group = new_groups(mesh.groups("etp"))
    edp_group = new_groups(mesh.groups("edp"))
    at = mesh.coords(rank)
    return dict(ep_rank=at["ep"], ep_size=par.ep, ep_group=ep_group,
                etp_rank=at["etp"], etp_size=par.etp, etp_group=etp_group,
                edp_rank=at["edp"], edp_size=edp_size(par), edp_group=edp_group)


def resolve_device(name: str) -> torch.device:
    """"auto", "cpu" or "cuda" as this rank's device: a CUDA rank uses GPU `LOCAL_RANK`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)
