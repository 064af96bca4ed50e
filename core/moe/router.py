"""The MoE router: scores, top-k choice, weight normalization, capacity, expert bias.

`Router(x (n, h))` returns a `Routing`: for each of the n tokens the k experts it goes to
(`expert_ids (n, k)` int64, `-1` where capacity dropped the assignment, as `core.moe.permute`
expects) and their weights `(n, k)`, plus what the losses and metrics need (the fp32 logits and
the per-expert scores over all experts).

- Scores: `softmax(logits)` (Mixtral, Qwen2-MoE) or `sigmoid(logits)` (DeepSeek-V3 style).
  Logits are computed in fp32 whatever the model dtype (Megatron's recommendation: routing
  decisions are discrete, and bf16 ties flip them).
- The k experts with the highest `score + expert_bias` are chosen; the bias (aux-loss-free
  balancing, Wang et al. 2024, arXiv 2408.15664) only steers the choice, the weights are the
  unbiased scores. With `moe.norm_topk` the k weights are divided by their sum; then all are
  multiplied by `moe.routed_scale`.
- Group-limited choice (`moe.num_groups` > 1, DeepSeek-V2/V3): the experts form `num_groups`
  contiguous equal groups; a group's score is the best of its (bias-added) choice scores
  (`group_score` "max", V2's group_limited_greedy) or the sum of its best two ("top2_sum", V3's
  noaux_tc); each token picks its k experts only among its `moe.topk_groups` best groups. As
  transformers' DeepseekV2/V3 routers compute it.
- Capacity (`moe.capacity_factor`, None: dropless): each expert takes at most
  `ceil(n * k / E * factor)` of the n local tokens' assignments, first choices before second
  ones and earlier tokens before later ones (GShard's priority); the rest are dropped (`-1`)
  before any dispatch, so every expert-parallel dispatcher sees the same decision.
  The n tokens are those this rank routes in one forward, never the global batch: its
  micro-batch rows (data and expert parallelism), and of each row only its sequence chunk under
  sequence parallelism (`T / tp` positions) and context parallelism (its two zigzag chunks,
  `T / cp` positions, in position order). Tensor parallelism without SP routes every token on
  every tp rank, the same decision on each. So with SP or cp the drops are those of one process
  routing each rank's chunk separately, not the whole sequence (checked in
  tests/distributed/test_moe_parallel.py). Megatron-Core decides capacity the same way:
  `moe_utils.get_capacity(num_tokens * topk, E, factor)` with num_tokens the rows of the
  router's local logits (`topk_routing_with_score_function`, `apply_router_token_dropping`);
  its default drop policy keeps each expert's highest-probability assignments instead of this
  priority order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """One routing decision for n tokens over E experts (see the module docstring)."""

    expert_ids: torch.Tensor  # (n, k) int64, -1 for dropped assignments
    weights: torch.Tensor  # (n, k) fp32 combine weights (unbiased scores, maybe normalized,
    # times routed_scale)
    logits: torch.Tensor  # (n, E) fp32 router logits (z-loss)
    scores: torch.Tensor  # (n, E) fp32 scores over all experts, summing to 1 per token (aux)
    chosen: torch.Tensor  # (n, k) int64 top-k choice before dropping (aux loss counts)


class Router(nn.Module):
    """Top-k token-choice router with weight `(E, hidden)` and optional `expert_bias (E,)`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 norm_topk: bool = True, capacity_factor: float | None = None,
                 expert_bias: bool = False, routed_scale: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1, group_score: str = "max"):
        super().__init__()
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.norm_topk, self.capacity_factor = norm_topk, capacity_factor
        self.routed_scale = routed_scale
        self.num_groups, self.topk_groups, self.group_score = num_groups, topk_groups, group_score
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # A parameter (so checkpoints, sharding and converters carry it like any weight) that no
        # gradient trains: `core.moe.stats.update_expert_bias` moves it after each step.
        self.expert_bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False)
                            if expert_bias else None)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())  # (n, E)
        if self.score == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        select = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.num_groups > 1:
            select = self._limit_to_groups(select)
        chosen = torch.topk(select, self.top_k, dim=-1).indices  # (n, k)
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        if self.score == "sigmoid":  # the aux loss wants a distribution per token
            scores = scores / scores.sum(dim=-1, keepdim=True)
        expert_ids = chosen
        if self.capacity_factor is not None:
            expert_ids = drop_over_capacity(chosen, self.num_experts,
                                            capacity(x.shape[0], self.top_k, self.num_experts,
                                                     self.capacity_factor))
        return Routing(expert_ids, weights, logits, scores, chosen)

    def _limit_to_groups(self, select: torch.Tensor) -> torch.Tensor:
        """`select (n, E)` with every expert outside each token's `topk_groups` best groups set
        to -inf (never chosen)."""
        n = select.shape[0]
        grouped = select.view(n, self.num_groups, -1)
        if self.group_score == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, self.topk_groups, dim=-1).indices  # (n, topk_groups)
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(n, -1)


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments each expert takes: `ceil(tokens * k / E * factor)` (Megatron's rule)."""
    return math.ceil(num_tokens * top_k / num_experts * factor)


def drop_over_capacity(chosen: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """`chosen (n, k)` with the assignments beyond each expert's first `cap` set to -1, in
    priority order: choice slot first (all first choices before any second), then token."""
    n, k = chosen.shape
    flat = chosen.t().reshape(-1)  # priority order: (k * n,)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    kept = torch.where(rank < cap, flat, torch.full_like(flat, -1))
    return kept.reshape(k, n).t().contiguous()
