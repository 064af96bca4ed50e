"""OLMo-2 (`Olmo2ForCausalLM`: norms on the sublayer outputs, RMSNorm over the whole q and k
projections) against transformers.

A tiny random model built from a config (nothing downloaded), every norm weight perturbed away
from 1 so a misplaced or mis-scoped norm shows: imported logits within 1e-4, greedy serving equal
to `generate` for 20 tokens, export giving the same config and logits, a tp2 reshard keeping
them, a peft LoRA round-trip; and the fields Tessera cannot honour refused by name. The tp2
forward and backward of the projection-wide q/k norm is in tests/distributed.
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB = 256
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              initializer_range=0.1, pad_token_id=0, eos_token_id=2)
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_config(**overrides):
    return transformers.Olmo2Config(**{**CONFIG, **overrides})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo2")
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(_hf_config()),
                               scale=0.3)
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return hf_model, root


def test_imported_logits_match(imported):
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    c = model.config
    assert (c.family, c.norm_placement, c.qk_norm, c.qk_norm_width) == (
        "olmo2", "output", True, "projection")
    assert model.layers["0"].attention.q_norm.weight.shape == (32,)
    assert model.layers["0"].attention.k_norm.weight.shape == (16,)
    for length in (12, 40):
        assert check.logit_diff(hf_model, model, check.ids(VOCAB, length, batch=2)) <= 1e-4


@pytest.mark.parametrize("change", ["pre_norm", "per_head_qk_norm"])
def test_norm_placement_and_width_matter(imported, change):
    """The same weights with pre-norm placement, or the q/k norm per head, give other logits:
    the parity above depends on both."""
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    for layer in model.layers.values():
        if change == "pre_norm":
            layer.norm_output = False
        else:
            attention = layer.attention
            rms = torch.nn.RMSNorm(8, eps=model.config.norm_eps)
            attention.projection_norm = False
            attention.qk_norm = True
            attention.q_norm = attention.k_norm = rms
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 12)) > 1e-3


def test_greedy_serving_equals_generate(imported):
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 10, seed=5)[0].tolist()
    assert check.engine_greedy(model, prompt, 20) == check.hf_greedy(hf_model, prompt, 20)


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


def test_tp2_reshard_keeps_the_logits_and_splits_the_qk_norms(imported, tmp_path):
    hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 24))
    from tessera.core.parallel.sharding import local_shape

    config = load_checkpoint(root / "ckpt").config
    assert local_shape("layers.0.attention.q_norm.weight", config, 2) == (16,)
    assert local_shape("layers.0.attention.k_norm.weight", config, 2) == (8,)


def test_tp2_pp2_reshard_keeps_the_logits(imported, tmp_path):
    hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2pp2", check.ids(VOCAB, 24), pp=2)


def test_peft_lora_round_trips(imported, tmp_path):
    hf_model, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, PEFT_TARGETS,
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True is not supported (supported: False)"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (supported: 'silu')"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     "rope type 'proportional' is not supported"),
])
def test_fields_tessera_cannot_honour_are_refused(change, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config().to_dict(), **change})


def test_projection_qk_norm_refuses_replicated_kv_heads():
    from tessera.core.config import ModelConfig
    from tessera.core.errors import ConfigError
    from tessera.core.qk_norm import ProjectionNorm

    config = ModelConfig(family="olmo2", qk_norm=True, qk_norm_width="projection",
                         norm_placement="output", num_kv_heads=2)
    with pytest.raises(ConfigError, match=re.escape("tp=4 > num_kv_heads=2; use tp <= 2")):
        ProjectionNorm(config, config.num_kv_heads, 4, None)


def test_olmo2_1b_preset_has_its_published_size():
    from tessera.core.config import ModelConfig
    from tessera.core.parallel.sharding import num_parameters

    assert num_parameters(ModelConfig.from_name("olmo2-1b")) == 1_484_916_736
