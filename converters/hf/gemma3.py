"""The Hugging Face <-> Tessera contract of Gemma 3 text: `Gemma3ForCausalLM` (model type
`gemma3_text`, family `gemma3`).

Gemma 3 is Gemma 2 (`converters.hf.gemma2`: (1 + w) sandwich norms, GeGLU, scaled embeddings,
`query_pre_attn_scalar`, an optional final soft cap) plus a (1 + w) RMSNorm of each q and k
head before RoPE (`qk_norm`, `norm="rmsnorm1p"`), and local layers: the `sliding_attention`
entries of `layer_types` (else every layer but each `sliding_window_pattern`-th, as
transformers derives them) attend through `sliding_window` and rotate with their own plain
RoPE (`rope_parameters["sliding_attention"]`, older files' `rope_local_base_freq`:
`ModelConfig.sliding_window_rope_theta`); the global layers keep `rope_parameters
["full_attention"]` (older files' `rope_theta` and `rope_scaling`), linear scaling included.

transformers' Gemma 3 never applies `attn_logit_softcapping`, so a set one is refused rather
than followed or ignored. The multimodal `gemma3` (`Gemma3ForConditionalGeneration`) is refused:
its vision tower has no Tessera model.
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
from tessera.converters.hf.gemma2 import (
    GELU_TANH,
    GEMMA2_NAMES,
    gemma_export_clashes,
    gemma_fields_to_hf,
)
from tessera.converters.hf.llama import ROTARY_BUFFERS, llama_like_fields, rope_to_hf
from tessera.converters.hf.qwen3 import QK_NORM_NAMES
from tessera.core.config import ModelConfig
from tessera.core.models.decoder.gemma_options import Gemma2Options

_LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' Gemma3TextConfig defaults for the fields whose absence would change the model.
_DEFAULTS = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


def _refuse(field: str, value: Any, supported: str) -> ConversionError:
    return ConversionError(f"gemma3_text config: {field}={value!r} is not supported "
                           f"(supported: {supported})")


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's attention kind, as transformers' `Gemma3TextConfig` derives it."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise _refuse("sliding_window_pattern", pattern, "a positive number of layers")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n)]
    if len(types) != n or set(types) - set(_LAYER_TYPES):
        raise _refuse("layer_types", types, f"{n} entries of {list(_LAYER_TYPES)}")
    return list(types)


def rope_by_layer_type(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the global layers' rope parameters, the local layers'), as transformers standardizes
    them: v5's per-type `rope_parameters`, else v4's `rope_theta` / `rope_scaling` (global) and
    `rope_local_base_freq` (local)."""
    params = hf.get("rope_parameters") or {}
    stray = sorted(set(params) - set(_LAYER_TYPES))
    if stray:
        raise _refuse("rope_parameters", params, "one entry per layer type, "
                      f"{' and '.join(map(repr, _LAYER_TYPES))}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    full.update(scaling)
    full.setdefault("rope_theta", hf.get("rope_theta", _GLOBAL_THETA))
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", _LOCAL_THETA))
    return full, local


def _local_theta(local: dict[str, Any], full: dict[str, Any]) -> float | None:
    """The local layers' own RoPE base (they rotate with plain RoPE of it), or None when they
    rotate exactly as the global layers do."""
    if local == full:
        return None
    kind = local.get("rope_type", local.get("type", "default"))
    extra = sorted(set(local) - {"rope_type", "type", "rope_theta"})
    if kind != "default" or extra:
        raise _refuse("rope_parameters['sliding_attention']", local,
                      "rope_type 'default' with a rope_theta, or the full_attention parameters")
    return float(local["rope_theta"])


def _window(hf: dict[str, Any]) -> int:
    window = hf.get("sliding_window", _DEFAULTS["sliding_window"])
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _refuse("sliding_window", window, "a positive number of tokens")
    return window


def gemma3_config(hf: dict[str, Any]) -> ModelConfig:
    """`ModelConfig` of a `Gemma3ForCausalLM` config.json."""
    if hf.get("model_type") == "gemma3":
        raise ConversionError(
            "model_type 'gemma3' (Gemma3ForConditionalGeneration, text and vision) is not "
            "supported: Tessera has no vision tower; import a text-only Gemma 3 "
            "(Gemma3ForCausalLM, model_type 'gemma3_text', e.g. google/gemma-3-1b-it)")
    hf = {**_DEFAULTS, **hf}
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise _refuse("hidden_activation", act, ", ".join(map(repr, GELU_TANH)))
    require(hf, "use_bidirectional_attention", (False, None), False)
    require(hf, "tie_word_embeddings", (True,), True)
    require(hf, "attention_bias", (False,), False)
    if hf.get("attn_logit_softcapping") is not None:
        raise _refuse("attn_logit_softcapping", hf["attn_logit_softcapping"],
                      "None; transformers' Gemma 3 does not apply it")
    full, local = rope_by_layer_type(hf)
    fields = llama_like_fields({**hf, "rope_scaling": None, "rope_parameters": full,
                                "rope_theta": full["rope_theta"], "mlp_bias": False}, 1.0)
    if fields["rotary_fraction"] != 1.0:
        raise _refuse("partial_rotary_factor", fields["rotary_fraction"], "1.0")
    types = layer_types(hf)
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    window = _window(hf) if sliding else None
    options = Gemma2Options(query_pre_attn_scalar=hf["query_pre_attn_scalar"],
                            final_logit_softcapping=hf.get("final_logit_softcapping"))
    return ModelConfig(
        name="gemma3", family="gemma3", norm="rmsnorm1p", norm_eps=hf["rms_norm_eps"],
        activation="geglu", norm_placement="sandwich", qk_norm=True, qk_norm_width="head",
        sliding_window=window,
        sliding_window_layers=None if len(sliding) in (0, len(types)) else sliding,
        sliding_window_rope_theta=_local_theta(local, full) if sliding else None,
        options=options, **fields)


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    full = rope_to_hf(c)
    sliding = [c.layer_window(i) is not None for i in range(c.num_layers)]
    local = full if c.sliding_window_rope_theta is None else {
        "rope_type": "default", "rope_theta": c.sliding_window_rope_theta}
    fields = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                  **gemma_fields_to_hf(c), attn_logit_softcapping=None,
                  use_bidirectional_attention=False,
                  # transformers always builds the sliding mask: with no local layer, a window
                  # as wide as the context (it masks nothing and no layer uses it).
                  sliding_window=c.sliding_window or c.max_position_embeddings,
                  layer_types=[_LAYER_TYPES[s] for s in sliding],
                  rope_parameters={"full_attention": full, "sliding_attention": dict(local)})
    return with_shared_fields(fields, c, **shared)


def _check_exportable(c: ModelConfig) -> None:
    clash = gemma_export_clashes(c)
    if c.options.attn_logit_softcapping is not None:  # transformers' Gemma 3 does not apply it
        clash["options.attn_logit_softcapping"] = c.options.attn_logit_softcapping
    check_traits(c, clash)


GEMMA3 = HfFamily(
    family="gemma3", config_from_hf=gemma3_config, check_exportable=_check_exportable,
    config_to_hf=_config_to_hf, name_map={**GEMMA2_NAMES, **QK_NORM_NAMES},
    ignored=ROTARY_BUFFERS, fp8_export=True)
