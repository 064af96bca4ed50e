"""RoPE variants read from Hugging Face configs as transformers reads them, checked against
transformers' own Llama: llama3 (Llama 3.1+), linear, dynamic (NTK), yarn (plain and
DeepSeek's mscale form) and longrope (Phi-3's short/long factors).

Tiny random models with `original_max_position_embeddings` 16 (and, for dynamic, a
max_position_embeddings of 32) so every prompt and continuation crosses the lengths where the
frequencies change. For each: imported logits within 1e-4, greedy serving equal to `generate`
for 20 tokens, export giving the same config and logits, a tp2 reshard keeping them, a peft LoRA
round-trip; and every field Tessera cannot honour is refused by name.
"""

from __future__ import annotations

import re

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.core.config import ModelConfig  # noqa: E402
from tessera.core.errors import ConfigError  # noqa: E402
from tessera.core.rope_config import RopeScaling  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB, ORIGINAL = 256, 16
_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             tie_word_embeddings=False, initializer_range=0.1)
_PAIRS = 4  # head_dim 8: four rotated pairs
VARIANTS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL, rope_theta=500000.0),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                 rope_theta=10000.0),
    "yarn_mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                        rope_theta=10000.0, mscale=0.8, mscale_all_dim=0.6, beta_fast=16,
                        beta_slow=2),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
                     short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.5, 5.0, 9.0],
                     rope_theta=10000.0),
}
# dynamic scales past max_position_embeddings itself: keep it small so prompts pass it.
_MAX_POS = {"dynamic": 32}
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(variant: str):
    max_pos = _MAX_POS.get(variant, _BASE["max_position_embeddings"])
    return transformers.LlamaConfig(**{**_BASE, "max_position_embeddings": max_pos},
                                    rope_parameters=dict(VARIANTS[variant]))


@pytest.fixture(scope="module", params=list(VARIANTS))
def imported(request, tmp_path_factory):
    """(variant, HF model, root): `root/hf` saved by transformers, `root/ckpt` imported."""
    variant, root = request.param, tmp_path_factory.mktemp(request.param)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(_config(variant)))
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return variant, hf_model, root


def test_imported_logits_match_across_the_original_length(imported):
    variant, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    assert model.config.rope_scaling.type == VARIANTS[variant]["rope_type"]
    # transformers' dynamic rope keeps the frequencies of the longest sequence it has seen
    # until one shorter than max_position_embeddings resets them: short before long.
    for length in (12, 40):
        tokens = check.ids(VOCAB, length, batch=2)
        assert check.logit_diff(hf_model, model, tokens) <= 1e-4, (variant, length)


def test_the_variant_changes_the_logits(imported):
    """The same weights under plain RoPE give other logits past the original length: the
    variant is really applied, so the parity above proves something."""
    variant, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    model.config.rope_scaling = RopeScaling()
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 40)) > 1e-3, variant


def test_greedy_serving_equals_generate(imported):
    variant, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 10, seed=5)[0].tolist()  # 10 + 20 tokens cross the original 16
    n = 20
    if variant == "dynamic":  # past max_position_embeddings (32): a longer serving context
        prompt = check.ids(VOCAB, 28, seed=5)[0].tolist()
    want = check.hf_greedy(hf_model, prompt, n)
    assert check.engine_greedy(model, prompt, n, context=64) == want, variant


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    variant, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    variant, hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 40))


@pytest.mark.parametrize("imported", ["longrope", "llama3"], indirect=True)
def test_peft_lora_round_trips(imported, tmp_path):
    variant, hf_model, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, PEFT_TARGETS,
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


def test_v4_rope_scaling_and_phi3_top_level_original_length_are_read():
    base = {k: v for k, v in _config("yarn").to_dict().items() if k != "rope_parameters"}
    v4 = {**base, "rope_theta": 1234.0,
          "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}}
    config = config_from_hf(v4)
    assert (config.rope_theta, config.rope_scaling.type, config.rope_scaling.factor) == (
        1234.0, "yarn", 2.0)
    assert config.rope_scaling.original_max_position_embeddings == 8
    # A top-level original_max_position_embeddings (Phi-3) wins, as in transformers.
    phi3_style = {**v4, "original_max_position_embeddings": 12}
    assert config_from_hf(phi3_style).rope_scaling.original_max_position_embeddings == 12
    # Missing: the model's max_position_embeddings, as transformers defaults it.
    llama3 = {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    assert config_from_hf(llama3).rope_scaling.original_max_position_embeddings == 64


@pytest.mark.parametrize("change, message", [
    ({"rope_type": "proportional", "factor": 2.0},
     "rope type 'proportional' is not supported (supported: default, linear, dynamic, yarn, "
     "longrope, llama3)"),
    ({"rope_type": "yarn", "factor": 2.0, "mrope_section": [2, 2]},
     "rope parameter mrope_section=[2, 2] is not supported"),
    ({"rope_type": "linear"}, "rope type 'linear' needs rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     "rope type 'llama3' needs rope_scaling.high_freq_factor"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 8},
     "rope_scaling.beta_fast=8 means nothing to rope type 'linear'"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * _PAIRS},
     "rope_scaling.short_factor has 1 values; a rotary dim of 8 needs 4"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "low_freq_factor 4.0 must be below high_freq_factor 1.0"),
])
def test_rope_fields_tessera_cannot_honour_are_refused(change, message):
    hf = {**_config("linear").to_dict(), "rope_parameters": {"rope_theta": 10000.0, **change}}
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf(hf)


def test_model_config_validates_its_rope_fields():
    with pytest.raises(ConfigError, match="rope_scaling.type 'ntk' is not supported"):
        ModelConfig(rope_scaling=RopeScaling(type="ntk"))
    with pytest.raises(ConfigError, match="position is 'learned'"):
        ModelConfig.from_name("gpt2-tiny", rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="unknown rope_scaling fields"):
        ModelConfig.from_dict({"rope_scaling": {"type": "linear", "scale": 2.0}})
    saved = ModelConfig.from_dict({"rope_scaling": {"type": "longrope",
                                                    "original_max_position_embeddings": 8,
                                                    "short_factor": [1.0] * 8,
                                                    "long_factor": [2.0] * 8}})
    assert ModelConfig.from_dict(saved.to_dict()) == saved  # what a manifest stores


def test_fingerprints_change_only_where_the_new_fields_say_something():
    """The flat form digests hash (`core.fingerprint`) holds rope_scaling and qkv_bias only when
    they differ from what older configs meant, so existing bases keep their fingerprints."""
    from tessera.core.flat_model_fields import flat_fields

    plain = flat_fields(ModelConfig().to_dict())
    assert "rope_scaling" not in plain and "qkv_bias" not in plain
    scaled = flat_fields(ModelConfig.from_dict(
        {"rope_scaling": {"type": "linear", "factor": 2.0}, "qkv_bias": True}).to_dict())
    assert scaled["rope_scaling"]["factor"] == 2.0 and scaled["qkv_bias"] is True


@pytest.mark.parametrize("rope", [
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
         short_factor=[1.0, 1.2], long_factor=[1.0, 3.0]),
])
def test_partial_rotary_with_a_variant_matches(tmp_path, rope):
    """Nemotron's partial rotary (half of each head rotates): the variant scales the rotated
    dims only, its factors one per rotated pair, as transformers does."""
    config = transformers.NemotronConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        partial_rotary_factor=0.5, rope_parameters={**rope, "rope_theta": 10000.0})
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(config))
    hf_model.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(import_hf(tmp_path / "hf", tmp_path / "ckpt")).eval()
    assert (model.config.rotary_dim, model.config.rope_scaling.type) == (4, rope["rope_type"])
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 40)) <= 1e-4
