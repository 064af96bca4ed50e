"""ZeRO-1 by rows: each data-parallel rank keeps the optimizer state of its rows of every parameter.

Data-parallel rank d of D owns rows `row_range(n, d, D)` of each parameter's dim 0: ceil(n / D)
rows per rank in order, so the last ranks may own fewer or none. That is exactly how FSDP2
shards a parameter (`torch.chunk` on dim 0), so one `ShardedOptimizer` serves both flavours:

- a plain parameter (`zero1`: gradients already dp-averaged, parameters replicated): the
  optimizer steps the view `p[start:stop]` with the same rows of the gradient; afterwards the
  updated rows are all-gathered over dp, so every rank holds the whole parameter again;
- an FSDP2 `DTensor` parameter (`fsdp`): the optimizer steps the local shard itself, with the
  local shard of the reduce-scattered gradient; FSDP2 gathers it before the next forward.

The inner optimizer (AdamW) is elementwise, so every row gets the update the unsharded optimizer
would give it, and each rank holds 1/D of the moments. A checkpoint stores each rank's moments
with their row range (`RowShard`), which is what lets any layout reassemble them: the parameter
is the tensor-parallel shard of a global tensor, and rows `start:stop` of that shard are here.

Not every parameter need be sharded over the same ranks: `group_of` may name another
`ShardGroup` for some (under expert parallelism, expert-bank pieces are replicated, and their
gradients reduced, over the expert-data-parallel group, not over dp x cp). Such a parameter's
rows are split over that group's ranks and gathered back over it; each group's gathers run
after the dp group's, in the order the groups first own a parameter, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def row_range(rows: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The rows `[start, stop)` of a dim of `rows` that dp rank `dp_rank` of `dp_size` owns."""
    per = -(-rows // dp_size)
    start = min(rows, dp_rank * per)
    return start, min(rows, start + per)


@dataclass(frozen=True)
class ShardGroup:
    """The ranks one parameter's rows are split over: this rank is `rank` of `size` (`group`
    None: this rank alone)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int


@dataclass(frozen=True)
class RowShard:
    """One parameter's part on this rank: `view` is what the inner optimizer steps."""

    param: nn.Parameter  # the whole (zero1) or FSDP2-sharded (fsdp) parameter
    view: torch.Tensor  # rows start:stop of the parameter's (tp-local) tensor
    start: int
    stop: int
    rows: int  # dim 0 of the whole parameter
    gather: bool  # zero1: all-gather the rows after each step
    over: ShardGroup  # the ranks the rows are split over (the dp group, or `group_of`'s)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedOptimizer:
    """`optimizer_class` over this dp rank's rows of every parameter (see the module docstring).

    Quacks like the wrapped optimizer where the training loop needs it: `param_groups` (set the
    learning rate there), `state` (keyed by the row views), `zero_grad`, `step`; iterating it
    gives the `RowShard`s. Build it on every rank of the dp group with the parameter groups of
    the whole model chunk.

    `group_of(p)`, where given, names the `ShardGroup` that parameter `p`'s rows are split over
    instead of the dp group (None: the dp group); it must name the same groups for the same
    parameters on every rank of each group (see the module docstring).
    """

    def __init__(self, params: Iterable[Any], dp_group: dist.ProcessGroup | None, dp_rank: int,
                 dp_size: int, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, group_of: Callable[[nn.Parameter], ShardGroup | None] | None = None,
                 **defaults: Any) -> None:
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.dp_group, self.dp_rank, self.dp_size = dp_group, dp_rank, dp_size
        self.dp = ShardGroup(dp_group, dp_rank, dp_size)
        self.group_of = group_of or (lambda p: None)
        self.shards: list[RowShard] = []
        inner_groups = []
        with torch.no_grad():
            for group in groups:
                views = [self._add(p).view for p in group["params"]]
                inner_groups.append({**group, "params": views})
        self.inner = optimizer_class(inner_groups, **defaults)

    def _add(self, p: nn.Parameter) -> RowShard:
        over = self.group_of(p) or self.dp
        start, stop = row_range(p.shape[0], over.rank, over.size)
        local = _local(p)
        if local is p:  # replicated: step a view of our rows, gather them afterwards
            shard = RowShard(p, p.detach()[start:stop], start, stop, p.shape[0], gather=True,
                             over=over)
        else:  # an FSDP2 shard: its local rows are ours already
            if local.shape[0] != stop - start:
                raise ValueError(f"FSDP2 gave dp rank {over.rank} {local.shape[0]} rows of "
                                 f"{p.shape[0]}, expected rows {start}:{stop}")
            shard = RowShard(p, local, start, stop, p.shape[0], gather=False, over=over)
        self.shards.append(shard)
        return shard

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return self.inner.state

    def __iter__(self) -> Iterator[RowShard]:
        """The `RowShard` of every parameter, in the order they were given."""
        return iter(self.shards)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.shards:
            s.view.grad = None
            if set_to_none:
                s.param.grad = None
            elif s.param.grad is not None:
                s.param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for s in self.shards:
            grad = s.param.grad
            s.view.grad = None if grad is None else _local(grad)[s.start:s.stop] if s.gather \
                else _local(grad)
        self.inner.step()
        for s in self.shards:
            s.view.grad = None
        self._gather_rows()

    def _gather_rows(self) -> None:
        """All-gather the updated rows of the replicated parameters: one flat buffer per group
        and dtype, the dp group's first."""
        buckets: dict[tuple[int, torch.dtype], list[RowShard]] = {}
        place = {self.dp: 0}  # each group's place: the dp group, then in first-seen order
        for s in self.shards:
            place.setdefault(s.over, len(place))
        for s in self.shards:
            if s.gather and s.over.group is not None and s.over.size > 1:
                buckets.setdefault((place[s.over], s.param.dtype), []).append(s)
        for key in sorted(buckets, key=lambda k: k[0]):  # stable: dtypes in first-seen order
            _gather_bucket(buckets[key], buckets[key][0].over)


def _gather_bucket(shards: list[RowShard], over: ShardGroup) -> None:
    """All-gather the rows `shards` (of one dtype) own over `over`, into every rank's params."""
    # Every rank sends ceil(rows / size) rows of each parameter (padded), so the gathered
    # buffer is `size` equal blocks; block r holds rank r's rows of every parameter in order.
    sizes = [-(-s.rows // over.size) * s.param[0].numel() for s in shards]
    mine = torch.zeros(sum(sizes), dtype=shards[0].param.dtype, device=shards[0].param.device)
    for s, part in zip(shards, mine.split(sizes)):
        part[:s.view.numel()].copy_(s.view.reshape(-1))
    out = torch.empty(over.size * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_into_tensor(out, mine, group=over.group)
    for r, block in enumerate(out.chunk(over.size)):
        if r == over.rank:
            continue
        for s, part in zip(shards, block.split(sizes)):
            start, stop = row_range(s.rows, r, over.size)
            rows = s.param.data[start:stop]
            rows.copy_(part[:rows.numel()].view_as(rows))
