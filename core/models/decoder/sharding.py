"""The decoder's global parameter names and shapes, and their tensor-parallel splits (the
general rules are in `core.parallel.sharding`'s docstring: fused QKV and SwiGLU parts, kv-head
replication, vocabulary padding, expert banks)."""

from __future__ import annotations

import re

from tessera.core.config import ModelConfig
from tessera.core.models.registry import family
from tessera.core.moe.shapes import is_moe_layer, moe_param_shapes, moe_split
from tessera.core.parallel.sharding import ShardSpec

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def norm_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One `Norm`'s parameters: a weight, and a bias unless it is an RMSNorm."""
    c = config.hidden_size
    rms = config.norm in ("rmsnorm", "rmsnorm1p")
    return {"weight": (c,)} if rms else {"weight": (c,), "bias": (c,)}


def decoder_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global decoder parameter name and its unsharded shape, in module order."""
    c, hd = config.hidden_size, config.head_dim
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * hd
    ffn_rows = config.ffn_hidden_size * (2 if config.gated else 1)
    one_norm = (family(config).norm_shapes or norm_shapes)(config)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, c)}
    if config.position == "learned":
        shapes["pos_embeddings.weight"] = (config.max_position_embeddings, c)

    def linear(prefix: str, out_f: int, in_f: int, bias: bool = config.bias) -> None:
        shapes[f"{prefix}.weight"] = (out_f, in_f)
        if bias:
            shapes[f"{prefix}.bias"] = (out_f,)

    def norm(prefix: str) -> None:
        shapes.update({f"{prefix}.{leaf}": shape for leaf, shape in one_norm.items()})

    for i in range(config.num_layers):
        norm(f"layers.{i}.attention_norm")
        if config.mla is not None:  # multi-head latent attention (core.models.decoder.mla)
            shapes.update(mla_param_shapes(config, i))
        else:
            linear(f"layers.{i}.attention.wqkv", qkv_rows, c, config.qkv_bias)
            linear(f"layers.{i}.attention.wo", c, config.num_heads * hd)
        if config.qk_norm:  # q/k RMSNorm (core.qk_norm): per head, or over the projection
            wide = config.qk_norm_width == "projection"
            shapes[f"layers.{i}.attention.q_norm.weight"] = (config.num_heads * hd if wide else hd,)
            shapes[f"layers.{i}.attention.k_norm.weight"] = (
                config.num_kv_heads * hd if wide else hd,)
        if config.norm_placement == "sandwich":  # Gemma 2: a norm after the attention too
            norm(f"layers.{i}.post_attention_norm")
        norm(f"layers.{i}.ffn_norm")
        if is_moe_layer(config, i):  # Mixture-of-Experts: router, experts (core.moe.shapes)
            shapes.update(moe_param_shapes(config, i))
            continue
        linear(f"layers.{i}.feed_forward.w1", ffn_rows, c)
        linear(f"layers.{i}.feed_forward.w2", c, config.ffn_hidden_size)
        if config.norm_placement == "sandwich":
            norm(f"layers.{i}.post_ffn_norm")
    norm("norm")
    if not config.tied_embeddings:
        shapes["output.weight"] = (config.vocab_size, c)
    return shapes


def mla_param_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s multi-head latent attention parameters and their shapes."""
    m, c, nh, p = config.mla, config.hidden_size, config.num_heads, f"layers.{layer}.attention"
    shapes: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank is None:
        shapes[f"{p}.wq.weight"] = (nh * m.qk_head_dim, c)
    else:
        shapes[f"{p}.wq_a.weight"] = (m.q_lora_rank, c)
        shapes[f"{p}.q_a_norm.weight"] = (m.q_lora_rank,)
        shapes[f"{p}.wq_b.weight"] = (nh * m.qk_head_dim, m.q_lora_rank)
    shapes[f"{p}.wkv_a.weight"] = (m.cache_dims, c)
    shapes[f"{p}.kv_a_norm.weight"] = (m.kv_lora_rank,)
    shapes[f"{p}.wkv_b.weight"] = (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes[f"{p}.wo.weight"] = (c, nh * m.v_head_dim)
    return shapes


# Multi-head latent attention: the per-head projections split by heads (rows are head-major,
# so even row chunks are whole heads); the down-projections and their norms replicated.
_MLA_BY_HEADS = ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_b.weight")


def decoder_shard_spec(name: str, config: ModelConfig) -> ShardSpec:
    """How the global decoder parameter `name` is split over the tensor-parallel group."""
    if name in ("tok_embeddings.weight", "output.weight"):
        return ShardSpec(dim=0, vocab=True)
    m = _LAYER.match(name)
    local = m.group(2) if m else name
    hd = config.head_dim
    moe = moe_split(local, config)  # Mixture-of-Experts weights (core.moe.shapes)
    if moe is not None:
        return ShardSpec(**moe)
    if config.mla is not None and local in _MLA_BY_HEADS:
        return ShardSpec(dim=0)
    if local.startswith("attention.wqkv."):
        nh, nkv = config.num_heads, config.num_kv_heads
        return ShardSpec(dim=0, parts=(nh * hd, nkv * hd, nkv * hd), heads=(nh, nkv, nkv))
    if local.startswith("feed_forward.w1."):
        f = config.ffn_hidden_size
        return ShardSpec(dim=0, parts=(f, f) if config.gated else None)
    if local in ("attention.wo.weight", "feed_forward.w2.weight"):
        return ShardSpec(dim=1)
    if local in ("attention.q_norm.weight", "attention.k_norm.weight") and (
            config.qk_norm_width == "projection"):  # split with the heads it spans
        heads = config.num_heads if local.startswith("attention.q") else config.num_kv_heads
        return ShardSpec(dim=0, parts=(heads * hd,), heads=(heads,))
    # Norms, position embeddings and row-parallel biases (added after the all-reduce).
    return ShardSpec(dim=None)
