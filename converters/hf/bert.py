"""The Hugging Face `BertForMaskedLM` / `BertForPreTraining` <-> Tessera BERT contract.

`tessera convert` imports, exports and reshards BERT like the decoder families. The decoder
of the masked-LM head is the word embedding (`cls.predictions.decoder.weight`, a tied copy
that transformers does not save) and its bias is `cls.predictions.bias` (`decoder.bias` is the
same tensor); both copies are skipped on import when present. `architectures` decides the
next-sentence head: `BertForPreTraining` has the pooler and `cls.seq_relationship`
(`options.binary_head=True`), `BertForMaskedLM` has neither (but a MaskedLM config whose weights hold
the head, as the original Hub checkpoints do, imports with it: `bert_head_from_weights`). HF
config features the Tessera model cannot compute (relative position embeddings, a decoder,
cross-attention, different hidden and attention dropouts) are errors that name the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set
from typing import Any

from tessera.converters.hf.family import (
    ConversionError,
    HfFamily,
    check_traits,
    require,
    with_shared_fields,
)
from tessera.core.config import ModelConfig
from tessera.core.models.bert.options import BertOptions

_L = "bert.encoder.layer.{}."
_NAMES: dict[str, tuple[str, ...]] = {
    "tok_embeddings.weight": ("bert.embeddings.word_embeddings.weight",),
    "pos_embeddings.weight": ("bert.embeddings.position_embeddings.weight",),
    "type_embeddings.weight": ("bert.embeddings.token_type_embeddings.weight",),
    "embed_norm.weight": ("bert.embeddings.LayerNorm.weight",),
    "embed_norm.bias": ("bert.embeddings.LayerNorm.bias",),
    **{f"layers.{{}}.attention.wqkv.{leaf}": tuple(f"{_L}attention.self.{p}.{leaf}"
                                                   for p in ("query", "key", "value"))
       for leaf in ("weight", "bias")},
    **{f"layers.{{}}.{ours}.{leaf}": (f"{_L}{theirs}.{leaf}",)
       for ours, theirs in (("attention.wo", "attention.output.dense"),
                            ("attention_norm", "attention.output.LayerNorm"),
                            ("feed_forward.w1", "intermediate.dense"),
                            ("feed_forward.w2", "output.dense"),
                            ("ffn_norm", "output.LayerNorm"))
       for leaf in ("weight", "bias")},
    "pooler.dense.weight": ("bert.pooler.dense.weight",),
    "pooler.dense.bias": ("bert.pooler.dense.bias",),
    "binary_head.weight": ("cls.seq_relationship.weight",),
    "binary_head.bias": ("cls.seq_relationship.bias",),
    "lm_head.dense.weight": ("cls.predictions.transform.dense.weight",),
    "lm_head.dense.bias": ("cls.predictions.transform.dense.bias",),
    "lm_head.layer_norm.weight": ("cls.predictions.transform.LayerNorm.weight",),
    "lm_head.layer_norm.bias": ("cls.predictions.transform.LayerNorm.bias",),
    "lm_head.bias": ("cls.predictions.bias",),
}

# HF entries that are tied copies or buffers: the decoder (the word embedding and
# `cls.predictions.bias` again) and the position-id buffer of older files.
_IGNORED = r"^cls\.predictions\.decoder\.(weight|bias)$|embeddings\.position_ids$"


_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The Tessera config of a HF BERT `config.json`; ConversionError for what it cannot run."""
    act = require(hf, "hidden_act", tuple(_ACTIVATIONS), "gelu")
    require(hf, "position_embedding_type", ("absolute",), "absolute")
    require(hf, "is_decoder", (False,), False)
    require(hf, "add_cross_attention", (False,), False)
    dropout = hf.get("hidden_dropout_prob", 0.1)
    require(hf, "attention_probs_dropout_prob", (dropout,), dropout)
    return ModelConfig(
        name="bert", family="bert", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-12), activation=_ACTIVATIONS[act],
        position="learned", bias=True, tied_embeddings=True, dropout=dropout,
        init_std=hf.get("initializer_range", 0.02),
        options=BertOptions(
            type_vocab_size=hf.get("type_vocab_size", 2),
            binary_head="BertForPreTraining" in (hf.get("architectures") or [])))


def _check_exportable(c: ModelConfig) -> None:
    check_traits(c)
    if c.num_kv_heads != c.num_heads or c.head_dim * c.num_heads != c.hidden_size:
        raise ConversionError(f"HF BERT has neither grouped-query attention nor a free head_dim: "
                              f"num_kv_heads {c.num_kv_heads}, head_dim {c.head_dim}")


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    head = "BertForPreTraining" if c.options.binary_head else "BertForMaskedLM"
    fields = dict(architectures=[head],
                  model_type="bert", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  intermediate_size=c.ffn_hidden_size,
                  hidden_act="gelu" if c.activation == "gelu" else "gelu_pytorch_tanh",
                  max_position_embeddings=c.max_position_embeddings,
                  type_vocab_size=c.options.type_vocab_size, layer_norm_eps=c.norm_eps,
                  hidden_dropout_prob=c.dropout, attention_probs_dropout_prob=c.dropout)
    return with_shared_fields(fields, c, **shared)


def _head_from_weights(config: ModelConfig, hf_names: Set[str]) -> ModelConfig:
    """`config` with the next-sentence head on when the HF weights hold it (pooler and
    `cls.seq_relationship`) although `architectures` says `BertForMaskedLM`, as the original
    BERT checkpoints on the Hub do; any other config is returned as it is."""
    head = {"bert.pooler.dense.weight", "cls.seq_relationship.weight"}
    if config.options.binary_head or not head <= set(hf_names):
        return config
    return dataclasses.replace(config, options=dataclasses.replace(config.options,
                                                                   binary_head=True))


BERT = HfFamily(
    family="bert", config_from_hf=_config_from_hf, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map=_NAMES, ignored=_IGNORED,
    from_weights=_head_from_weights)
