"""The token-dispatcher seam: how an MoE layer gets token copies to the ranks holding experts.

An MoE layer asks `make_dispatcher(groups, config)` for one `Dispatcher` and, per forward:

    xs, counts = dispatcher.dispatch(x, expert_ids, weights)   # before the experts
    ys = experts(xs, counts)                                     # local experts only
    out = dispatcher.combine(ys)                                 # after them

- `x (n, h)`: this rank's tokens; `expert_ids (n, k)` int64 global expert ids, `-1` for
  assignments the router dropped; `weights (n, k)` the combine weights.
- `xs (m, h)`: the copies this rank's experts must process, grouped by LOCAL expert (local
  expert j is global expert `local_expert_offset + j`), and `counts (num_local_experts,)` int64,
  the rows per local expert (`xs` rows `[sum(counts[:j]), sum(counts[:j+1]))` go to expert j).
- `combine(ys (m, h)) -> (n, h)`: the copies brought back to their tokens, each token's output
  the weighted sum over its kept copies (`core.moe.permute.unpermute`); zeros for a token whose
  assignments were all dropped. It pairs with the last `dispatch` call (the dispatcher keeps
  that call's routing until `combine`).
Both directions are differentiable in `x`, `ys` and `weights`.

`LocalDispatcher` (every expert on this rank, expert parallelism 1) is `core.moe.permute` as is.
The expert-parallel dispatchers (all-to-all, all-gather) implement the same protocol; this
function is the one place that chooses.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tessera.core.moe.permute import permute, unpermute
from tessera.core.parallel.expert_parallel import make_expert_parallel_dispatcher


class Dispatcher(Protocol):
    """What an MoE layer needs from a token dispatcher (see the module docstring)."""

    num_local_experts: int
    local_expert_offset: int

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def combine(self, ys: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    """All `moe.num_experts` experts live on this rank: permute, and unpermute back."""

    def __init__(self, num_experts: int):
        self.num_local_experts, self.local_expert_offset = num_experts, 0
        self._state: tuple[torch.Tensor, torch.Tensor] | None = None

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        xs, order, counts = permute(x, expert_ids, self.num_local_experts)
        self._state = (order, weights)
        return xs, counts

    def combine(self, ys: torch.Tensor) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("combine() called before dispatch()")
        (order, weights), self._state = self._state, None
        return unpermute(ys, order, weights)


def make_dispatcher(groups: Any, config: Any, kind: str = "alltoall") -> Dispatcher:
    """The dispatcher for an MoE layer of `config` on this rank's `groups` (`ParallelGroups`).

    Expert parallelism 1 (ep x etp = 1): every expert is local (`LocalDispatcher`; `kind` does
    not matter). Otherwise the expert-parallel dispatcher `kind` ("alltoall" or "allgather",
    `TrainSchedule.moe_dispatcher`) over the rank's ep and etp groups
    (`core.parallel.expert_parallel`).
    """
    if groups.ep_size * groups.etp_size > 1:
        return make_expert_parallel_dispatcher(groups, config.moe.num_experts, kind)
    return LocalDispatcher(config.moe.num_experts)
