"""The Hugging Face <-> Tessera contract of `LlamaForCausalLM` (model types llama and mistral,
a Llama with an optional sliding window on every layer: `ModelConfig.sliding_window`, written
back as a `MistralForCausalLM`).

Also the Llama-like pieces the other RoPE decoders build on (Nemotron, Qwen3, the MoE
families): the attention/norm/embedding name map, the shared config fields and RoPE. q/k/v are
stacked into the fused `attention.wqkv`, gate/up into the fused SwiGLU `feed_forward.w1`; the
split sizes on the way back come from `sharding.shard_spec`. The RoPE variants (llama3, linear,
dynamic, yarn, longrope) are read as transformers reads them (`rope_parameters`); an unknown
variant or rope key and separate attention/MLP bias flags are errors that name the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tessera.converters.hf.family import (
    ConversionError,
    HfFamily,
    NameMap,
    check_traits,
    require,
    with_shared_fields,
)
from tessera.core.config import ModelConfig
from tessera.core.rope_config import ROPE_TYPES, RopeScaling, rope_scaling_problems

LLAMA_LIKE: NameMap = {
    "tok_embeddings.weight": ("model.embed_tokens.weight",),
    "layers.{}.attention_norm.weight": ("model.layers.{}.input_layernorm.weight",),
    "layers.{}.attention_norm.bias": ("model.layers.{}.input_layernorm.bias",),
    "layers.{}.attention.wqkv.weight": ("model.layers.{}.self_attn.q_proj.weight",
                                        "model.layers.{}.self_attn.k_proj.weight",
                                        "model.layers.{}.self_attn.v_proj.weight"),
    "layers.{}.attention.wqkv.bias": ("model.layers.{}.self_attn.q_proj.bias",
                                      "model.layers.{}.self_attn.k_proj.bias",
                                      "model.layers.{}.self_attn.v_proj.bias"),
    "layers.{}.attention.wo.weight": ("model.layers.{}.self_attn.o_proj.weight",),
    "layers.{}.attention.wo.bias": ("model.layers.{}.self_attn.o_proj.bias",),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.post_attention_layernorm.weight",),
    "layers.{}.ffn_norm.bias": ("model.layers.{}.post_attention_layernorm.bias",),
    "layers.{}.feed_forward.w2.weight": ("model.layers.{}.mlp.down_proj.weight",),
    "layers.{}.feed_forward.w2.bias": ("model.layers.{}.mlp.down_proj.bias",),
    "norm.weight": ("model.norm.weight",),
    "norm.bias": ("model.norm.bias",),
    "output.weight": ("lm_head.weight",),
}

SWIGLU_MLP: NameMap = {
    "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_proj.weight",
                                         "model.layers.{}.mlp.up_proj.weight"),
    "layers.{}.feed_forward.w1.bias": ("model.layers.{}.mlp.gate_proj.bias",
                                       "model.layers.{}.mlp.up_proj.bias"),
}

# Cached RoPE frequencies, a buffer some files store.
ROTARY_BUFFERS = r"\.rotary_emb\.inv_freq$"



# The rope-parameter keys transformers reads; any other key is refused (never ignored).
_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
_ROPE_FIELDS = tuple(f.name for f in dataclasses.fields(RopeScaling) if f.name != "type")


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters of a config.json as transformers standardizes them: v5's
    `rope_parameters` or v4's `rope_scaling` (which wins when both are set), the top-level
    `rope_theta` / `partial_rotary_factor` as defaults, `rope_type` from the older `type`, and
    for llama3/yarn/longrope an `original_max_position_embeddings` taken from the top level when
    the config has one there (Phi-3), else from the dict, else `max_position_embeddings`."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if hf.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return params


def rope(hf: dict[str, Any], default_fraction: float) -> tuple[float, float, RopeScaling]:
    """(rope_theta, partial rotary fraction, the RoPE variant) of a config.json; a variant or
    a key Tessera does not compute is a ConversionError naming it and what is supported."""
    params = rope_parameters(hf)
    kind = params["rope_type"]
    if kind not in ROPE_TYPES:
        raise ConversionError(f"{hf.get('model_type')} config: rope type {kind!r} is not "
                              f"supported (supported: {', '.join(ROPE_TYPES)})")
    unknown = sorted(set(params) - set(_ROPE_KEYS) - set(_ROPE_FIELDS))
    if unknown:
        raise ConversionError(
            f"{hf.get('model_type')} config: rope parameter {unknown[0]}="
            f"{params[unknown[0]]!r} is not supported (the keys Tessera reads: "
            f"{', '.join(_ROPE_KEYS + _ROPE_FIELDS)})")
    fields = {k: params[k] for k in _ROPE_FIELDS if params.get(k) is not None}
    for name in ("short_factor", "long_factor"):
        if name in fields:
            fields[name] = [float(v) for v in fields[name]]
    try:
        scaling = RopeScaling(type=kind, **fields)
        fraction = params.get("partial_rotary_factor", default_fraction)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        problems = rope_scaling_problems(scaling, int(head_dim * fraction))
    except TypeError as e:
        raise ConversionError(f"{hf.get('model_type')} config: bad rope parameters: {e}") from e
    if problems:
        raise ConversionError(f"{hf.get('model_type')} config: " + "; ".join(problems))
    return float(params["rope_theta"]), float(fraction), scaling


def rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The `rope_parameters` of a config.json for `c` (its set fields only, as transformers
    writes them)."""
    fields = {k: v for k, v in dataclasses.asdict(c.rope_scaling).items()
              if k != "type" and v is not None}
    return {"rope_type": c.rope_scaling.type, "rope_theta": c.rope_theta, **fields}


def llama_like_fields(hf: dict[str, Any], default_fraction: float) -> dict[str, Any]:
    """The `ModelConfig` fields every Llama-like config.json gives the same way."""
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ConversionError(
            f"{hf['model_type']} config: attention_bias={attention_bias} but mlp_bias={mlp_bias}; "
            "Tessera has one `bias` flag for every linear layer, so both must be equal")
    theta, fraction, scaling = rope(hf, default_fraction)
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], position="rope",
        rope_theta=theta, rotary_fraction=fraction, rope_scaling=scaling,
        bias=bool(attention_bias),
        tied_embeddings=hf.get("tie_word_embeddings", False),
        dropout=hf.get("attention_dropout", 0.0), init_std=hf.get("initializer_range", 0.02))


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The `sliding_window` of a config.json whose window applies to every layer (Mistral,
    Phi-3): None when unset or when it covers every position (plain causal attention, the
    fast path); a value that is not a positive number of tokens is refused."""
    window = hf.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ConversionError(f"{hf['model_type']} config: sliding_window={window!r} is not "
                              "supported (supported: a positive number of tokens, or null)")
    if window is not None and window >= hf["max_position_embeddings"]:
        return None
    return window


def llama_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `LlamaForCausalLM` / `MistralForCausalLM` config.json."""
    require(hf, "hidden_act", ("silu",), "silu")
    window = sliding_window(hf)
    fields = llama_like_fields(hf, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"{hf['model_type']} config: partial_rotary_factor="
                              f"{fields['rotary_fraction']} is not supported for Llama models")
    return ModelConfig(name=hf["model_type"], family="llama", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                       sliding_window=window, **fields)


def rope_decoder_fields(c: ModelConfig, architecture: str, hidden_act: str) -> dict[str, Any]:
    """The `config.json` fields of a Llama-like dense model (norm epsilon excepted)."""
    return dict(architectures=[architecture], model_type=c.family, vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_act=hidden_act,
                max_position_embeddings=c.max_position_embeddings,
                attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = {**rope_decoder_fields(c, "LlamaForCausalLM", "silu"),
              "rope_parameters": rope_to_hf(c), "rope_theta": c.rope_theta,
              "rms_norm_eps": c.norm_eps}  # top-level keys: for v4
    if c.sliding_window is not None:  # Llama has no window: Mistral is Llama with one
        fields.update(architectures=["MistralForCausalLM"], model_type="mistral",
                      sliding_window=c.sliding_window)
        del fields["attention_bias"], fields["mlp_bias"]  # Mistral has no biases
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    # Mistral's window covers every layer; a per-layer choice has no Llama/Mistral field.
    clash: dict[str, Any] = {}
    if c.sliding_window_layers is not None:
        clash["sliding_window_layers"] = c.sliding_window_layers
    if c.sliding_window is not None and c.bias:  # written as a Mistral, which has none
        clash["bias"] = c.bias
    check_traits(c, clash)


LLAMA = HfFamily(
    family="llama", config_from_hf=llama_config,
    check_exportable=_check_exportable, config_to_hf=_config_to_hf,
    name_map={**LLAMA_LIKE, **SWIGLU_MLP}, ignored=ROTARY_BUFFERS, fp8_export=True)
