"""The sharding rules of T5 (family "t5"): global names and shapes, and tensor-parallel splits.
They are the T5 family's `param_shapes` and `shard_spec` (`family.T5`), so every caller of
`sharding.global_param_shapes` / `sharding.shard_spec` (checkpoints, converters, the server)
sees T5 weights through the same rules.

Global names (the checkpoint's), `{i}` a layer index of its stack:

    tok_embeddings.weight                          (V, C)   shared by encoder and decoder input
    encoder.layers.{i}.attention_norm.weight       (C,)
    encoder.layers.{i}.attention.wqkv.weight       (3 H d, C)  [q; k; v], split per head
    encoder.layers.{i}.attention.wo.weight         (C, H d)    row parallel
    encoder.layers.0.attention.relative_attention_bias.weight  (buckets, H)  split by heads
    encoder.layers.{i}.ffn_norm.weight, feed_forward.w1 ([gate; up] or one), feed_forward.w2
    encoder.norm.weight
    decoder.layers.{i}.{attention_norm, attention.*, ffn_norm, feed_forward.*} as the encoder
    decoder.layers.{i}.cross_attention_norm.weight (C,)
    decoder.layers.{i}.cross_attention.wq.weight   (H d, C)    column parallel
    decoder.layers.{i}.cross_attention.wkv.weight  (2 H d, C)  [k; v] of the encoder output
    decoder.layers.{i}.cross_attention.wo.weight   (C, H d)    row parallel
    decoder.norm.weight
    output.weight                                  (V, C)   absent when tied to the embedding

The relative position bias is held by layer 0 of each stack, as Hugging Face does, and shared
by the stack's later layers; its columns are heads, so tp rank r holds the columns of its own
query heads. T5 has no grouped-query attention and no biases on its linears.

How pipeline stages share out encoder and decoder: `core.models.t5.layout`.
"""

from __future__ import annotations

from tessera.core.config import ModelConfig
from tessera.core.models.t5.layout import decoder_layers
from tessera.core.parallel.sharding import ShardSpec


def t5_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global T5 parameter name and its shape, in module order."""
    c, h, d = config.hidden_size, config.num_heads, config.head_dim
    ffn_rows = config.ffn_hidden_size * (2 if config.gated else 1)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, c)}
    for stack, n in (("encoder", config.num_layers), ("decoder", decoder_layers(config))):
        for i in range(n):
            p = f"{stack}.layers.{i}"
            shapes[f"{p}.attention_norm.weight"] = (c,)
            shapes[f"{p}.attention.wqkv.weight"] = (3 * h * d, c)
            shapes[f"{p}.attention.wo.weight"] = (c, h * d)
            if i == 0:
                shapes[f"{p}.attention.relative_attention_bias.weight"] = (
                    config.options.relative_attention_num_buckets, h)
            if stack == "decoder":
                shapes[f"{p}.cross_attention_norm.weight"] = (c,)
                shapes[f"{p}.cross_attention.wq.weight"] = (h * d, c)
                shapes[f"{p}.cross_attention.wkv.weight"] = (2 * h * d, c)
                shapes[f"{p}.cross_attention.wo.weight"] = (c, h * d)
            shapes[f"{p}.ffn_norm.weight"] = (c,)
            shapes[f"{p}.feed_forward.w1.weight"] = (ffn_rows, c)
            shapes[f"{p}.feed_forward.w2.weight"] = (c, config.ffn_hidden_size)
        shapes[f"{stack}.norm.weight"] = (c,)
    if not config.tied_embeddings:
        shapes["output.weight"] = (config.vocab_size, c)
    return shapes


_LINEARS = ("attention.wqkv", "attention.wo", "cross_attention.wq", "cross_attention.wkv",
            "cross_attention.wo", "feed_forward.w1", "feed_forward.w2")


def t5_lora_modules(config: ModelConfig) -> list[str]:
    """Every linear layer of the encoder and decoder blocks (the modules LoRA may adapt), in
    model order: `{encoder,decoder}.layers.N.attention.wqkv`, ..., `feed_forward.w2`."""
    modules = (n.removesuffix(".weight") for n in t5_param_shapes(config))
    return [m for m in modules if ".layers." in m and m.split(".", 3)[-1] in _LINEARS]


def t5_shard_spec(name: str, config: ModelConfig) -> ShardSpec:
    """How the global T5 parameter `name` is split over the tensor-parallel group."""
    if name in ("tok_embeddings.weight", "output.weight"):
        return ShardSpec(dim=0, vocab=True)
    h, hd = config.num_heads, config.num_heads * config.head_dim
    leaf = name.split(".", 3)[-1] if ".layers." in name else name
    if leaf == "attention.wqkv.weight":
        return ShardSpec(dim=0, parts=(hd, hd, hd), heads=(h, h, h))
    if leaf == "cross_attention.wkv.weight":
        return ShardSpec(dim=0, parts=(hd, hd), heads=(h, h))
    if leaf == "cross_attention.wq.weight":
        return ShardSpec(dim=0)
    if leaf == "feed_forward.w1.weight":
        f = config.ffn_hidden_size
        return ShardSpec(dim=0, parts=(f, f) if config.gated else None)
    if leaf in ("attention.wo.weight", "cross_attention.wo.weight", "feed_forward.w2.weight",
                "attention.relative_attention_bias.weight"):
        return ShardSpec(dim=1)
    return ShardSpec(dim=None)  # norms
