"""A named grid of global ranks: the one place the rank lists of process groups come from.

`RankMesh.of(pp=2, dp=2, cp=1, tp=2)` lays ranks 0..n-1 out row-major over named dimensions,
the first slowest, so rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp.
`mesh.groups("dp", "cp")` lists the ranks of every sub-mesh spanned by those dimensions (one
list per coordinate of the others; rank within a list = its index along the named dimensions,
the first slowest), and `regroup` re-factors adjacent dimensions over the same ranks: the
expert grid of a stage (`dp, cp, tp` as `edp, ep, etp`), the replicated kv heads inside tp, and
the aligned cp blocks of dynamic context parallelism.

Why not `torch.distributed.device_mesh`: with gloo on CPU (torch 2.13) its named dimensions give
these same rank lists, but flattening (dp x cp) and re-factoring (the expert grid, kv blocks, cp
blocks) are private API there (`_flatten`, `_unflatten`), it creates a process group even for a
size-1 dimension (one per rank) where the layers expect `None`, and it needs a live world,
whereas these lists are needed without one (serving's rank of the last stage, tests). The order
is DeviceMesh's, so `DeviceMesh.from_group` wraps these groups where torch needs a mesh (FSDP2,
`core.parallel.data_parallel`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


class RankMesh:
    """Global ranks on a grid with named dimensions (see the module docstring)."""

    def __init__(self, names: Sequence[str], grid: torch.Tensor) -> None:
        if len(set(names)) != len(names) or len(names) != grid.dim():
            raise ValueError(f"mesh dimension names {tuple(names)} must be distinct, one per "
                             f"dimension of the {grid.dim()}-d grid")
        self.names, self.grid = tuple(names), grid

    @classmethod
    def of(cls, **sizes: int) -> RankMesh:
        """Ranks 0..prod(sizes)-1 over the named dimensions, the first slowest."""
        bad = {name: size for name, size in sizes.items() if size < 1}
        if bad:
            raise ValueError(f"mesh dimension sizes must be >= 1, got {bad}")
        return cls(tuple(sizes), torch.arange(math.prod(sizes.values())).reshape(
            tuple(sizes.values())))

    @property
    def shape(self) -> dict[str, int]:
        """Each dimension's size, slowest first."""
        return dict(zip(self.names, self.grid.shape))

    def _dims(self, names: Sequence[str]) -> list[int]:
        unknown = [n for n in names if n not in self.names]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"mesh dimensions {tuple(names)}: each must be one of {self.names}, "
                             "named once")
        return [self.names.index(n) for n in names]

    def groups(self, *names: str) -> list[list[int]]:
        """The rank lists of every sub-mesh along `names`, in row-major order of the other
        dimensions; within a list the first of `names` is slowest."""
        along = self._dims(names)
        rest = [d for d in range(self.grid.dim()) if d not in along]
        size = math.prod(self.grid.shape[d] for d in along)
        return self.grid.permute(*rest, *along).reshape(-1, size).tolist()

    def group_of(self, rank: int, *names: str) -> list[int]:
        """The rank list along `names` that holds `rank`."""
        return next(ranks for ranks in self.groups(*names) if rank in ranks)

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along every dimension."""
        where = (self.grid == rank).nonzero()
        if len(where) != 1:
            raise ValueError(f"rank {rank} is not in this mesh of {self.grid.numel()} ranks")
        return dict(zip(self.names, where[0].tolist()))

    def rank(self, **coords: int) -> int:
        """The global rank at the given coordinate of every dimension."""
        self._dims(tuple(coords))
        if set(coords) != set(self.names):
            raise ValueError(f"rank() needs a coordinate for each of {self.names}, "
                             f"got {tuple(coords)}")
        index = tuple(coords[n] for n in self.names)
        for name, i, size in zip(self.names, index, self.grid.shape):
            if not 0 <= i < size:
                raise ValueError(f"{name} coordinate {i} is outside 0..{size - 1}")
        return int(self.grid[index])

    def regroup(self, names: Sequence[str], **sizes: int) -> RankMesh:
        """The same ranks with the adjacent dimensions `names` (in mesh order) replaced by the
        new dimensions `sizes` (first slowest), whose product must equal theirs."""
        dims = self._dims(names)
        if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
            raise ValueError(f"regroup needs adjacent dimensions in mesh order {self.names}, "
                             f"got {tuple(names)}")
        old = math.prod(self.grid.shape[d] for d in dims)
        if math.prod(sizes.values()) != old:
            raise ValueError(f"regroup of {tuple(names)} ({old} ranks) into {sizes}: the new "
                             f"sizes multiply to {math.prod(sizes.values())}, not {old}")
        start, stop = dims[0], dims[-1] + 1
        new_names = (*self.names[:start], *sizes, *self.names[stop:])
        shape = (*self.grid.shape[:start], *sizes.values(), *self.grid.shape[stop:])
        return RankMesh(new_names, self.grid.reshape(shape))


def new_groups(rank_lists: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """Create a process group for each rank list of two or more ranks and return the one that
    holds this rank (None when its list is itself alone or it is in none).

    Collective over the whole world (`new_group` is): every rank must call it with the same
    lists, in the same order.
    """
    rank, mine = dist.get_rank(), None
    for ranks in rank_lists:
        if len(ranks) < 2:
            continue
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine
