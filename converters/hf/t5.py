"""The Hugging Face <-> Tessera contract for `T5ForConditionalGeneration` (model type "t5").

`hf_io.import_hf` / `export_hf` and resharding work on T5 as on the decoder families (the tp
splits and pipeline split of T5 weights live in `core.models.t5.sharding`).

Config: `feed_forward_proj` "gated-gelu" (v1.1, `activation="geglu"`: transformers' gelu_new is
the tanh GELU) or "relu" (the original). Whether the output is tied to the embedding and whether
the decoder output is scaled by d_model ** -0.5 are two facts:
- scaled (`options.scaled_output`): transformers v5's `scale_decoder_outputs`; a v4 config has
  only `tie_word_embeddings`, which meant both;
- tied (`tied_embeddings`): v5 ties every T5 in memory (it always writes `tie_word_embeddings:
  true`) and stores `lm_head.weight` only when it differs from the embedding, so the files say
  it: tied when they hold no `lm_head.weight`, else untied (`_tied_from_weights`). A v4 config's
  `tie_word_embeddings: false` with no `lm_head.weight` reads tied too, as v5 loads it.
The export writes both (`tie_word_embeddings`, `scale_decoder_outputs`) and `lm_head.weight`
only when untied. Other activations (gated-silu, ...) are refused, as is
`options.num_decoder_layers` 0.

Tensors: q/k/v are stacked into `attention.wqkv`, cross-attention k/v into `wkv`, gated
`wi_0`/`wi_1` into `feed_forward.w1` ([gate; up]); the relative position bias of block 0 of
each stack is copied. The tied copies transformers may store (`encoder.embed_tokens`,
`decoder.embed_tokens`, `lm_head` when tied) and the unused cross-attention bias of old
checkpoints are not read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Set
from typing import Any

from tessera.converters.hf.family import ConversionError, HfFamily, TensorPairs
from tessera.core.config import ModelConfig
from tessera.core.models.t5.layout import decoder_layers
from tessera.core.models.t5.options import T5Options
from tessera.core.models.t5.sharding import t5_param_shapes

_ACTIVATIONS = {"gated-gelu": "geglu", "relu": "relu"}
_STACK = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.+)$")

# Tessera leaf (after `{stack}.layers.{i}.`) -> HF leaves after `{stack}.block.{i}.`, per stack.
_ENCODER = {
    "attention_norm.weight": ("layer.0.layer_norm.weight",),
    "attention.wqkv.weight": tuple(f"layer.0.SelfAttention.{x}.weight" for x in "qkv"),
    "attention.wo.weight": ("layer.0.SelfAttention.o.weight",),
    "attention.relative_attention_bias.weight": (
        "layer.0.SelfAttention.relative_attention_bias.weight",),
    "ffn_norm.weight": ("layer.1.layer_norm.weight",),
    "feed_forward.w2.weight": ("layer.1.DenseReluDense.wo.weight",),
}
_DECODER = {
    **{k: v for k, v in _ENCODER.items() if not k.startswith(("ffn", "feed"))},
    "cross_attention_norm.weight": ("layer.1.layer_norm.weight",),
    "cross_attention.wq.weight": ("layer.1.EncDecAttention.q.weight",),
    "cross_attention.wkv.weight": ("layer.1.EncDecAttention.k.weight",
                                   "layer.1.EncDecAttention.v.weight"),
    "cross_attention.wo.weight": ("layer.1.EncDecAttention.o.weight",),
    "ffn_norm.weight": ("layer.2.layer_norm.weight",),
    "feed_forward.w2.weight": ("layer.2.DenseReluDense.wo.weight",),
}
_TOP = {"tok_embeddings.weight": "shared.weight", "encoder.norm.weight":
        "encoder.final_layer_norm.weight", "decoder.norm.weight": "decoder.final_layer_norm.weight",
        "output.weight": "lm_head.weight"}


def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a transformers T5 `config.json` (v4 or v5)."""
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in _ACTIVATIONS:
        raise ConversionError(f"t5 config: feed_forward_proj={proj!r} is not supported "
                              f"(supported: {', '.join(map(repr, _ACTIVATIONS))})")
    if hf.get("num_decoder_layers") == 0:
        raise ConversionError("t5 config: num_decoder_layers=0 (an encoder only) is not a "
                              "T5ForConditionalGeneration")
    v4_tied = bool(hf.get("tie_word_embeddings", True))
    scaled = bool(hf.get("scale_decoder_outputs", v4_tied))
    # v5 always writes tie_word_embeddings true: there the weights decide (`_tied_from_weights`).
    tied = v4_tied if "scale_decoder_outputs" not in hf else False
    layers = hf.get("num_layers", 6)
    start = hf.get("decoder_start_token_id")
    return ModelConfig(
        name="t5", family="t5", vocab_size=hf["vocab_size"], hidden_size=hf["d_model"],
        num_layers=layers, num_heads=hf["num_heads"], head_dim=hf["d_kv"], ffn_hidden_size=hf["d_ff"],
        max_position_embeddings=hf.get("n_positions", 512), norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), activation=_ACTIVATIONS[proj],
        position="relative", bias=False, tied_embeddings=tied,
        dropout=hf.get("dropout_rate", 0.0),
        init_std=hf.get("initializer_factor", 1.0) * 0.05,
        options=T5Options(
            num_decoder_layers=hf.get("num_decoder_layers") or layers, scaled_output=scaled,
            relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
            decoder_start_token_id=hf.get("pad_token_id", 0) if start is None else start))


def _check_exportable(config: ModelConfig) -> None:
    """Raise ConversionError when `config` computes what no transformers T5 does."""
    want = dict(norm="rmsnorm", position="relative", bias=False, num_kv_heads=config.num_heads)
    have = {**dataclasses.asdict(config.options), **{k: getattr(config, k) for k in want}}
    clash = {k: have[k] for k, v in want.items() if have[k] != v}
    if config.activation not in ("geglu", "relu"):
        clash["activation"] = config.activation
    if clash:
        raise ConversionError(f"this t5 model cannot be written as a Hugging Face T5: {clash} "
                              f"differ from what it computes ({want}, activation geglu or relu)")


def _config_to_hf(config: ModelConfig, *, dtype: str, bos_token_id: int | None,
                  eos_token_id: int | list[int] | None, pad_token_id: int | None
                  ) -> dict[str, Any]:
    """The `config.json` of `config` for `T5ForConditionalGeneration` (v5 and v4 read it)."""
    c = config
    return dict(
        architectures=["T5ForConditionalGeneration"], model_type="t5", vocab_size=c.vocab_size,
        d_model=c.hidden_size, d_kv=c.head_dim, d_ff=c.ffn_hidden_size, num_layers=c.num_layers,
        num_decoder_layers=decoder_layers(c), num_heads=c.num_heads,
        relative_attention_num_buckets=c.options.relative_attention_num_buckets,
        relative_attention_max_distance=c.options.relative_attention_max_distance,
        dropout_rate=c.dropout, layer_norm_epsilon=c.norm_eps,
        initializer_factor=c.init_std / 0.05,
        feed_forward_proj="gated-gelu" if c.activation == "geglu" else "relu",
        is_encoder_decoder=True, n_positions=c.max_position_embeddings,
        # v4 reads the tying from tie_word_embeddings, v5 the scaling from scale_decoder_outputs
        # (and unties a stored lm_head that differs from the embedding).
        tie_word_embeddings=c.tied_embeddings, scale_decoder_outputs=c.options.scaled_output,
        decoder_start_token_id=c.options.decoder_start_token_id,
        pad_token_id=c.options.decoder_start_token_id if pad_token_id is None else pad_token_id,
        eos_token_id=eos_token_id, bos_token_id=bos_token_id, dtype=dtype, torch_dtype=dtype)


def _tensor_pairs(config: ModelConfig, hf_names: Set[str] | None) -> TensorPairs:
    """(Tessera global name, [(HF name, transposed?), ...]) in `t5_param_shapes` order."""
    gated = config.gated
    for name in t5_param_shapes(config):
        if name in _TOP:
            yield name, [(_TOP[name], False)]
            continue
        m = _STACK.match(name)
        stack, layer, leaf = m.group(1), m.group(2), m.group(3)
        if leaf == "feed_forward.w1.weight":
            idx = 1 if stack == "encoder" else 2
            subs = ("wi_0", "wi_1") if gated else ("wi",)
            hf = tuple(f"layer.{idx}.DenseReluDense.{s}.weight" for s in subs)
        else:
            hf = (_ENCODER if stack == "encoder" else _DECODER)[leaf]
        yield name, [(f"{stack}.block.{layer}.{h}", False) for h in hf]


def _unread(config: ModelConfig) -> set[str]:
    """HF tensors a T5 import may find and leaves unread: the tied copies and the unused
    cross-attention bias of old checkpoints."""
    out = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
           "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}
    if config.tied_embeddings:
        out.add("lm_head.weight")
    return out


def _tied_from_weights(config: ModelConfig, hf_names: Set[str]) -> ModelConfig:
    """`config` tied when the files hold no `lm_head.weight` (transformers v5 then ties it to
    the embedding in memory), untied when they hold one and the config did not say tied."""
    tied = config.tied_embeddings or "lm_head.weight" not in hf_names
    return dataclasses.replace(config, tied_embeddings=tied)


T5 = HfFamily(
    family="t5", config_from_hf=_config_from_hf, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, pairs=_tensor_pairs, unread=_unread,
    from_weights=_tied_from_weights)
