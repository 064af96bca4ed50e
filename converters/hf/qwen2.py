"""The Hugging Face <-> Tessera contract of Qwen2 / Qwen2.5 dense: `Qwen2ForCausalLM` (family
`qwen2`).

Qwen2 is Llama with biases on q, k and v only (`ModelConfig.qkv_bias`, the o projection and the
MLP have none), RMSNorm eps 1e-6 and, for the small sizes, the output tied to the embedding.
`model.layers.{i}.self_attn.{q,k,v}_proj.bias` stack into `layers.{i}.attention.wqkv.bias`.
Sliding-window layers (`use_sliding_window`, `layer_types` other than full attention) are
refused: Tessera attends to the whole causal context.
"""

from __future__ import annotations

from typing import Any

from tessera.converters.hf.family import (
    ConversionError,
    HfFamily,
    check_traits,
    require,
    with_shared_fields,
)
from tessera.converters.hf.llama import (
    LLAMA_LIKE,
    ROTARY_BUFFERS,
    SWIGLU_MLP,
    llama_like_fields,
    rope_to_hf,
)
from tessera.core.config import ModelConfig


def full_attention_only(hf: dict[str, Any]) -> None:
    """Refuse a Qwen config with sliding-window layers, naming the field."""
    require(hf, "use_sliding_window", (False, None), False)
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds:
        raise ConversionError(f"{hf['model_type']} config: layer_types holds {kinds}; only "
                              "'full_attention' layers are supported (Tessera attends to the "
                              "whole causal context)")


def qwen2_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Qwen2ForCausalLM` config.json."""
    require(hf, "hidden_act", ("silu",), "silu")
    full_attention_only(hf)
    fields = llama_like_fields({**hf, "attention_bias": False, "mlp_bias": False}, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"qwen2 config: partial_rotary_factor={fields['rotary_fraction']} "
                              "is not supported (supported: 1.0)")
    return ModelConfig(name="qwen2", family="qwen2", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                       **{**fields, "bias": False}, qkv_bias=True)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.norm_eps, attention_dropout=c.dropout,
                  use_sliding_window=False, sliding_window=None,
                  rope_parameters=rope_to_hf(c), rope_theta=c.rope_theta)
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    # Qwen2's head_dim is always hidden_size / num_attention_heads.
    clash = {"head_dim": c.head_dim} if c.head_dim * c.num_heads != c.hidden_size else {}
    check_traits(c, clash)


QWEN2 = HfFamily(
    family="qwen2", config_from_hf=qwen2_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map={**LLAMA_LIKE, **SWIGLU_MLP}, ignored=ROTARY_BUFFERS,
    fp8_export=True)
