"""`core.presets.model_from_spec`: the one preset loader of `tessera pretrain` and `tessera plan`."""

import pytest

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.presets import DEFAULT_PRESET, model_from_spec


def test_no_spec_is_the_default_preset_with_nothing_set():
    model, fields_set = model_from_spec(None)
    assert model == ModelConfig.from_name(DEFAULT_PRESET) and fields_set == frozenset()


def test_flags_win_over_the_yaml_mapping_and_values_take_their_field_types():
    spec = {"preset": "gpt2-tiny", "num_layers": "4", "dropout": "0.1"}
    model, fields_set = model_from_spec(spec, "llama-tiny", ["num_layers=6", "vocab_size=500"])
    assert model == ModelConfig.from_name("llama-tiny", num_layers=6, dropout=0.1,
                                          vocab_size=500)
    assert fields_set == {"num_layers", "dropout", "vocab_size"}


@pytest.mark.parametrize(("spec", "overrides", "message"), [
    ({"num_layerz": 2}, [], "unknown model field 'num_layerz'"),
    (None, ["num_layers"], "--model-overrides expects KEY=VALUE"),
    (None, ["num_layers=2.5"], "model.num_layers: expected int, got 2.5"),
    (3, [], "model: expected a preset name or a mapping"),
])
def test_bad_model_fields_are_one_line_errors(spec, overrides, message):
    with pytest.raises(ConfigError, match=message):
        model_from_spec(spec, None, overrides)



def test_real_size_presets_of_llama3_2_and_qwen2_5_and_the_families_listed():
    """The presets hold the published parameter counts of their Hugging Face config.json."""
    from tessera.core.parallel.sharding import num_parameters
    from tessera.core.presets import presets_table

    llama = ModelConfig.from_name("llama3.2-1b")
    assert (llama.rope_scaling.type, llama.rope_scaling.factor, llama.tied_embeddings) == (
        "llama3", 32.0, True)
    assert num_parameters(llama) == 1_235_814_400
    qwen = ModelConfig.from_name("qwen2.5-0.5b")
    assert (qwen.family, qwen.qkv_bias, qwen.bias, qwen.tied_embeddings) == (
        "qwen2", True, False, True)
    assert num_parameters(qwen) == 494_032_768
    table = presets_table()
    assert "llama3.2-1b" in table and "Families: gpt2, llama, nemotron, qwen2," in table
