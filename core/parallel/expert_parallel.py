"""Token dispatchers for expert parallelism: move each token to the ranks holding its experts.

A dispatcher follows the protocol of the MoE layer (`core.moe.dispatch`; `LocalDispatcher` is
the one-rank case):

- `num_local_experts`, `local_expert_offset`: this rank holds global experts
  `[offset, offset + num_local_experts)` (ep rank r holds the r-th block of `moe.num_experts / ep`);
- `dispatch(x (n, h), expert_ids (n, k) int64, weights (n, k)) -> (xs (m, h), counts)`: the
  rows every local expert must process, grouped by local expert (`counts[e]` rows for local
  expert e, int64), gathered from the whole ep group (and the etp group, see below); dropped
  assignments (expert id -1) go nowhere;
- `combine(ys (m, h)) -> (n, h)`: for each of this rank's tokens, the weighted sum over its k
  experts' outputs, wherever they ran; tokens whose assignments were all dropped get zeros.

Both are differentiable end to end (in `x`, `weights` and whatever made `ys`). `combine` must
follow its own `dispatch` (the dispatcher keeps the routing between the two calls).

Two ways to move tokens over the ep group (`core.parallel.expert_groups` says which ranks):

- `AllToAllDispatcher`: tokens are permuted by expert (`core.moe.permute`), the per-expert
  counts exchanged, then one all-to-all with uneven splits sends each rank exactly the copies
  for its experts, and the reverse all-to-all brings the outputs back. The standard choice.
- `AllGatherDispatcher`: every ep rank gathers all tokens (and routing) of the group, keeps the
  copies for its own experts, and the partial outputs (each token's sum over the experts of
  this rank) are reduce-scattered back. More traffic, no count exchange; good for small ep
  or large top-k (Megatron's `allgather` dispatcher).

Expert tensor parallelism (etp > 1): the ranks of an etp group hold the same experts, each a
slice of every expert's FFN. After the ep exchange, each gathers the tokens of its etp peers
(regrouped by expert), so every slice sees every token of its experts; the partial outputs are
summed over the etp group and each rank keeps its own rows (a reduce-scatter). Each rank's
tokens must be its own (not copies of a tp peer's), which the layout checks require.

Uneven splits are moved with `dist.all_to_all_single` and split sizes (gloo supports them on
CPU), in a small autograd function whose backward is the reverse exchange; gathers and
reduce-scatters of uneven row counts are written with it too. (Not the autograd form in
`torch.distributed._functional_collectives`: its first call costs seconds of set-up in every
process, and `torch.distributed.nn.functional`'s is deprecated.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.core.moe.permute import permute, unpermute
from tessera.core.parallel.groups import ParallelGroups

Group = dist.ProcessGroup | None
DISPATCHERS = ("alltoall", "allgather")


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with split sizes; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: Group
                ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Group) -> torch.Tensor:
    """Rows `x` split by `send` (rows to each rank of `group`), received split by `recv`;
    differentiable (backward: the reverse exchange)."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(x, send, recv, group)


def _exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Each rank's `counts` reshaped `(ranks, c)`: block r goes to rank r; returns what every
    rank sent this one, `(ranks, c)` (no gradient)."""
    ranks = _size(group)
    if ranks == 1:
        return counts.reshape(1, -1)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out.reshape(ranks, -1)


def _row_counts(n: int, group: Group, device: torch.device) -> list[int]:
    """The row count of every rank of `group` (each passes its own `n`)."""
    ranks = _size(group)
    if ranks == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def gather_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """All ranks' rows of `x` (rank r has `sizes[r]`), concatenated in rank order, on every
    rank. Backward: each rank's rows get the sum of their gradients over the group."""
    ranks = _size(group)
    if ranks == 1:
        return x
    me = dist.get_rank(group)
    return all_to_all(x.repeat(ranks, *([1] * (x.dim() - 1))), [sizes[me]] * ranks, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    """The inverse of `gather_rows`: `x` holds rows for every rank (`sizes[r]` for rank r, in
    rank order); each rank gets the sum over the group of its rows. Backward: gather."""
    ranks = _size(group)
    if ranks == 1:
        return x
    me = dist.get_rank(group)
    received = all_to_all(x, sizes, [sizes[me]] * ranks, group)
    return received.reshape(ranks, sizes[me], *x.shape[1:]).sum(0)


def _gather_no_grad(x: torch.Tensor, sizes: list[int], group: Group) -> torch.Tensor:
    with torch.no_grad():
        return gather_rows(x, sizes, group)


def _group_by_expert(rows_per_source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows laid out source-major then expert-major (`rows_per_source[s, e]` rows of expert
    e from source s), the stable permutation that groups them expert-major then source-major,
    and the rows per expert."""
    sources, experts = rows_per_source.shape
    ids = torch.arange(experts, device=rows_per_source.device).repeat(sources)
    ids = ids.repeat_interleave(rows_per_source.reshape(-1))
    return torch.argsort(ids, stable=True), rows_per_source.sum(0)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class _Dispatcher:
    """What both dispatchers share: the expert range and the groups."""

    def __init__(self, groups: ParallelGroups, num_experts: int) -> None:
        if num_experts % groups.ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by ep "
                             f"{groups.ep_size}; use an ep that divides it")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // groups.ep_size
        self.local_expert_offset = groups.ep_rank * self.num_local_experts
        self.ep_group, self.etp_group = groups.ep_group, groups.etp_group
        self._state: dict | None = None

    def _take_state(self) -> dict:
        if self._state is None:
            raise RuntimeError("combine() called without a dispatch() before it")
        state, self._state = self._state, None
        return state


class AllToAllDispatcher(_Dispatcher):
    """Uneven all-to-all over the ep group, then an etp gather (see the module docstring)."""

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        ep, local = _size(self.ep_group), self.num_local_experts
        xs, order, counts = permute(x, expert_ids, self.num_experts)
        # counts[r * local + e]: copies this rank sends to local expert e of ep rank r.
        received = _exchange_counts(counts, self.ep_group)  # (ep, local): from each source
        send = counts.reshape(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = all_to_all(xs, send, recv, self.ep_group)
        ep_perm, per_expert = _group_by_expert(received)
        rows = rows[ep_perm]
        state = dict(order=order, weights=weights, send=send, recv=recv, ep_perm=ep_perm)
        if _size(self.etp_group) > 1:
            sizes = _row_counts(rows.shape[0], self.etp_group, rows.device)
            peer_counts = _gather_no_grad(per_expert.reshape(1, -1), [1] * len(sizes),
                                          self.etp_group)
            rows = gather_rows(rows, sizes, self.etp_group)
            etp_perm, per_expert = _group_by_expert(peer_counts)
            rows = rows[etp_perm]
            state.update(etp_sizes=sizes, etp_perm=etp_perm)
        self._state = state
        return rows, per_expert

    def combine(self, ys: torch.Tensor) -> torch.Tensor:
        s = self._take_state()
        if "etp_perm" in s:
            ys = reduce_scatter_rows(ys[_inverse(s["etp_perm"])], s["etp_sizes"], self.etp_group)
        ys = all_to_all(ys[_inverse(s["ep_perm"])], s["recv"], s["send"], self.ep_group)
        return unpermute(ys, s["order"], s["weights"])


class AllGatherDispatcher(_Dispatcher):
    """Every rank of the ep x etp block sees every token; partial outputs reduce-scattered."""

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = []  # per group, innermost first: the row count of each rank
        for group in (self.etp_group, self.ep_group):
            sizes.append(_row_counts(x.shape[0], group, x.device))
            x = gather_rows(x, sizes[-1], group)
            weights = gather_rows(weights, sizes[-1], group)
            expert_ids = _gather_no_grad(expert_ids, sizes[-1], group)
        local = expert_ids - self.local_expert_offset
        local = local.masked_fill((local < 0) | (local >= self.num_local_experts), -1)
        xs, order, counts = permute(x, local, self.num_local_experts)
        self._state = dict(order=order, weights=weights, sizes=sizes)
        return xs, counts

    def combine(self, ys: torch.Tensor) -> torch.Tensor:
        s = self._take_state()
        out = unpermute(ys, s["order"], s["weights"])
        for group, sizes in zip((self.ep_group, self.etp_group), reversed(s["sizes"])):
            out = reduce_scatter_rows(out, sizes, group)
        return out


def make_expert_parallel_dispatcher(groups: ParallelGroups, num_experts: int,
                                    kind: str = "alltoall") -> _Dispatcher:
    """The dispatcher `kind` ("alltoall" or "allgather") over this rank's ep and etp groups."""
    if kind == "alltoall":
        return AllToAllDispatcher(groups, num_experts)
    if kind == "allgather":
        return AllGatherDispatcher(groups, num_experts)
    raise ValueError(f"unknown token dispatcher {kind!r}; choose one of {list(DISPATCHERS)}")
