"""`core.presets.model_from_spec`: the one preset loader of `tessera pretrain` and `tessera plan`."""

import dataclasses
import math

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


# The published config.json of Qwen/Qwen3-0.6B (its shape fields).
QWEN3_CONFIG_JSON = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, head_dim=128,
    hidden_act="silu", hidden_size=1024, intermediate_size=3072, max_position_embeddings=40960,
    max_window_layers=28, num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8,
    rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000, sliding_window=None,
    tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936)


def test_qwen3_preset_is_its_config_json_at_the_published_size():
    """0.6B, 0.44B without the (tied) embedding, as Qwen's model card counts them."""
    from tessera.converters.hf_mapping import config_from_hf
    from tessera.core.parallel.sharding import num_parameters

    preset = ModelConfig.from_name("qwen3-0.6b")
    assert dataclasses.replace(config_from_hf(QWEN3_CONFIG_JSON), name="qwen3-0.6b") == preset
    assert num_parameters(preset) == 596_049_920
    assert num_parameters(preset) - preset.vocab_size * preset.hidden_size == 440_467_456


_YARN = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
             beta_slow=1)
_DEEPSEEK = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                 moe_layer_freq=1, hidden_act="silu", max_position_embeddings=163840,
                 rms_norm_eps=1e-6, rope_theta=10000, aux_loss_alpha=0.001, seq_aux=True,
                 tie_word_embeddings=False, attention_bias=False)
# The published config.json files of deepseek-ai/DeepSeek-V2-Lite and DeepSeek-V3 (their shape
# and routing fields).
DEEPSEEK_CONFIG_JSON = {
    "deepseek-v2-lite": dict(
        _DEEPSEEK, model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        scoring_func="softmax", rope_scaling={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek-v3": dict(
        _DEEPSEEK, model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
        topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
        routed_scaling_factor=2.5, scoring_func="sigmoid", num_nextn_predict_layers=1,
        rope_scaling={**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


@pytest.mark.parametrize("name, total", [("deepseek-v2-lite", 15_706_484_224),
                                         ("deepseek-v3", 671_026_419_200)])
def test_deepseek_presets_are_their_config_json_at_the_published_sizes(name, total):
    """The DeepSeek presets are the models the HF converter reads from the published
    config.json, with the published totals (15.7B; 671B without V3's multi-token-prediction
    layer) counted from the parameter shapes a built model has."""
    from tessera.converters.hf_mapping import config_from_hf
    from tessera.core.parallel.sharding import global_param_shapes
    from tessera.core.presets import presets_table

    preset = ModelConfig.from_name(name)
    assert dataclasses.replace(config_from_hf(DEEPSEEK_CONFIG_JSON[name]), name=name) == preset
    shapes = global_param_shapes(preset)
    assert sum(math.prod(s) for s in shapes.values()) == total
    assert round(total / 1e9, 1) == {"deepseek-v2-lite": 15.7, "deepseek-v3": 671.0}[name]
    assert any(line.split()[:3] == [name, preset.family, f"{total / 1e9:.1f}B"]
               for line in presets_table().splitlines())
