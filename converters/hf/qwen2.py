"""The Hugging Face <-> Tessera contract of Qwen2 / Qwen2.5 dense: `Qwen2ForCausalLM` (family
`qwen2`).

Qwen2 is Llama with biases on q, k and v only (`ModelConfig.qkv_bias`, the o projection and the
MLP have none), RMSNorm eps 1e-6 and, for the small sizes, the output tied to the embedding.
`model.layers.{i}.self_attn.{q,k,v}_proj.bias` stack into `layers.{i}.attention.wqkv.bias`.
Sliding-window attention (`use_sliding_window`, `sliding_window`, and which layers have it:
`layer_types`, else the layers from `max_window_layers` on, as transformers derives them) maps
to `ModelConfig.sliding_window` and `sliding_window_layers`. Qwen2-MoE keeps refusing it
(`full_attention_only`).
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


_LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen2_window(hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding window, the layers it applies to, None for all) of a Qwen2 config.json, as
    transformers' `Qwen2Config` derives them: no window unless `use_sliding_window`; the
    sliding layers from `layer_types`, else those at or past `max_window_layers`."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown or len(types) != n:
            raise ConversionError(f"qwen2 config: layer_types={types} is not supported "
                                  f"(supported: {n} entries of {list(_LAYER_TYPES)})")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConversionError(f"qwen2 config: sliding_window={window!r} is not supported "
                              "(supported: a positive number of tokens with use_sliding_window)")
    if window >= hf["max_position_embeddings"]:
        return None, None  # it covers every position: plain causal attention, the fast path
    if types is None:
        first = hf.get("max_window_layers", n)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if not layers:
        return None, None
    return window, (None if len(layers) == n else layers)


def qwen2_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Qwen2ForCausalLM` config.json."""
    require(hf, "hidden_act", ("silu",), "silu")
    window, layers = qwen2_window(hf)
    fields = llama_like_fields({**hf, "attention_bias": False, "mlp_bias": False}, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"qwen2 config: partial_rotary_factor={fields['rotary_fraction']} "
                              "is not supported (supported: 1.0)")
    return ModelConfig(name="qwen2", family="qwen2", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                       **{**fields, "bias": False}, qkv_bias=True, sliding_window=window,
                       sliding_window_layers=layers)


def _window_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The sliding-window fields; `layer_types` names the layers, `max_window_layers` the
    first sliding one (what older transformers read, exact when they form a suffix)."""
    if c.sliding_window is None:  # transformers' defaults then make every layer full
        return dict(use_sliding_window=False, sliding_window=None)
    sliding = [c.layer_window(i) is not None for i in range(c.num_layers)]
    return dict(use_sliding_window=True, sliding_window=c.sliding_window,
                max_window_layers=sliding.index(True),
                layer_types=[_LAYER_TYPES[s] for s in sliding])


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.norm_eps, attention_dropout=c.dropout,
                  **_window_to_hf(c), rope_parameters=rope_to_hf(c), rope_theta=c.rope_theta)
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    # Qwen2's head_dim is always hidden_size / num_attention_heads.
    clash = {"head_dim": c.head_dim} if c.head_dim * c.num_heads != c.hidden_size else {}
    check_traits(c, clash)


QWEN2 = HfFamily(
    family="qwen2", config_from_hf=qwen2_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map={**LLAMA_LIKE, **SWIGLU_MLP}, ignored=ROTARY_BUFFERS,
    fp8_export=True)
