"""The Hugging Face <-> Tessera contract of Qwen3: `Qwen3ForCausalLM` (family `qwen3`) and
`Qwen3MoeForCausalLM` (family `qwen3_moe`, its MoE weights mapped by `converters.hf_moe`).

Qwen3 is Llama plus a per-head RMSNorm of q and k before RoPE (`ModelConfig.qk_norm`,
`core.qk_norm`), whose `(head_dim,)` weights map one to one:
`model.layers.{i}.self_attn.{q,k}_norm.weight` <-> `layers.{i}.attention.{q,k}_norm.weight`.
`head_dim` is explicit and may differ from hidden_size / num_heads. Qwen3-MoE is Qwen2-MoE
without the shared expert; its dense layers come from `decoder_sparse_step` (Tessera's
`moe_layer_freq`, same rule). `mlp_only_layers` converts only when it names layers that are
dense anyway (Tessera has no per-layer list); anything else is an error naming the layers.
Sliding windows and q/k/v-only biases (`attention_bias`; Tessera has one bias flag for every
linear layer) are errors, never approximations.
"""

from __future__ import annotations

from typing import Any

from tessera.core.config import ModelConfig

QK_NORM_NAMES: dict[str, tuple[str, ...]] = {
    "layers.{}.attention.q_norm.weight": ("model.layers.{}.self_attn.q_norm.weight",),
    "layers.{}.attention.k_norm.weight": ("model.layers.{}.self_attn.k_norm.weight",),
}


def _qwen3_base(hf: dict[str, Any]) -> dict[str, Any]:
    """The Llama-like fields of a Qwen3 / Qwen3-MoE config.json, qk_norm on."""
    from tessera.converters.hf_mapping import ConversionError, _llama_config, _require

    _require(hf, "use_sliding_window", (False, None), False)
    bias = hf.get("attention_bias", False)
    if bias:
        raise ConversionError(f"{hf['model_type']} config: attention_bias=True puts biases on the "
                              "attention only; Tessera has one bias flag for every linear layer, "
                              "so only attention_bias=False converts")
    config = _llama_config({**hf, "sliding_window": None, "mlp_bias": False})
    return {**config.to_dict(), "name": hf["model_type"], "family": hf["model_type"],
            "qk_norm": True}


def qwen3_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Qwen3ForCausalLM` config.json."""
    return ModelConfig(**_qwen3_base(hf))


def qwen3_moe_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Qwen3MoeForCausalLM` config.json."""
    from tessera.converters.hf_mapping import ConversionError
    from tessera.converters.hf_moe import HF_AUX_LOSS_POOLING

    step = hf.get("decoder_sparse_step", 1)
    sparse_anyway = [i for i in hf.get("mlp_only_layers") or [] if (i + 1) % step == 0]
    if sparse_anyway:
        raise ConversionError(
            f"qwen3_moe config: mlp_only_layers makes layers {sparse_anyway} dense, but Tessera "
            f"places MoE layers only by decoder_sparse_step ({step}); only mlp_only_layers that "
            "name layers dense by that rule convert")
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # 5.x saves the latter
    if experts is None:
        raise KeyError("num_experts")
    return ModelConfig(**{
        **_qwen3_base(hf), "num_experts": experts, "moe_top_k": hf["num_experts_per_tok"],
        "moe_ffn_hidden_size": hf["moe_intermediate_size"], "moe_layer_freq": step,
        "moe_norm_topk": bool(hf.get("norm_topk_prob", False)),
        "moe_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
        "moe_aux_loss_pooling": HF_AUX_LOSS_POOLING})


def qwen3_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The model-specific `config.json` fields of a `qwen3` model (the caller adds the rest)."""
    c = config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_act="silu",
                max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
                attention_bias=False, attention_dropout=c.dropout, use_sliding_window=False,
                sliding_window=None, rope_parameters=rope, rope_theta=c.rope_theta)


def qwen3_moe_fields(config: ModelConfig) -> dict[str, Any]:
    """What `Qwen3MoeForCausalLM` adds to `hf_moe.moe_config_to_hf`'s common fields."""
    c = config
    return dict(architectures=["Qwen3MoeForCausalLM"], num_experts=c.num_experts,
                moe_intermediate_size=c.moe_ffn_hidden_size or c.ffn_hidden_size,
                decoder_sparse_step=c.moe_layer_freq, mlp_only_layers=[],
                norm_topk_prob=c.moe_norm_topk, attention_bias=False, use_sliding_window=False,
                sliding_window=None)
