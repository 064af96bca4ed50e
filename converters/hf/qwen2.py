"""The Hugging Face <-> Tessera contract of Qwen2 / Qwen2.5 dense: `Qwen2ForCausalLM` (family
`qwen2`).

Qwen2 is Llama with biases on q, k and v only (`ModelConfig.qkv_bias`, the o projection and the
MLP have none), RMSNorm eps 1e-6 and, for the small sizes, the output tied to the embedding.
`model.layers.{i}.self_attn.{q,k,v}_proj.bias` stack into `layers.{i}.attention.wqkv.bias`.
Sliding-window attention (`use_sliding_window`, `sliding_window`, and which layers have it:
`layer_types`, else the layers from `max_window_layers` on, as transformers derives them) maps
to `ModelConfig.sliding_window` and `sliding_window_layers` (`qwen_window`, which Qwen3 and
Qwen2-MoE share with their own default layers).
"""

from __future__ import annotations

from collections.abc import Callable
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

_LAYER_TYPES = ("full_attention", "sliding_attention")


def _from_max_window_layers(hf: dict[str, Any], layer: int) -> bool:
    """Qwen2's and Qwen3's rule: the layers at or past `max_window_layers` slide."""
    return layer >= hf.get("max_window_layers", hf["num_hidden_layers"])


def qwen_window(hf: dict[str, Any], slides: Callable[[dict[str, Any], int], bool]
                = _from_max_window_layers) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding window, the layers it applies to, None for all) of a Qwen config.json, as
    transformers derives them: no window unless `use_sliding_window`; the sliding layers from
    `layer_types`, else those `slides(hf, layer)` picks (from `max_window_layers`)."""
    n, kind = hf["num_hidden_layers"], hf["model_type"]
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown or len(types) != n:
            raise ConversionError(f"{kind} config: layer_types={types} is not supported "
                                  f"(supported: {n} entries of {list(_LAYER_TYPES)})")
    if not hf.get("use_sliding_window"):
        if types is not None and "sliding_attention" in types:
            raise ConversionError(
                f"{kind} config: layer_types names sliding_attention layers but "
                "use_sliding_window is false, so transformers has no window for them (supported: "
                "use_sliding_window=true with a sliding_window, or only full_attention layers)")
        return None, None
    window = hf.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConversionError(f"{kind} config: sliding_window={window!r} is not supported "
                              "(supported: a positive number of tokens with use_sliding_window)")
    if window >= hf["max_position_embeddings"]:
        return None, None  # it covers every position: plain causal attention, the fast path
    if types is None:
        types = [_LAYER_TYPES[slides(hf, i)] for i in range(n)]
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if not layers:
        return None, None
    return window, (None if len(layers) == n else layers)


def qwen2_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Qwen2ForCausalLM` config.json."""
    require(hf, "hidden_act", ("silu",), "silu")
    window, layers = qwen_window(hf)
    fields = llama_like_fields({**hf, "attention_bias": False, "mlp_bias": False}, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"qwen2 config: partial_rotary_factor={fields['rotary_fraction']} "
                              "is not supported (supported: 1.0)")
    return ModelConfig(name="qwen2", family="qwen2", norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu",
                       **{**fields, "bias": False}, qkv_bias=True, sliding_window=window,
                       sliding_window_layers=layers)


def window_to_hf(c: ModelConfig, max_window_layers_is_first: bool = True) -> dict[str, Any]:
    """The sliding-window fields; `layer_types` names the layers, `max_window_layers` the first
    sliding one (Qwen2, Qwen3) or one past the last (Qwen2-MoE), as older transformers read it."""
    if c.sliding_window is None:  # transformers' defaults then make every layer full
        return dict(use_sliding_window=False, sliding_window=None)
    sliding = [c.layer_window(i) is not None for i in range(c.num_layers)]
    bound = (sliding.index(True) if max_window_layers_is_first
             else c.num_layers - sliding[::-1].index(True))
    return dict(use_sliding_window=True, sliding_window=c.sliding_window,
                max_window_layers=bound, layer_types=[_LAYER_TYPES[s] for s in sliding])


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                  intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
                  rms_norm_eps=c.norm_eps, attention_dropout=c.dropout,
                  **window_to_hf(c), rope_parameters=rope_to_hf(c), rope_theta=c.rope_theta)
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    # Qwen2's head_dim is always hidden_size / num_attention_heads.
    clash = {"head_dim": c.head_dim} if c.head_dim * c.num_heads != c.hidden_size else {}
    check_traits(c, clash)


QWEN2 = HfFamily(
    family="qwen2", config_from_hf=qwen2_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map={**LLAMA_LIKE, **SWIGLU_MLP}, ignored=ROTARY_BUFFERS,
    fp8_export=True)
