"""The Hugging Face <-> Tessera contract of Gemma 2: `Gemma2ForCausalLM` (family `gemma2`).

Gemma 2 is a Llama-shaped decoder with `(1 + w)` RMSNorms (`norm="rmsnorm1p"`, weights stored
as the offset, as HF stores them) before and after each sublayer (`norm_placement="sandwich"`),
GeGLU with tanh GELU, embeddings scaled by sqrt(hidden_size), scores scaled by
`query_pre_attn_scalar ** -0.5` and soft-capped, final logits soft-capped (`Gemma2Options`),
and the output tied to the embedding. Its `sliding_attention` layers (`layer_types`, else every
other layer from the first, as transformers derives them) attend through `sliding_window`
(`ModelConfig.sliding_window` and `sliding_window_layers`); a window covering every position is
no window.
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
from tessera.core.config import ModelConfig
from tessera.core.models.decoder.gemma_options import Gemma2Options

GEMMA2_NORMS: dict[str, tuple[str, ...]] = {
    "layers.{}.post_attention_norm.weight": ("model.layers.{}.post_attention_layernorm.weight",),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.pre_feedforward_layernorm.weight",),
    "layers.{}.post_ffn_norm.weight": ("model.layers.{}.post_feedforward_layernorm.weight",),
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def gemma2_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Gemma2ForCausalLM` config.json."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ConversionError(f"gemma2 config: hidden_activation={act!r} is not supported "
                              f"(supported: {', '.join(map(repr, GELU_TANH))})")
    require(hf, "use_bidirectional_attention", (False, None), False)
    require(hf, "tie_word_embeddings", (True,), True)
    window, layers = gemma2_window(hf)
    if hf.get("attention_bias", False):
        raise ConversionError("gemma2 config: attention_bias=True is not supported (supported: "
                              "False)")
    fields = llama_like_fields({**hf, "attention_bias": False, "mlp_bias": False}, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise ConversionError(f"gemma2 config: partial_rotary_factor={fields['rotary_fraction']} "
                              "is not supported (supported: 1.0)")
    options = Gemma2Options(query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
                            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                            final_logit_softcapping=hf.get("final_logit_softcapping"))
    return ModelConfig(name="gemma2", family="gemma2", norm="rmsnorm1p",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), activation="geglu",
                       norm_placement="sandwich", sliding_window=window,
                       sliding_window_layers=layers, options=options, **fields)


def gemma2_window(hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding window, the layers it applies to, None for all) of a Gemma 2 config.json, as
    transformers' `Gemma2Config` derives them; no window when it covers every position."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        types = [_LAYER_TYPES[(i + 1) % 2] for i in range(n)]
    if len(types) != n or set(types) - set(_LAYER_TYPES):
        raise ConversionError(f"gemma2 config: layer_types={types} is not supported "
                              f"(supported: {n} entries of {list(_LAYER_TYPES)})")
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if not layers:
        return None, None
    window = hf.get("sliding_window", 4096)  # transformers' default
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConversionError(f"gemma2 config: sliding_window={window!r} is not supported "
                              "(supported: a positive number of tokens)")
    if window >= hf["max_position_embeddings"]:
        return None, None  # it masks nothing: plain causal attention, the fast path
    return window, (None if len(layers) == n else layers)


def gemma_fields_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The config.json fields Gemma 2 and Gemma 3 write alike (shapes, GeGLU, score scale,
    final soft cap); each adds its attention soft cap, windows and RoPE."""
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                head_dim=c.head_dim, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
                attention_bias=False, attention_dropout=c.dropout,
                query_pre_attn_scalar=c.options.query_pre_attn_scalar,
                final_logit_softcapping=c.options.final_logit_softcapping)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    fields = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                  **gemma_fields_to_hf(c),
                  attn_logit_softcapping=c.options.attn_logit_softcapping,
                  **_window_to_hf(c),
                  rope_parameters=rope_to_hf(c))
    return with_shared_fields(fields, c, **shared)


def _window_to_hf(c: ModelConfig) -> dict[str, Any]:
    if c.sliding_window is None:
        # transformers' Gemma 2 always builds its sliding layers' mask: a window as wide as
        # the context, which masks nothing, over its alternating layers.
        return dict(sliding_window=c.max_position_embeddings,
                    layer_types=[_LAYER_TYPES[(i + 1) % 2] for i in range(c.num_layers)])
    return dict(sliding_window=c.sliding_window,
                layer_types=[_LAYER_TYPES[c.layer_window(i) is not None]
                             for i in range(c.num_layers)])


def gemma_export_clashes(c: ModelConfig) -> dict[str, Any]:
    """The fields Gemma 2 and Gemma 3 files cannot say otherwise: a tied output, scaled
    embeddings and a `query_pre_attn_scalar` (field -> the value this model has)."""
    clash: dict[str, Any] = {}
    if not c.tied_embeddings:
        clash["tied_embeddings"] = False
    if not c.options.scale_embeddings:
        clash["options.scale_embeddings"] = False
    if c.options.query_pre_attn_scalar is None:
        clash["options.query_pre_attn_scalar"] = None
    return clash


def _check_exportable(c: ModelConfig) -> None:
    check_traits(c, gemma_export_clashes(c))


GEMMA2_NAMES = {**{k: v for k, v in LLAMA_LIKE.items() if not k.startswith("layers.{}.ffn_norm")},
                **SWIGLU_MLP, **GEMMA2_NORMS}
GEMMA2 = HfFamily(
    family="gemma2", config_from_hf=gemma2_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map=GEMMA2_NAMES,
    ignored=ROTARY_BUFFERS,
    fp8_export=True)
