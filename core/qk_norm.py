"""RMSNorm of queries and keys, on when `config.qk_norm`, after the q/k projections and before
RoPE (so the KV cache stores normalized, rotated keys), in fp32 with `config.norm_eps`.

- `qk_norm_width="head"` (Qwen3's `q_norm` / `k_norm`, `HeadNorm`): each head's `head_dim`
  values are normalized and multiplied by one learned `(head_dim,)` weight shared by all heads
  (by `1 + weight`, in fp32, when `config.norm == "rmsnorm1p"`: Gemma 3).
  Under tensor parallelism heads are split, the weights replicated (`sharding.shard_spec` gives
  them `dim=None`). Every rank normalizes only its own heads, so no communication is needed
  forward, but each rank's weight gradient covers only its heads: the weights carry the
  `sequence_parallel` mark, so `pipeline.sync_sequence_parallel_grads` sums them over tp (with
  or without sequence parallelism; q and k are full-sequence here). With replicated kv heads
  (tp > num_kv_heads) each replica's key gradient flows only from its own query heads, so the
  sum over tp is still the true gradient.
- `qk_norm_width="projection"` (OLMo-2, `ProjectionNorm`): the whole q projection
  (`num_heads * head_dim` values) and the whole k projection are each one RMSNorm with a weight
  as wide. Under tensor parallelism each rank holds its heads' slice of the values and of the
  weight (split like the heads); the mean square needs every rank's sum of squares, an
  all-reduce whose backward is an all-reduce too (every rank's output depends on it). Keys
  replicated over ranks (tp > num_kv_heads) would be counted more than once: refused.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.core import fused
from tessera.core.config import ModelConfig
from tessera.core.errors import ConfigError
from tessera.core.parallel.mappings import Group, copy_to_tp, reduce_from_tp


class HeadNorm(nn.Module):
    """RMSNorm over the last dimension (`head_dim`) of `(B, heads, T, head_dim)` tensors."""

    def __init__(self, config: ModelConfig, tp_size: int):
        super().__init__()
        self.eps, self.offset = config.norm_eps, config.norm == "rmsnorm1p"
        self.weight = nn.Parameter(torch.empty(config.head_dim))
        # Partial over tp (each rank sees its own heads): summed by the tp gradient sync.
        self.weight.sequence_parallel = tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # weight stored as the offset from 1, applied in fp32 (Gemma)
            h = x.float()
            h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return fused.rms_norm(x, self.weight, self.eps)


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole projection of `heads` heads, of which this tp rank holds the
    `(..., local_width)` slice of its own heads (the last dimension of what it normalizes)."""

    def __init__(self, config: ModelConfig, heads: int, tp_size: int, group: Group):
        super().__init__()
        if tp_size > heads:
            raise ConfigError(
                f"qk_norm_width='projection' needs every tp rank to hold distinct kv heads, but "
                f"tp={tp_size} > num_kv_heads={heads}; use tp <= {heads}")
        self.eps, self.width, self.group = config.norm_eps, heads * config.head_dim, group
        self.weight = nn.Parameter(torch.empty(self.width // tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = h.square().sum(-1, keepdim=True)
        if self.group is not None:  # all-reduce forward and backward
            squares = copy_to_tp(reduce_from_tp(squares, self.group), self.group)
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * h).to(x.dtype)  # weight applied in fp32, as OLMo-2 does
