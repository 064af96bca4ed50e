"""The layout rules of T5 (`ModelConfig.family == "t5"`): global names and shapes, tensor-parallel
splits, and the pipeline split between encoder and decoder. `sharding.global_param_shapes` and
`sharding.shard_spec` hand T5 configs to `t5_param_shapes` and `t5_shard_spec`, so every
caller of those (checkpoints, converters, the server) sees T5 weights through the same rules.

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

Pipeline (`t5_stage_split`, `t5_stage_layers`): the first `encoder_stages` stages hold the
encoder (stage 0 also the shared embedding), the rest the decoder (its first stage another
copy of the embedding; the last stage the decoder norm and the output). Megatron calls the
first decoder stage the split rank. By default the stages are shared out in proportion to the
layer counts (at least one each).
"""

from __future__ import annotations

from tessera.core.config import ConfigError, Layout, ModelConfig, divisors
from tessera.core.parallel.sharding import ShardSpec


def decoder_layers(config: ModelConfig) -> int:
    """The decoder's layer count (`num_decoder_layers`, by default the encoder's)."""
    return config.num_layers if config.num_decoder_layers is None else config.num_decoder_layers


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
                    config.relative_attention_num_buckets, h)
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


def t5_stage_split(config: ModelConfig, num_stages: int, encoder_stages: int | None = None
                   ) -> int:
    """How many of `num_stages` pipeline stages hold the encoder (the rest hold the decoder).

    One stage holds both. Otherwise `encoder_stages` (default: in proportion to the layer
    counts, at least one stage each) must leave each stack's layers evenly divided.
    """
    if num_stages == 1:
        return 1
    enc, dec = config.num_layers, decoder_layers(config)
    if encoder_stages is None:
        encoder_stages = min(num_stages - 1, max(1, round(num_stages * enc / (enc + dec))))
    if not 1 <= encoder_stages < num_stages:
        raise ConfigError(f"encoder_stages {encoder_stages} must leave at least one of the "
                          f"{num_stages} pipeline stages to each of encoder and decoder")
    dec_stages = num_stages - encoder_stages
    if enc % encoder_stages or dec % dec_stages:
        raise ConfigError(
            f"T5 with {enc} encoder and {dec} decoder layers cannot split over {encoder_stages} "
            f"encoder + {dec_stages} decoder stages evenly; use encoder stages in "
            f"{divisors(enc)} and decoder stages in {divisors(dec)}")
    return encoder_stages


def t5_stage_layers(stage_id: int, num_stages: int, config: ModelConfig,
                    encoder_stages: int | None = None) -> tuple[range, range]:
    """(encoder layers, decoder layers) that pipeline stage `stage_id` holds."""
    split = t5_stage_split(config, num_stages, encoder_stages)
    enc, dec = config.num_layers, decoder_layers(config)
    if num_stages == 1:
        return range(enc), range(dec)
    if stage_id < split:
        per = enc // split
        return range(stage_id * per, (stage_id + 1) * per), range(0)
    per, k = dec // (num_stages - split), stage_id - split
    return range(0), range(k * per, (k + 1) * per)


def t5_model_problems(config: ModelConfig) -> list[str]:
    """What a `ModelConfig` of family "t5" sets that T5 does not compute (decoder-only flags),
    each with the value T5 needs; empty when it is a T5."""
    want = {"norm": ("rmsnorm",), "position": ("relative",), "activation": ("geglu", "relu"),
            "bias": (False,), "num_kv_heads": (config.num_heads,)}
    out = [f"T5 takes {field} in {list(allowed)}, got {getattr(config, field)!r}"
           for field, allowed in want.items() if getattr(config, field) not in allowed]
    if config.scaled_output and not config.tied_embeddings:
        out.append("scaled_output (the original T5's hidden_size ** -0.5 before the output) "
                   "goes with tied_embeddings; set both or neither")
    if decoder_layers(config) < 1 or config.num_layers < 1:
        out.append(f"T5 needs encoder and decoder layers, got {config.num_layers} and "
                   f"{decoder_layers(config)}")
    return out


def t5_layout_problems(config: ModelConfig, layout: Layout) -> list[str]:
    """What a layout cannot do for T5 (empty when it can), beyond `Layout.problems`."""
    out = []
    if layout.cp > 1:
        out.append(f"T5 runs without context parallelism (cp {layout.cp}); use cp 1")
    if layout.virtual_stages > 1:
        out.append(f"T5 runs one pipeline stage per rank (virtual_stages "
                   f"{layout.virtual_stages}); use virtual_stages 1")
    if config.num_heads % layout.tp:
        out.append(f"num_heads {config.num_heads} is not divisible by tp {layout.tp}")
    if config.ffn_hidden_size % layout.tp:
        out.append(f"ffn_hidden_size {config.ffn_hidden_size} is not divisible by tp {layout.tp}")
    try:
        t5_stage_split(config, layout.num_stages)
    except ConfigError as exc:
        out.append(str(exc))
    return out
