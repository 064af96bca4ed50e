"""The global parameter names and shapes of a BERT model (`core.models.bert.model`), for `sharding`.

The encoder layers reuse the decoder's names and split rules (fused `attention.wqkv`, column
`feed_forward.w1`, row `attention.wo` / `feed_forward.w2`; `attention_norm` is the LayerNorm
after attention, `ffn_norm` the one after the MLP). What BERT adds is replicated over tp except
the masked-LM decoder bias `lm_head.bias`, which follows the vocabulary like the embedding
(`bert_shard_spec`): the decoder is column-parallel over the (padded) vocabulary, its
weight the word embedding itself.
"""

from __future__ import annotations

from tessera.core.config import ModelConfig
from tessera.core.models.decoder.sharding import decoder_shard_spec
from tessera.core.parallel.sharding import ShardSpec


def bert_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global parameter of a BERT model and its unsharded shape, in module order."""
    c, hd, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (config.vocab_size, c),
        "pos_embeddings.weight": (config.max_position_embeddings, c),
        "type_embeddings.weight": (config.options.type_vocab_size, c),
        "embed_norm.weight": (c,), "embed_norm.bias": (c,),
    }
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * hd
    for i in range(config.num_layers):
        for name, (rows, cols) in (("attention.wqkv", (qkv_rows, c)),
                                   ("attention.wo", (c, config.num_heads * hd)),
                                   ("attention_norm", (c, 0)),
                                   ("feed_forward.w1", (f, c)),
                                   ("feed_forward.w2", (c, f)),
                                   ("ffn_norm", (c, 0))):
            # A norm's weight is a vector (cols 0); every BERT linear and norm has a bias.
            shapes[f"layers.{i}.{name}.weight"] = (rows, cols) if cols else (rows,)
            shapes[f"layers.{i}.{name}.bias"] = (rows,)
    if config.options.binary_head:
        shapes.update({"pooler.dense.weight": (c, c), "pooler.dense.bias": (c,),
                       "binary_head.weight": (2, c), "binary_head.bias": (2,)})
    shapes.update({"lm_head.dense.weight": (c, c), "lm_head.dense.bias": (c,),
                   "lm_head.layer_norm.weight": (c,), "lm_head.layer_norm.bias": (c,),
                   "lm_head.bias": (config.vocab_size,)})
    return shapes


def bert_shard_spec(name: str, config: ModelConfig) -> ShardSpec:
    """How the global BERT parameter `name` is split over the tensor-parallel group: the
    decoder's rules, and `lm_head.bias` over the vocabulary like the embedding."""
    if name == "lm_head.bias":
        return ShardSpec(dim=0, vocab=True)
    return decoder_shard_spec(name, config)
