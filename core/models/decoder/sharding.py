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
