"""A named grid of global ranks: the one place the rank lists of process groups come from.

`RankMesh.of(pp=2, dp=2, cp=1, tp=2)` lays ranks 0..n-1 out row-major over named dimensions,
the first slowest, so rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp.
`mesh.groups("dp", "cp")` lists the ranks of every sub-mesh spanned by those dimensions (one
list per coordinate of the others; rank within a list = its index along the named dimensions,
the first slowest), and `regroup` re-factors adjacent dimensions over the same ranks: the
expert grid of a stage (`dp, cp, tp` as `edp, ep, etp`), the replicated kv heads inside tp, and
the aligned cp blocks of dynamic context parallelism. Re-factoring adjacent dimensions of a
row-major grid keeps it row-major, so a mesh is its names and sizes; it is pure Python (no
torch), for the planner too. `core.parallel.groups.new_groups` turns rank lists into groups.

Why not `torch.distributed.device_mesh`: with gloo on CPU (torch 2.13) its named dimensions give
these same rank lists, but flattening (dp x cp) and re-factoring (the expert grid, kv blocks, cp
blocks) are private API there (`_flatten`, `_unflatten`), it creates a process group even for a
size-1 dimension (one per rank) where the layers expect `None`, and it needs a live world,
whereas these lists are needed without one (serving's rank of the last stage, the planner,
tests). The order is DeviceMesh's, so `DeviceMesh.from_group` wraps these groups where torch
needs a mesh (FSDP2, `core.parallel.data_parallel`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


class RankMesh:
    """Global ranks 0..n-1 on a row-major grid with named dimensions (see the module
    docstring). Build it with `RankMesh.of`."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        if len(set(names)) != len(names) or len(names) != len(sizes):
            raise ValueError(f"mesh dimension names {tuple(names)} must be distinct, one per "
                             f"size in {tuple(sizes)}")
        bad = {n: s for n, s in zip(names, sizes) if s < 1}
        if bad:
            raise ValueError(f"mesh dimension sizes must be >= 1, got {bad}")
        self.names, self.sizes = tuple(names), tuple(sizes)
        # A step of one along dimension i moves the rank by strides[i] (row-major).
        self.strides = tuple(math.prod(self.sizes[i + 1:]) for i in range(len(self.sizes)))

    @classmethod
    def of(cls, **sizes: int) -> RankMesh:
        """Ranks 0..prod(sizes)-1 over the named dimensions, the first slowest."""
        return cls(tuple(sizes), tuple(sizes.values()))

    @property
    def shape(self) -> dict[str, int]:
        """Each dimension's size, slowest first."""
        return dict(zip(self.names, self.sizes))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def _dims(self, names: Sequence[str]) -> list[int]:
        unknown = [n for n in names if n not in self.names]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"mesh dimensions {tuple(names)}: each must be one of {self.names}, "
                             "named once")
        return [self.names.index(n) for n in names]

    def _ranks(self, dims: Sequence[int]) -> list[int]:
        """The offsets of every coordinate along `dims`, the first slowest."""
        return [sum(c * self.strides[d] for c, d in zip(coords, dims))
                for coords in itertools.product(*(range(self.sizes[d]) for d in dims))]

    def groups(self, *names: str) -> list[list[int]]:
        """The rank lists of every sub-mesh along `names`, in row-major order of the other
        dimensions; within a list the first of `names` is slowest."""
        along = self._dims(names)
        rest = [d for d in range(len(self.sizes)) if d not in along]
        inner = self._ranks(along)
        return [[base + r for r in inner] for base in self._ranks(rest)]

    def group_of(self, rank: int, *names: str) -> list[int]:
        """The rank list along `names` that holds `rank`."""
        along = self._dims(names)
        at = self.coords(rank)
        base = rank - sum(at[self.names[d]] * self.strides[d] for d in along)
        return [base + r for r in self._ranks(along)]

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate along every dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in this mesh of {self.world_size} ranks")
        return {n: rank // stride % size
                for n, stride, size in zip(self.names, self.strides, self.sizes)}

    def rank(self, **coords: int) -> int:
        """The global rank at the given coordinate of every dimension."""
        self._dims(tuple(coords))
        if set(coords) != set(self.names):
            raise ValueError(f"rank() needs a coordinate for each of {self.names}, "
                             f"got {tuple(coords)}")
        for name, size in zip(self.names, self.sizes):
            if not 0 <= coords[name] < size:
                raise ValueError(f"{name} coordinate {coords[name]} is outside 0..{size - 1}")
        return sum(coords[n] * stride for n, stride in zip(self.names, self.strides))

    def regroup(self, names: Sequence[str], **sizes: int) -> RankMesh:
        """The same ranks with the adjacent dimensions `names` (in mesh order) replaced by the
        new dimensions `sizes` (first slowest), whose product must equal theirs."""
        dims = self._dims(names)
        if not dims or dims != list(range(dims[0], dims[0] + len(dims))):
            raise ValueError(f"regroup needs adjacent dimensions in mesh order {self.names}, "
                             f"got {tuple(names)}")
        old = math.prod(self.sizes[d] for d in dims)
        if math.prod(sizes.values()) != old:
            raise ValueError(f"regroup of {tuple(names)} ({old} ranks) into {sizes}: the new "
                             f"sizes multiply to {math.prod(sizes.values())}, not {old}")
        start, stop = dims[0], dims[-1] + 1
        return RankMesh((*self.names[:start], *sizes, *self.names[stop:]),
                        (*self.sizes[:start], *sizes.values(), *self.sizes[stop:]))
