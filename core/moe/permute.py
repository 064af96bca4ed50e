"""Token permutation for Mixture-of-Experts: group token copies by expert, and back.

This is the one contract between the router (which picks experts), the token dispatchers (which
move tokens to the ranks holding their experts) and the experts (which run one grouped matrix
product over contiguous per-expert rows):

- `expert_ids` is `(n, k)` int64, the k experts chosen for each of n tokens; an assignment the
  router dropped (capacity exceeded) is `-1`.
- `permute` returns the kept copies of the rows of `x` sorted by expert (stable: within one
  expert, in token order, then in choice order), the flat assignment index `order` of each copy
  (`order // k` is its token), and `counts[e]`, the number of copies for expert e.
- `unpermute` is the inverse: it scales each copy by its routing weight and sums the k copies of
  each token; a token whose assignments were all dropped gets zeros.

No Python loop over tokens or experts; both directions are differentiable in `x`, `ys` and
`weights`.
"""

from __future__ import annotations

import torch


def permute(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(xs, order, counts)`: copies of `x`'s rows grouped by expert, their flat assignment
    indices into `expert_ids.reshape(-1)`, and the copies per expert (`(num_experts,)` int64)."""
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must be (tokens, k) with tokens = {x.shape[0]}, "
                         f"got {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    kept = torch.nonzero(flat >= 0).squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.bincount(flat[kept], minlength=num_experts)
    return x[order // k], order, counts


def unpermute(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`(n, h)`: for each token, the sum over its kept copies in `ys` of weight x copy.

    `ys` is `(m, h)` in `permute`'s order, `weights` the router's `(n, k)` weights."""
    n, k = weights.shape
    scale = weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
    out = ys.new_zeros(n, ys.shape[1])
    return out.index_add(0, order // k, ys * scale)
