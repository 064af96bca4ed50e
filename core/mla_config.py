"""`MLAConfig`: multi-head latent attention (DeepSeek-V2/V3), a decoder attention option
(`ModelConfig.mla`). Torch-free: `core.config` holds one; `core.models.decoder.mla` computes it.

Keys and values come from one compressed latent per token: `kv_lora_rank` values (RMS-normed)
that `kv_b` expands to every head's `qk_nope_head_dim` key dims and `v_head_dim` value dims,
plus `qk_rope_head_dim` rotary key dims shared by all heads. Queries come from the hidden state
directly (`q_lora_rank` None) or through a normed rank-`q_lora_rank` bottleneck. A query head
has `qk_nope_head_dim + qk_rope_head_dim` dims (`ModelConfig.head_dim`); RoPE turns only the
last `qk_rope_head_dim` of them. What a KV cache keeps per token and layer is the latent and the
rotated shared key: `kv_lora_rank + qk_rope_head_dim` values, whatever the head count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """The shape of multi-head latent attention (transformers' DeepSeek field names)."""

    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    q_lora_rank: int | None = None  # None: one q projection from the hidden state
    # The rotary dims pair up as (x0, x1), (x2, x3), ... (DeepSeek's layout; V2 always, V3's
    # `rope_interleave`) rather than as the two halves (x_i, x_{i + d/2}).
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6  # of the q and kv latent RMSNorms (fixed in transformers)

    @property
    def qk_head_dim(self) -> int:
        """Dims of one query (and key) head: the unrotated part, then the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dims(self) -> int:
        """Values a KV cache keeps per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_problems(config: Any) -> list[str]:
    """Every reason a `ModelConfig` with `mla` set cannot run multi-head latent attention."""
    m: MLAConfig = config.mla
    out = []
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(m, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append(f"mla.{name}={value!r} must be a positive integer")
    if m.q_lora_rank is not None and (isinstance(m.q_lora_rank, bool)
                                      or not isinstance(m.q_lora_rank, int) or m.q_lora_rank < 1):
        out.append(f"mla.q_lora_rank={m.q_lora_rank!r} must be a positive integer or None")
    if out:
        return out
    if m.qk_rope_head_dim % 2:
        out.append(f"mla.qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE turns pairs)")
    if config.head_dim != m.qk_head_dim:
        out.append(f"head_dim={config.head_dim} must be mla.qk_nope_head_dim + "
                   f"mla.qk_rope_head_dim = {m.qk_head_dim} (leave head_dim None to get it)")
    if config.num_kv_heads != config.num_heads:
        out.append(f"num_kv_heads={config.num_kv_heads} must equal num_heads="
                   f"{config.num_heads}: every head reads the one shared latent")
    if config.position != "rope" or config.rotary_fraction != 1.0:
        out.append(f"position={config.position!r}, rotary_fraction={config.rotary_fraction} "
                   "must be 'rope' and 1.0 (mla.qk_rope_head_dim says which dims turn)")
    fixed = {"qk_norm": False, "bias": False, "qkv_bias": False, "sliding_window": None,
             "norm_placement": "input"}
    for name, value in fixed.items():
        if getattr(config, name) != value:
            out.append(f"{name}={getattr(config, name)!r} is not supported with multi-head "
                       f"latent attention (supported: {value!r})")
    return out
