"""The Hugging Face <-> Tessera contract of `NemotronForCausalLM`: Llama-like attention with a
partial rotary fraction, LayerNorm1P and a squared-ReLU MLP without a gate. LayerNorm1P stores
`weight - 1` on both sides, so its weights are copied as they are."""

from __future__ import annotations

from typing import Any

from tessera.converters.hf.family import HfFamily, check_traits, require, with_shared_fields
from tessera.converters.hf.llama import (
    LLAMA_LIKE,
    ROTARY_BUFFERS,
    llama_like_fields,
    rope_decoder_fields,
    rope_to_hf,
)
from tessera.core.config import ModelConfig


def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    require(hf, "hidden_act", ("relu2",), "relu2")
    return ModelConfig(name="nemotron", family="nemotron", norm="layernorm1p",
                       norm_eps=hf.get("norm_eps", 1e-5), activation="squared_relu",
                       **llama_like_fields(hf, 0.5))  # 0.5: transformers' default for Nemotron


def _config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
    rope_fields = {**rope_to_hf(c), "partial_rotary_factor": c.rotary_fraction}
    fields = {**rope_decoder_fields(c, "NemotronForCausalLM", "relu2"),
              "rope_parameters": rope_fields, "rope_theta": c.rope_theta,
              "partial_rotary_factor": c.rotary_fraction,
              "norm_eps": c.norm_eps}  # top-level keys: for v4
    return with_shared_fields(fields, c, **shared)


NEMOTRON = HfFamily(
    family="nemotron", config_from_hf=_config_from_hf,
    check_exportable=check_traits, config_to_hf=_config_to_hf,
    name_map={**LLAMA_LIKE,
              "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.up_proj.weight",),
              "layers.{}.feed_forward.w1.bias": ("model.layers.{}.mlp.up_proj.bias",)},
    ignored=ROTARY_BUFFERS, fp8_export=True)
