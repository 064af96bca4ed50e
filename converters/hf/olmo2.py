"""The Hugging Face <-> Tessera contract of OLMo-2: `Olmo2ForCausalLM` (family `olmo2`).

OLMo-2 is Llama with each layer's two norms moved to the sublayer outputs
(`norm_placement="output"`: `x + norm(attn(x))`, `x + norm(mlp(x))`, no input norm) and an
RMSNorm over the whole q and k projections before RoPE (`qk_norm_width="projection"`,
`core.qk_norm`). The norms map by the sublayer they follow: `post_attention_layernorm` <->
`attention_norm`, `post_feedforward_layernorm` <-> `ffn_norm`, and
`self_attn.{q,k}_norm` <-> `attention.{q,k}_norm`. `attention_bias` (biases on the attention
only) is refused: Tessera's biases are on every linear layer or on q/k/v alone.
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
from tessera.converters.hf.llama import LLAMA_LIKE, ROTARY_BUFFERS, SWIGLU_MLP, llama_like_fields, rope_to_hf
from tessera.converters.hf.qwen3 import QK_NORM_NAMES
from tessera.core.config import ModelConfig

OLMO2_NORMS: dict[str, tuple[str, ...]] = {
    "layers.{}.attention_norm.weight": ("model.layers.{}.post_attention_layernorm.weight",),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.post_feedforward_layernorm.weight",),
}


def olmo2_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of an `Olmo2ForCausalLM` config.json."""
    require(hf, "hidden_act", ("silu",), "silu")
    if hf.get("attention_bias", False):
        raise ConversionError("olmo2 config: attention_bias=True is not supported (supported: "
                              "False); OLMo-2 puts biases on q/k/v/o but none on the MLP, which "
                              "Tessera cannot express")
    fields = llama_like_fields({**hf, "head_dim": None, "attention_bias": False}, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"olmo2 config: partial_rotary_factor={fields['rotary_fraction']} "
                              "is not supported (supported: 1.0)")
    return ModelConfig(name="olmo2", family="olmo2", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-5), activation="swiglu", qk_norm=True,
                       qk_norm_width="projection", norm_placement="output", **fields)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", vocab_size=c.vocab_size,
                  hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, hidden_act="silu",
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
                  attention_bias=False, attention_dropout=c.dropout, rope_parameters=rope_to_hf(c))
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    # OLMo-2's head_dim is always hidden_size / num_attention_heads.
    clash = {"head_dim": c.head_dim} if c.head_dim * c.num_heads != c.hidden_size else {}
    check_traits(c, clash)


_NAMES = {k: v for k, v in LLAMA_LIKE.items() if "_norm." not in k or k.startswith("norm.")}
OLMO2 = HfFamily(
    family="olmo2", config_from_hf=olmo2_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map={**_NAMES, **SWIGLU_MLP, **OLMO2_NORMS, **QK_NORM_NAMES},
    ignored=ROTARY_BUFFERS,
    fp8_export=True)
