"""`--model-overrides` and the YAML `model:` mapping reach the model's sub-configs: by dotted
name (`moe.top_k=2`), as a nested mapping (`moe: {top_k: 2}`), or by the flat names of older
configs (`moe_top_k=2`), each converted to its field's type."""

from __future__ import annotations

import pytest

from tessera.core.config import ConfigError, ModelConfig
from tessera.training.config import load_config

WANT = ModelConfig.from_name("qwen-moe-tiny", num_layers=4, moe={"layer_freq": 2, "top_k": 3})


@pytest.mark.parametrize("overrides", [
    ["moe.layer_freq=2", "moe.top_k=3"],
    ["moe_layer_freq=2", "moe_top_k=3"],
    ["moe={layer_freq: 2, top_k: '3'}"],
])
def test_sub_config_overrides_by_every_spelling(overrides):
    cfg, _ = load_config(["--model", "qwen-moe-tiny", "--model-overrides", "num_layers=4",
                          *overrides])
    assert cfg.model == WANT


def test_a_yaml_mapping_reaches_the_family_options(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  preset: t5-tiny\n  options:\n    num_decoder_layers: '3'\n"
                   "  relative_attention_num_buckets: 8\n")
    cfg, _ = load_config(["--config", str(run)])
    assert cfg.model.options.num_decoder_layers == 3
    assert cfg.model.options.relative_attention_num_buckets == 8
    assert cfg.model.options.relative_attention_max_distance == 128  # the preset's


def test_an_option_of_another_family_is_named_in_the_error():
    with pytest.raises(ConfigError, match="unknown model field 'options.num_decoder_layers' for "
                                          "a family 'llama' model"):
        load_config(["--model", "llama-tiny", "--model-overrides", "options.num_decoder_layers=2"])
    with pytest.raises(ConfigError, match=r"model.moe.top_k: expected int, got 'two'"):
        load_config(["--model", "llama-tiny", "--model-overrides", "moe.top_k=two"])
