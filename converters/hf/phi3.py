"""The Hugging Face <-> Tessera contract of Phi-3 / Phi-3.5-mini: `Phi3ForCausalLM` (family
`phi3`).

Phi-3 is Llama with q/k/v stored as one `qkv_proj` (rows q, k, v) and gate/up as one
`gate_up_proj` (rows gate, up): exactly the row order of Tessera's fused `attention.wqkv` and
SwiGLU `feed_forward.w1`, so each maps one to one. RoPE may be partial
(`partial_rotary_factor`) and is usually longrope, with `original_max_position_embeddings` at
the top level. A `sliding_window` (Phi-3-mini-4k: 2047) applies to every layer, as transformers
applies it (`ModelConfig.sliding_window`); one covering every position is no window.
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
    llama_like_fields,
    rope_to_hf,
    sliding_window,
)
from tessera.core.config import ModelConfig

PHI3_FUSED: dict[str, tuple[str, ...]] = {
    "layers.{}.attention.wqkv.weight": ("model.layers.{}.self_attn.qkv_proj.weight",),
    "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_up_proj.weight",),
}


def phi3_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Phi3ForCausalLM` config.json."""
    require(hf, "hidden_act", ("silu",), "silu")
    window = sliding_window(hf)
    dropout = hf.get("attention_dropout", 0.0)
    for key in ("resid_pdrop", "embd_pdrop"):
        if hf.get(key, dropout) != dropout:
            raise ConversionError(f"phi3 config: {key}={hf[key]} differs from attention_dropout="
                                  f"{dropout}; Tessera has one dropout rate, so they must be equal")
    fields = llama_like_fields({**hf, "head_dim": None}, 1.0)
    return ModelConfig(name="phi3", family="phi3", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-5), activation="swiglu",
                       sliding_window=window, **fields)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    rope = rope_to_hf(c)
    if c.rotary_fraction != 1.0:
        rope["partial_rotary_factor"] = c.rotary_fraction
    fields = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=c.vocab_size,
                  hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, hidden_act="silu",
                  max_position_embeddings=c.max_position_embeddings,
                  original_max_position_embeddings=(
                      c.rope_scaling.original_max_position_embeddings
                      or c.max_position_embeddings),
                  rms_norm_eps=c.norm_eps, attention_dropout=c.dropout, resid_pdrop=c.dropout,
                  embd_pdrop=c.dropout, sliding_window=c.sliding_window,
                  rope_parameters=rope)
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    # Phi-3's head_dim is always hidden_size / num_attention_heads.
    clash = {"head_dim": c.head_dim} if c.head_dim * c.num_heads != c.hidden_size else {}
    if c.sliding_window_layers is not None:  # its window applies to every layer
        clash["sliding_window_layers"] = c.sliding_window_layers
    check_traits(c, clash)


PHI3 = HfFamily(
    family="phi3", config_from_hf=phi3_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map={**LLAMA_LIKE, **PHI3_FUSED}, ignored=ROTARY_BUFFERS,
    fp8_export=True)
