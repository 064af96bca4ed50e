"""`ModelConfig` holds the Mixture-of-Experts options in `moe` and a family's own in `options`;
manifests, presets and overrides in the older flat form (`num_experts`, `moe_top_k`,
`num_decoder_layers`, `type_vocab_size`, ...) still read as the same config.

`tests/fixtures/flat-model-configs.json` holds `to_dict()` of configs written before the
sub-configs (all 41 flat fields, as every checkpoint manifest of that time does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.core.config import ModelConfig
from tessera.core.errors import ConfigError
from tessera.core.flat_model_fields import flat_fields
from tessera.core.models.bert.options import BertOptions
from tessera.core.models.t5.options import T5Options
from tessera.core.moe.config import MoEConfig

FLAT = json.loads((Path(__file__).parents[2] / "fixtures" / "flat-model-configs.json").read_text())

NESTED = {
    "mixtral-tiny": ModelConfig.from_name("mixtral-tiny", moe=MoEConfig(
        num_experts=4, top_k=2, aux_loss_coef=0.02, capacity_factor=1.5,
        aux_loss_pooling="model")),
    "qwen-moe-tiny": ModelConfig.from_name("qwen-moe-tiny", num_layers=4, moe=MoEConfig(
        num_experts=8, top_k=2, ffn_hidden_size=32, shared_ffn_hidden_size=128, layer_freq=2,
        norm_topk=False, expert_bias=True)),
    "t5-tiny": ModelConfig.from_name("t5-tiny", activation="relu", tied_embeddings=True,
                                     options=T5Options(num_decoder_layers=3, scaled_output=True,
                                                       relative_attention_num_buckets=8,
                                                       decoder_start_token_id=5)),
    "bert-tiny": ModelConfig.from_name("bert-tiny",
                                       options=BertOptions(type_vocab_size=3, binary_head=True)),
    "llama-tiny": ModelConfig.from_name("llama-tiny"),
}


@pytest.mark.parametrize("name", sorted(FLAT))
def test_a_flat_manifest_loads_to_the_same_config(name):
    assert len(FLAT[name]) == 41
    assert ModelConfig.from_dict(FLAT[name]) == NESTED[name]


@pytest.mark.parametrize("name", sorted(NESTED))
def test_to_dict_writes_the_nested_form_and_reads_back(name):
    data = json.loads(json.dumps(NESTED[name].to_dict()))
    assert "num_experts" not in data and "moe_top_k" not in data
    assert data["moe"]["num_experts"] == NESTED[name].moe.num_experts
    assert ModelConfig.from_dict(data) == NESTED[name]


def test_families_get_their_options_and_only_theirs():
    assert ModelConfig.from_name("t5-tiny").options == T5Options(
        num_decoder_layers=2, relative_attention_num_buckets=32,
        relative_attention_max_distance=128)
    assert ModelConfig(family="bert", norm="layernorm", activation="gelu", position="learned",
                       bias=True, tied_embeddings=True).options == BertOptions()
    assert ModelConfig().options is None and ModelConfig().moe == MoEConfig()
    with pytest.raises(ConfigError, match="takes options a T5Options, got BertOptions"):
        ModelConfig.from_name("t5-tiny", options=BertOptions())
    with pytest.raises(ConfigError, match="takes options None"):
        ModelConfig(options=T5Options())


def test_a_flat_option_of_another_family_is_refused_unless_it_is_the_old_default():
    flat = {**FLAT["llama-tiny"], "num_decoder_layers": 3}
    with pytest.raises(ConfigError, match=r"\['num_decoder_layers'\] mean nothing to a family "
                                          r"'llama' model"):
        ModelConfig.from_dict(flat)
    with pytest.raises(ConfigError, match=r"unknown moe fields \['experts'\]"):
        ModelConfig.from_dict({**FLAT["llama-tiny"], "moe": {"experts": 2}})


def test_preset_overrides_merge_into_the_preset_sub_configs():
    config = ModelConfig.from_name("qwen-moe-tiny", moe={"layer_freq": 2}, num_layers=4)
    flat = ModelConfig.from_name("qwen-moe-tiny", moe_layer_freq=2, num_layers=4)
    assert config == flat
    assert config.moe.shared_ffn_hidden_size == 128 and config.moe.layer_freq == 2
    t5 = ModelConfig.from_name("t5-tiny", options={"scaled_output": True}, tied_embeddings=True,
                               activation="relu")
    assert t5.options.num_decoder_layers == 2 and t5.options.scaled_output


@pytest.mark.parametrize("name", sorted(NESTED))
def test_the_flat_form_of_a_config_is_what_older_releases_wrote(name):
    """`core.fingerprint` hashes this form: a base tuned on before keeps its fingerprint."""
    assert flat_fields(NESTED[name].to_dict()) == FLAT[name]
