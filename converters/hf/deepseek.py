"""The Hugging Face <-> Tessera contract of DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`; families `deepseek_v2`, `deepseek_v3`).

Both are Llama with multi-head latent attention (`ModelConfig.mla`,
`core.models.decoder.mla`): each `self_attn.*` projection maps to one Tessera tensor
(`q_proj` or `q_a_proj` / `q_a_layernorm` / `q_b_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`). V2 rotates DeepSeek's interleaved pairs (complex
form); V3 does when `rope_interleave`, else the halves. The score scale follows yarn's
`mscale_all_dim` as transformers does (`mla.softmax_scale`).

Their Mixture-of-Experts layers (every layer from `first_k_dense_replace` on) map as
`converters.hf.deepseek_moe` says. Attention biases, an MLP bias, grouped kv heads and a partial
rotary factor are refused.

FP8 export (`converters.hf_fp8`) quantizes the latent-attention, dense MLP and (shared) expert
linears and keeps the routers high precision, as DeepSeek-V3's own FP8 checkpoint does.
"""

from __future__ import annotations

from typing import Any

from tessera.converters.hf.deepseek_moe import (
    DEEPSEEK_MOE_NAMES,
    deepseek_moe_config,
    deepseek_moe_fields,
    deepseek_moe_problems,
)
from tessera.converters.hf.family import (
    ConversionError,
    HfFamily,
    NameMap,
    check_traits,
    require,
    with_shared_fields,
)
from tessera.converters.hf.llama import LLAMA_LIKE, ROTARY_BUFFERS, SWIGLU_MLP, rope, rope_to_hf
from tessera.converters.hf.moe import moe_pairs
from tessera.core.config import ModelConfig
from tessera.core.mla_config import MLAConfig

_ATTENTION = "model.layers.{}.self_attn."
MLA_NAMES: NameMap = {
    "layers.{}.attention.wq.weight": (_ATTENTION + "q_proj.weight",),
    "layers.{}.attention.wq_a.weight": (_ATTENTION + "q_a_proj.weight",),
    "layers.{}.attention.q_a_norm.weight": (_ATTENTION + "q_a_layernorm.weight",),
    "layers.{}.attention.wq_b.weight": (_ATTENTION + "q_b_proj.weight",),
    "layers.{}.attention.wkv_a.weight": (_ATTENTION + "kv_a_proj_with_mqa.weight",),
    "layers.{}.attention.kv_a_norm.weight": (_ATTENTION + "kv_a_layernorm.weight",),
    "layers.{}.attention.wkv_b.weight": (_ATTENTION + "kv_b_proj.weight",),
}
_ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def _refuse(hf: dict[str, Any], key: str, value: Any, supported: str) -> None:
    raise ConversionError(f"{hf['model_type']} config: {key}={value!r} is not supported "
                          f"(supported: {supported})")


def deepseek_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` config.json."""
    kind, layers = hf["model_type"], hf["num_hidden_layers"]
    require(hf, "hidden_act", ("silu",), "silu")
    require(hf, "attention_bias", (False,), False)
    require(hf, "mlp_bias", (False,), False)
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        _refuse(hf, "num_key_value_heads", hf["num_key_value_heads"],
                f"num_attention_heads={heads}; every head reads the one shared latent")
    interleave = True if kind == "deepseek_v2" else hf.get("rope_interleave", True)
    if interleave not in (True, False):
        _refuse(hf, "rope_interleave", interleave, "True, False")
    mla = MLAConfig(kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                    qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                    q_lora_rank=hf.get("q_lora_rank"), rope_interleave=bool(interleave))
    # transformers rotates the `qk_rope_head_dim` dims (its `head_dim`) of each head.
    theta, fraction, scaling = rope({**hf, "head_dim": mla.qk_rope_head_dim}, 1.0)
    if fraction != 1.0:
        _refuse(hf, "partial_rotary_factor", fraction, "1.0; qk_rope_head_dim sets the rotary "
                "dims")
    return ModelConfig(
        name=kind, family=kind, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=heads,
        ffn_hidden_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"], norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu", position="rope",
        rope_theta=theta, rope_scaling=scaling, bias=False, qkv_bias=False,
        tied_embeddings=hf.get("tie_word_embeddings", False),
        dropout=hf.get("attention_dropout") or 0.0, init_std=hf.get("initializer_range", 0.02),
        mla=mla, moe=deepseek_moe_config(hf))


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    m = c.mla
    fields = dict(architectures=[_ARCHITECTURES[c.family]], model_type=c.family,
                  vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.norm_eps, attention_bias=False, attention_dropout=c.dropout,
                  rope_parameters=rope_to_hf(c), q_lora_rank=m.q_lora_rank,
                  kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                  qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  **deepseek_moe_fields(c))
    if c.family == "deepseek_v2":
        fields["mlp_bias"] = False
    else:
        fields["rope_interleave"] = m.rope_interleave
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    clash: dict[str, Any] = {}
    if c.mla is None:
        clash["mla"] = None
    elif c.family == "deepseek_v2" and not c.mla.rope_interleave:
        clash["mla.rope_interleave"] = False  # V2's complex RoPE always pairs neighbours
    elif c.mla.latent_norm_eps != MLAConfig.latent_norm_eps:
        clash["mla.latent_norm_eps"] = c.mla.latent_norm_eps  # transformers fixes it
    check_traits(c, {**clash, **deepseek_moe_problems(c)})


_NAMES: NameMap = {**{k: v for k, v in LLAMA_LIKE.items() if ".wqkv." not in k},
                   **SWIGLU_MLP, **MLA_NAMES, **DEEPSEEK_MOE_NAMES}
DEEPSEEK_V2 = HfFamily(
    family="deepseek_v2", config_from_hf=deepseek_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map=_NAMES, pairs=moe_pairs(_NAMES), ignored=ROTARY_BUFFERS,
    fp8_export=True)
DEEPSEEK_V3 = HfFamily(
    family="deepseek_v3", config_from_hf=deepseek_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map=_NAMES, pairs=moe_pairs(_NAMES), ignored=ROTARY_BUFFERS,
    fp8_export=True)
