"""Multi-head latent attention (DeepSeek-V2/V3; shapes in `core.mla_config`), the decoder's
attention when `config.mla` is set, computed as transformers' `DeepseekV2Attention` /
`DeepseekV3Attention` compute it.

Tensor parallelism: query heads (`wq` or `wq_b`), their keys and values (`wkv_b`) and `wo` are
split by heads like the fused-QKV attention; the down-projections `wq_a`, `wkv_a` and their
norms are replicated. Every rank runs them on the whole (gathered) sequence, but each rank's
weight gradient covers only its own heads: they carry the `sequence_parallel` mark, so the tp
gradient sync sums them (as for `core.qk_norm.HeadNorm`); the input gradient of every rank is
partial too and is summed by the input's own tp mapping.

A KV cache stores the normed latent as the "keys" and the rotated shared key as the "values" of
one cache head (`kv_geometry`), so it holds `kv_lora_rank + qk_rope_head_dim` values per token
and layer; attention up-projects what it reads back with `wkv_b` (on every pass).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core import fused
from tessera.core.config import ModelConfig
from tessera.core.kv_cache import KVCache
from tessera.core.parallel.context_parallel import SequenceContext
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.core.parallel.mappings import copy_to_tp, gather_from_sequence
from tessera.core.parallel.random import recompute, tracker


def softmax_scale(config: ModelConfig) -> float:
    """The score scale: `qk_head_dim ** -0.5`, times yarn's `mscale(factor, mscale_all_dim)`
    squared when the rope is scaled and sets `mscale_all_dim` (as transformers' DeepSeek)."""
    scale = config.mla.qk_head_dim ** -0.5
    rope = config.rope_scaling
    if rope.type != "default" and rope.mscale_all_dim and rope.factor and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """`(x0, x1, x2, x3, ...)` as `(x0, x2, ..., x1, x3, ...)`: DeepSeek's pairs laid out as the
    halves rotate-half RoPE turns together. Queries and keys get the same permutation, so their
    products are DeepSeek's."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentNorm(nn.Module):
    """The RMSNorm of a latent (`width` values), replicated over tp (see the module docstring)."""

    def __init__(self, width: int, eps: float, tp_size: int):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))
        self.weight.sequence_parallel = tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


def _replicated(in_features: int, out_features: int, tp_size: int) -> ColumnParallelLinear:
    """A linear held whole by every tp rank, its gradient summed over tp (module docstring)."""
    linear = ColumnParallelLinear(in_features, out_features, False, None)
    linear.weight.sequence_parallel = tp_size > 1
    return linear


class LatentAttention(nn.Module):
    """Causal multi-head latent attention of decoder layer `layer` (the `Attention` contract of
    `core.models.decoder.model`: `(T, B, C)` in and out, T / tp rows under SP)."""

    def __init__(self, config: ModelConfig, layer: int, groups: ParallelGroups, sp: bool,
                 selective_recompute: bool):
        super().__init__()
        m, tp, c = config.mla, groups.tp_size, config.hidden_size
        self.mla, self.layer, self.sp, self.tp_group = m, layer, sp, groups.tp_group
        self.n_heads = config.num_heads // tp
        self.dropout, self.scale = config.dropout, softmax_scale(config)
        self.selective_recompute = selective_recompute  # recompute the scores in backward
        if m.q_lora_rank is None:
            self.wq = ColumnParallelLinear(c, self.n_heads * m.qk_head_dim, False, None)
        else:
            self.wq_a = _replicated(c, m.q_lora_rank, tp)
            self.q_a_norm = LatentNorm(m.q_lora_rank, m.latent_norm_eps, tp)
            self.wq_b = ColumnParallelLinear(m.q_lora_rank, self.n_heads * m.qk_head_dim, False,
                                             None)
        self.wkv_a = _replicated(c, m.cache_dims, tp)
        self.kv_a_norm = LatentNorm(m.kv_lora_rank, m.latent_norm_eps, tp)
        self.wkv_b = ColumnParallelLinear(m.kv_lora_rank,
                                          self.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                          False, None)
        self.wo = RowParallelLinear(self.n_heads * m.v_head_dim, c, False, groups.tp_group, sp)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.wq(x)
        return self.wq_b(self.q_a_norm(self.wq_a(x)))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        with tracker.fork() if p > 0 else contextlib.nullcontext():  # heads differ per tp rank
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                  is_causal=mask is None, scale=self.scale)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...] | None,
                cache: KVCache | None, positions: torch.Tensor | None,
                slots: torch.Tensor | None, seq: SequenceContext | None = None) -> torch.Tensor:
        if seq is not None:
            raise NotImplementedError("multi-head latent attention runs without context "
                                      "parallelism or packed documents")
        m = self.mla
        # The one tp input mapping of every projection below (they are all tp-local).
        x = gather_from_sequence(x, self.tp_group) if self.sp else copy_to_tp(x, self.tp_group)
        T, B = x.shape[:2]
        q = self._queries(x).unflatten(-1, (self.n_heads, m.qk_head_dim)).permute(1, 2, 0, 3)
        q_nope, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).transpose(0, 1).unsqueeze(1).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)  # (B, 1, T, r), (B, 1, T, rope)
        latent = self.kv_a_norm(latent)
        if m.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = fused.rotary(q_rot, *rope), fused.rotary(k_rot, *rope)
        mask = None
        if cache is not None:  # one cache head: the latent as keys, the rotary key as values
            latent, k_rot, mask = cache.update(self.layer, latent, k_rot, positions, slots)
        L = latent.shape[2]
        kv = self.wkv_b(latent).unflatten(-1, (self.n_heads, -1)).squeeze(1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)  # (B, nh, L, .)
        k = torch.cat([k_nope, k_rot.expand(B, self.n_heads, L, m.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        if self.selective_recompute and self.training and torch.is_grad_enabled():
            y = recompute(self._core, q, k, v, mask)
        else:
            y = self._core(q, k, v, mask)
        return self.wo(y.permute(2, 0, 1, 3).reshape(T, B, self.n_heads * m.v_head_dim))
