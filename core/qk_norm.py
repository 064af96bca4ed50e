"""Per-head RMSNorm of queries and keys (Qwen3's `q_norm` / `k_norm`), on when `config.qk_norm`.

Each head's `head_dim` values are normalized in fp32 with `config.norm_eps` and multiplied by
one learned weight of shape `(head_dim,)` shared by all heads (one for q, one for k), after the
q/k projections and before RoPE, exactly as transformers' `Qwen3Attention` /
`Qwen3MoeAttention` compute it. The KV cache therefore stores normalized, rotated keys.

Tensor parallelism: heads are split over tp, the weights are replicated (`sharding.shard_spec`
gives them `dim=None`). Every rank normalizes only its own heads, so no communication is needed
forward, but each rank's weight gradient covers only its heads: the weights carry the
`sequence_parallel` mark, so `pipeline.sync_sequence_parallel_grads` sums them over tp (with or
without sequence parallelism; q and k are full-sequence here). With replicated kv heads
(tp > num_kv_heads) each replica's key gradient flows only from its own query heads, so the sum
over tp is still the true gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.core import fused
from tessera.core.config import ModelConfig


class HeadNorm(nn.Module):
    """RMSNorm over the last dimension (`head_dim`) of `(B, heads, T, head_dim)` tensors."""

    def __init__(self, config: ModelConfig, tp_size: int):
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.empty(config.head_dim))
        # Partial over tp (each rank sees its own heads): summed by the tp gradient sync.
        self.weight.sequence_parallel = tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)
