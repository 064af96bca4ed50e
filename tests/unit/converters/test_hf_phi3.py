"""Phi-3 / Phi-3.5-mini (`Phi3ForCausalLM`: fused `qkv_proj` and `gate_up_proj`, longrope with a
top-level original length, partial rotary) against transformers.

Tiny random models built from a config (nothing downloaded). For each: imported logits within
1e-4 on both sides of the original rope length, greedy serving equal to `generate` for 20
tokens, export giving the same config and logits, a tp2 reshard keeping them, a peft LoRA on the
fused modules round-tripping; and the fields Tessera cannot honour refused by name.
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
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MODELS = {
    # Phi-3-mini-4k's form: plain RoPE, no window.
    "phi3": dict(**_COMMON, original_max_position_embeddings=64, sliding_window=None),
    # Phi-3.5-mini's form: longrope past a top-level original length of 16, and (as
    # Phi-4-mini) half the head dims rotated.
    "phi3_longrope": dict(**_COMMON, original_max_position_embeddings=16, sliding_window=None,
                          rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                               partial_rotary_factor=0.5,
                                               short_factor=[1.0, 1.3],
                                               long_factor=[2.5, 7.0])),
}


def _hf_config(name: str, **overrides):
    return transformers.Phi3Config(**{**MODELS[name], **overrides})


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory):
    name, root = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(_hf_config(name)))
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return name, hf_model, root


def test_imported_logits_match(imported):
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    c = model.config
    assert (c.family, c.bias, c.qkv_bias) == ("phi3", False, False)
    if name == "phi3_longrope":
        assert (c.rope_scaling.type, c.rotary_fraction) == ("longrope", 0.5)
        assert c.rope_scaling.original_max_position_embeddings == 16
    for length in (12, 40):  # 40 crosses the longrope model's original length
        tokens = check.ids(VOCAB, length, batch=2)
        assert check.logit_diff(hf_model, model, tokens) <= 1e-4, (name, length)


def test_fused_projections_import_whole(imported):
    """The HF fused tensors are Tessera's fused weights as they are (rows q, k, v / gate, up)."""
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt")
    hf_layer = hf_model.model.layers[1]
    assert torch.equal(model.layers["1"].attention.wqkv.weight, hf_layer.self_attn.qkv_proj.weight)
    assert torch.equal(model.layers["1"].feed_forward.w1.weight, hf_layer.mlp.gate_up_proj.weight)


def test_greedy_serving_equals_generate(imported):
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    # A prompt already past the original length (20 > 16); one that crosses it while
    # generating is checked in tests/unit/serving/engine/test_length_dependent_rope.py.
    prompt = check.ids(VOCAB, 20 if name == "phi3_longrope" else 10, seed=5)[0].tolist()
    want = check.hf_greedy(hf_model, prompt, 20)
    assert check.engine_greedy(model, prompt, 20) == want, name


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    name, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    name, hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 40))


def test_tp2_pp2_reshard_keeps_the_logits(imported, tmp_path):
    name, hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2pp2", check.ids(VOCAB, 40), pp=2)


@pytest.mark.parametrize("imported", ["phi3_longrope"], indirect=True)
def test_peft_lora_on_the_fused_modules_round_trips(imported, tmp_path):
    name, hf_model, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path,
                          ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 0}, "phi3 config: sliding_window=0 is not supported (supported: a "
                            "positive number of tokens, or null)"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (supported: 'silu')"),
    ({"resid_pdrop": 0.1}, "resid_pdrop=0.1 differs from attention_dropout=0.0"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     "rope type 'proportional' is not supported"),
])
def test_fields_tessera_cannot_honour_are_refused(change, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config("phi3").to_dict(), **change})


@pytest.mark.parametrize("window", [64, 262144])
def test_a_window_as_wide_as_the_context_converts(window):
    """A window that masks nothing (Phi-3.5-mini ships 262144 for a 131072 context) converts;
    the export writes None, which computes the same."""
    config = config_from_hf({**_hf_config("phi3").to_dict(), "sliding_window": window})
    assert config.family == "phi3"


def test_phi3_mini_preset_has_its_published_size():
    from tessera.core.config import ModelConfig
    from tessera.core.parallel.sharding import num_parameters

    assert num_parameters(ModelConfig.from_name("phi3-mini")) == 3_821_079_552
