"""The expert-parallel grid folded over each pipeline stage's ranks (issue 14).

`core.config.Layout` documents the layout and why: within a stage, with
`q = (dp_rank * cp + cp_rank) * tp + tp_rank`, the expert grid runs etp fastest, then ep, then
edp. This module turns that into coordinates (`expert_coords`), global ranks
(`expert_rank_of`) and the process groups (`build_expert_groups`, called by
`core.parallel.groups.init_groups`, whose `ParallelGroups` carries them):

- ep group: the ranks holding the other experts of a layer (same pp, etp and edp rank); the
  dispatchers exchange tokens over it;
- etp group: the ranks holding the other FFN slices of the same experts (same pp, ep and edp
  rank); tokens are gathered over it before the experts and outputs reduced after;
- edp group: the ranks holding the same expert shards (same pp, etp and ep rank); expert
  gradients are reduced over it and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.core.config import Layout


def edp_size(lay: Layout) -> int:
    """Expert-data-parallel size: the stage's ranks `tp * cp * dp` over `ep * etp`."""
    return lay.tp * lay.cp * lay.dp // (lay.ep * lay.etp)


def expert_coords(rank: int, lay: Layout) -> tuple[int, int, int, int]:
    """`(etp_rank, ep_rank, edp_rank, pp_rank)` of global `rank`."""
    stage = lay.tp * lay.cp * lay.dp
    q, pp_rank = rank % stage, rank // stage
    return q % lay.etp, (q // lay.etp) % lay.ep, q // (lay.etp * lay.ep), pp_rank


def expert_rank_of(etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int, lay: Layout) -> int:
    """The global rank at the given expert-grid coordinates (inverse of `expert_coords`)."""
    stage = lay.tp * lay.cp * lay.dp
    return pp_rank * stage + (edp_rank * lay.ep + ep_rank) * lay.etp + etp_rank


def build_expert_groups(lay: Layout, make: Callable[[str, list[int]], None]) -> None:
    """Create the ep, etp and edp groups of every stage through `make(kind, ranks)` (which
    calls `new_group` for all ranks and keeps the caller's). Collective; a no-op without expert
    parallelism, so layouts without it build exactly the groups they did before."""
    if lay.ep * lay.etp == 1:
        return
    pps, eps, etps, edps = range(lay.pp), range(lay.ep), range(lay.etp), range(edp_size(lay))
    for p in pps:
        for d in edps:
            for t in etps:
                make("ep", [expert_rank_of(t, e, d, p, lay) for e in eps])
        for d in edps:
            for e in eps:
                make("etp", [expert_rank_of(t, e, d, p, lay) for t in etps])
        for e in eps:
            for t in etps:
                make("edp", [expert_rank_of(t, e, d, p, lay) for d in edps])


def expert_fields(rank: int, lay: Layout, mine: dict[str, Any]) -> dict[str, Any]:
    """The expert-parallel fields of `ParallelGroups` for `rank` (groups from `mine`)."""
    etp_rank, ep_rank, edp_rank, _ = expert_coords(rank, lay)
    return dict(ep_rank=ep_rank, ep_size=lay.ep, ep_group=mine.get("ep"),
                etp_rank=etp_rank, etp_size=lay.etp, etp_group=mine.get("etp"),
                edp_rank=edp_rank, edp_size=edp_size(lay), edp_group=mine.get("edp"))
