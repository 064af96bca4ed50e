"""The Hugging Face <-> Tessera contract of Qwen3: `Qwen3ForCausalLM` (family `qwen3`), and
the Qwen3 pieces `Qwen3MoeForCausalLM` (family `qwen3_moe`, in `converters.hf.moe`) shares.

Qwen3 is Llama plus a per-head RMSNorm of q and k before RoPE (`ModelConfig.qk_norm`,
`core.qk_norm`), whose `(head_dim,)` weights map one to one:
`model.layers.{i}.self_attn.{q,k}_norm.weight` <-> `layers.{i}.attention.{q,k}_norm.weight`.
`head_dim` is explicit and may differ from hidden_size / num_heads. Qwen3's sliding window is
read as Qwen2's (`qwen2.qwen_window`); Qwen3-MoE's covers every layer (transformers ignoring
`max_window_layers`, see `converters.hf.moe`). q/k/v-only biases (`attention_bias`; Tessera has
one bias flag for every linear layer) are refused: errors, never approximations.
"""

from __future__ import annotations

from typing import Any

from tessera.converters.hf.family import (
    ConversionError,
    HfFamily,
    check_traits,
    with_shared_fields,
)
from tessera.converters.hf.llama import (
    LLAMA_LIKE,
    ROTARY_BUFFERS,
    SWIGLU_MLP,
    llama_config,
    rope_to_hf,
)
from tessera.converters.hf.qwen2 import qwen_window, window_to_hf
from tessera.core.config import ModelConfig

QK_NORM_NAMES: dict[str, tuple[str, ...]] = {
    "layers.{}.attention.q_norm.weight": ("model.layers.{}.self_attn.q_norm.weight",),
    "layers.{}.attention.k_norm.weight": ("model.layers.{}.self_attn.k_norm.weight",),
}




def qwen3_base(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama-like fields of a Qwen3 / Qwen3-MoE config.json, qk_norm on, no window."""
    bias = hf.get("attention_bias", False)
    if bias:
        raise ConversionError(f"{hf['model_type']} config: attention_bias=True puts biases on the "
                              "attention only; Tessera has one bias flag for every linear layer, "
                              "so only attention_bias=False converts")
    config = llama_config({**hf, "sliding_window": None, "mlp_bias": False})
    return {**config.to_dict(), "name": hf["model_type"], "family": hf["model_type"],
            "qk_norm": True}


def qwen3_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Qwen3ForCausalLM` config.json, its sliding window read as Qwen2's."""
    window, layers = qwen_window(hf)
    return ModelConfig.from_dict({**qwen3_base(hf), "sliding_window": window,
                                  "sliding_window_layers": layers})


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    rope = rope_to_hf(c)
    fields = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=c.vocab_size,
                  hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_act="silu",
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
                  attention_bias=False, attention_dropout=c.dropout, **window_to_hf(c),
                  rope_parameters=rope, rope_theta=c.rope_theta)
    return with_shared_fields(fields, c, **shared)


QWEN3 = HfFamily(
    family="qwen3", config_from_hf=qwen3_config,
    check_exportable=check_traits, config_to_hf=_config_to_hf,
    name_map={**LLAMA_LIKE, **SWIGLU_MLP, **QK_NORM_NAMES}, ignored=ROTARY_BUFFERS,
    fp8_export=True)
