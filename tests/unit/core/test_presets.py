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

