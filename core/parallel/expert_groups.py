"""The expert-parallel grid folded over each pipeline stage's ranks (pure Python: the planner
reads `edp_size`).

`core.config.Layout` documents the layout and why: within a stage, with
`q = (dp_rank * cp + cp_rank) * tp + tp_rank`, the expert grid runs etp fastest, then ep, then
edp. `expert_mesh` is that grid: the layout's mesh with a stage's (dp, cp, tp) re-factored as
(edp, ep, etp) over the same ranks. Its sub-meshes are the process groups, built by
`core.parallel.groups.init_groups` (whose `ParallelGroups` carries them):

- ep group: the ranks holding the other experts of a layer (same pp, etp and edp rank); the
  dispatchers exchange tokens over it;
- etp group: the ranks holding the other FFN slices of the same experts (same pp, ep and edp
  rank); tokens are gathered over it before the experts and outputs reduced after;
- edp group: the ranks holding the same expert shards (same pp, etp and ep rank); expert
  gradients are reduced over it and nothing else.
"""

from __future__ import annotations

from tessera.core.config import Layout
from tessera.core.parallel.mesh import RankMesh


def edp_size(lay: Layout) -> int:
    """Expert-data-parallel size: the stage's ranks `tp * cp * dp` over `ep * etp`."""
    return lay.tp * lay.cp * lay.dp // (lay.ep * lay.etp)


def expert_mesh(lay: Layout, dense: RankMesh) -> RankMesh:
    """The expert grid (pp, edp, ep, etp) over the ranks of `dense`, the layout's
    (pp, dp, cp, tp) mesh (`core.parallel.groups.layout_mesh`)."""
    return dense.regroup(["dp", "cp", "tp"], edp=edp_size(lay), ep=lay.ep, etp=lay.etp)
