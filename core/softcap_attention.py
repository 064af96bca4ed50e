"""Causal attention with scores soft-capped as Gemma 2 computes them: `cap * tanh(s / cap)` of
the scaled scores `s = q k^T * scale`, then the mask, softmax in fp32, dropout, times v.

Scaled-dot-product kernels have no soft cap, so this is the plain matmul form: O(T x L) memory
per head, fine for the sequence lengths it serves here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None, scale: float, cap: float,
                         dropout: float = 0.0) -> torch.Tensor:
    """`q (B, H, T, D)`, `k`/`v (B, Hkv, L, D)` (grouped-query heads repeated here), `mask
    (B, 1, T, L)` True = attend, or None: causal with the T queries at the end of the L keys."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        T, L = scores.shape[-2:]
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0:
        weights = F.dropout(weights, dropout, True)
    return torch.matmul(weights, v)
