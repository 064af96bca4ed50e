"""The Hugging Face mapping registry: keyed by the core family names, lazy, and clear about a
family it has no mapping for."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest

from tessera.converters.hf.registry import (
    family_of_model_type,
    hf_family,
    mapped_families,
    model_types,
)
from tessera.converters.hf_mapping import ConversionError, config_to_hf
from tessera.core.config import ModelConfig
from tessera.core.models import registry as core_registry


def test_every_mapping_is_a_core_family_and_names_itself():
    assert set(mapped_families()) <= set(core_registry.registered())
    for name in mapped_families():
        assert hf_family(name).family == name


def test_every_model_type_reads_into_a_mapped_family():
    assert {family_of_model_type(t) for t in model_types()} == set(mapped_families())
    assert family_of_model_type("mistral") == "llama"
    assert family_of_model_type("opt") is None and family_of_model_type(None) is None


def test_a_family_without_a_mapping_is_refused_naming_those_with_one(monkeypatch):
    monkeypatch.delitem(importlib.import_module("tessera.converters.hf.registry")._FAMILIES,
                        "nemotron")
    config = ModelConfig(family="nemotron", norm="layernorm1p", activation="squared_relu",
                         position="rope", vocab_size=64, hidden_size=32, num_layers=2,
                         num_heads=4, max_position_embeddings=16)
    with pytest.raises(ConversionError, match=r"family 'nemotron' has no Hugging Face mapping; "
                                              r"families with one: gpt2, llama, qwen2, qwen3"):
        config_to_hf(config)


def test_a_new_core_family_without_a_mapping_is_refused_on_export():
    config = ModelConfig.from_name("llama-tiny", family="scalenorm")  # core/models/scalenorm
    with pytest.raises(ConversionError, match="family 'scalenorm' has no Hugging Face mapping; "
                                              "families with one: gpt2, llama"):
        config_to_hf(config)


def test_export_checks_the_core_familys_traits():
    config = ModelConfig(family="llama", norm="rmsnorm", activation="swiglu", position="rope",
                         vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                         max_position_embeddings=16)
    assert config_to_hf(config)["model_type"] == "llama"
    with pytest.raises(ConversionError, match="'activation': 'gelu'"):
        config_to_hf(dataclasses.replace(config, activation="gelu"))


def test_generic_converters_import_no_family_module_until_asked():
    code = ("import sys; import tessera.converters.hf_io, tessera.converters.peft_lora; "
            "print(sorted(m for m in sys.modules if m.startswith('tessera.converters.hf.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['tessera.converters.hf.family', 'tessera.converters.hf.registry']"


def test_a_registry_line_naming_another_familys_mapping_is_refused(monkeypatch):
    lines = importlib.import_module("tessera.converters.hf.registry")._FAMILIES
    monkeypatch.setitem(lines, "llama", lines["gpt2"])
    with pytest.raises(ConversionError, match="registry line 'llama' .* holds the mapping of "
                                              "'gpt2'; fix the line"):
        hf_family("llama")
