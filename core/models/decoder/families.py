"""The decoder-only families: one `Family` each, sharing the decoder (`model.GPTModel`), its
sharding rules and initialization; they differ in the config values they fix (`traits`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from tessera.core.models.decoder.gemma_options import Gemma2Options
from tessera.core.models.family import Family, Lazy

_HERE = "tessera.core.models.decoder"


def decoder_family(name: str, **differs: Any) -> Family:
    """A family built on the decoder, with `differs` (Family fields) in place of its parts."""
    if "traits" in differs:
        differs["traits"] = MappingProxyType(dict(differs["traits"]))
    return Family(**{"name": name,
                     "stage_class": Lazy(f"{_HERE}.model:GPTModel"),
                     "param_shapes": Lazy(f"{_HERE}.sharding:decoder_param_shapes"),
                     "shard_spec": Lazy(f"{_HERE}.sharding:decoder_shard_spec"),
                     "init_tensor": Lazy(f"{_HERE}.init:init_decoder_tensor"),
                     **differs})


_LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", rotary_fraction=1.0)

GPT2 = decoder_family("gpt2", traits=dict(norm="layernorm", position="learned", bias=True,
                                          sliding_window=None))
LLAMA = decoder_family("llama", traits=_LLAMA)
NEMOTRON = decoder_family("nemotron", traits=dict(norm="layernorm1p", activation="squared_relu",
                                                  position="rope", sliding_window=None))
# Qwen2 / Qwen2.5: biases on q/k/v only.
QWEN2 = decoder_family("qwen2", traits=dict(_LLAMA, bias=False, qkv_bias=True))
QWEN3 = decoder_family("qwen3", traits=dict(_LLAMA, bias=False, qk_norm=True))
# Phi-3: Llama with fused q/k/v and gate/up in its files, a partial rotary allowed; its
# generation re-encodes once on passing longrope's original length.
PHI3 = decoder_family("phi3", traits=dict(norm="rmsnorm", activation="swiglu", position="rope",
                                          bias=False, qkv_bias=False),
                      longrope_reencodes=True)
# OLMo-2: norms on the sublayer outputs, an RMSNorm over the whole q and k projections.
OLMO2 = decoder_family("olmo2", traits=dict(_LLAMA, bias=False, qkv_bias=False, qk_norm=True,
                                            qk_norm_width="projection", norm_placement="output",
                                            sliding_window=None))
# Gemma 2: (1 + w) RMSNorm before and after each sublayer, GeGLU, soft caps (Gemma2Options).
_GEMMA2 = dict(norm="rmsnorm1p", activation="geglu", position="rope", rotary_fraction=1.0,
               bias=False, qkv_bias=False, norm_placement="sandwich")
GEMMA2 = decoder_family("gemma2", traits=_GEMMA2, options=Gemma2Options)
# Gemma 3 (text): Gemma 2 plus a (1 + w) RMSNorm of each q and k head; its local layers rotate
# with their own base (`sliding_window_rope_theta`).
GEMMA3 = decoder_family("gemma3", traits=dict(_GEMMA2, qk_norm=True, qk_norm_width="head"),
                        options=Gemma2Options)
# Mixture-of-Experts is a block option of the decoder (`core.moe`).
MIXTRAL = decoder_family("mixtral", traits=_LLAMA)
QWEN2_MOE = decoder_family("qwen2_moe", traits=_LLAMA)
QWEN3_MOE = decoder_family("qwen3_moe", traits=dict(_LLAMA, qk_norm=True))


def _latent_attention_problems(config: Any) -> list[str]:
    """DeepSeek's attention is multi-head latent attention: `mla` must be set."""
    if config.mla is None:
        return [f"mla=None (a {config.family} model's attention is multi-head latent attention: "
                "give an MLAConfig)"]
    return []


# DeepSeek-V2 / V3: multi-head latent attention (`ModelConfig.mla`), Llama's norms and MLP.
_DEEPSEEK = dict(_LLAMA, bias=False, qkv_bias=False, sliding_window=None)
DEEPSEEK_V2 = decoder_family("deepseek_v2", traits=_DEEPSEEK, problems=_latent_attention_problems)
DEEPSEEK_V3 = decoder_family("deepseek_v3", traits=_DEEPSEEK, problems=_latent_attention_problems)
