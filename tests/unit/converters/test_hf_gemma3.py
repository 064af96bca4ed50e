"""Gemma 3 text (`Gemma3ForCausalLM`: Gemma 2's sandwich norms, GeGLU and scaled embeddings,
(1 + w) per-head q/k norms, local layers with a sliding window and their own RoPE base, global
layers with linear RoPE scaling, a final soft cap) against transformers.

A tiny random model built from a config (nothing downloaded), window 8, its three local layers
at base 100 and its global one linearly scaled: imported logits within 1e-4 for prompts
crossing the window, greedy serving equal to `generate` for 20 tokens past it (freeing paged
blocks), export giving the same config and logits, tp2 and tp2 x pp2 reshards keeping them, a
peft LoRA round-trip; the older config form read alike; every field Tessera cannot honour
refused by name.
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
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB, WINDOW = 256, 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, sliding_window=WINDOW, layer_types=LAYER_TYPES,
              rope_parameters=ROPE, query_pre_attn_scalar=12, final_logit_softcapping=3.0,
              initializer_range=0.3, pad_token_id=0, eos_token_id=1, bos_token_id=2)
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_config(**overrides):
    return transformers.Gemma3TextConfig(**{**CONFIG, **overrides})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(
        _hf_config(), attn_implementation="eager"), scale=0.3)
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return hf_model, root


def test_imported_config_and_logits_match(imported):
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    c = model.config
    assert (c.family, c.norm, c.norm_placement, c.qk_norm, c.tied_embeddings) == (
        "gemma3", "rmsnorm1p", "sandwich", True, True)
    assert (c.sliding_window, c.sliding_window_layers, c.sliding_window_rope_theta) == (
        WINDOW, (0, 1, 3), 100.0)
    assert (c.rope_theta, c.rope_scaling.type, c.rope_scaling.factor) == (10000.0, "linear", 2.0)
    for length in (6, 40):
        assert check.logit_diff(hf_model, model, check.ids(VOCAB, length, batch=2)) <= 1e-4


@pytest.mark.parametrize("detail", ["window", "local rope", "qk norm offset"])
def test_each_gemma3_detail_matters(imported, detail):
    """Dropping any one detail changes the logits: the parity above covers each."""
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    if detail == "local rope":
        model.rotary.sliding = None
    for layer in model.layers.values():
        if detail == "window":
            layer.attention.window = None
        elif detail == "qk norm offset":
            layer.attention.q_norm.offset = layer.attention.k_norm.offset = False
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 24)) > 1e-3


@pytest.mark.parametrize("kv", [None, KVCacheConfig(kind="paged", block_size=4)],
                         ids=["slots", "paged"])
def test_greedy_serving_equals_generate_past_the_window(imported, kv):
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 10, seed=5)[0].tolist()
    got, _ = check.engine_run(model, prompt, 20, kv)
    assert got == check.hf_greedy(hf_model, prompt, 20)


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    _, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 24))


def test_tp2_pp2_reshard_keeps_the_logits(imported, tmp_path):
    _, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2pp2", check.ids(VOCAB, 24), pp=2)


def test_peft_lora_round_trips(imported, tmp_path):
    _, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, PEFT_TARGETS,
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


def test_the_older_config_form_reads_alike():
    """transformers 4's fields (`rope_theta`, `rope_local_base_freq`, `rope_scaling`,
    `sliding_window_pattern`, no `layer_types`) give what transformers 5 derives from them."""
    older = {**CONFIG, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
             "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window_pattern": 3,
             "model_type": "gemma3_text"}
    del older["rope_parameters"], older["layer_types"]
    newer = _hf_config(**{k: v for k, v in older.items() if k != "model_type"})
    assert newer.layer_types == LAYER_TYPES[:2] + ["full_attention", "sliding_attention"]
    assert config_from_hf(older) == config_from_hf(newer.to_dict())


def test_local_layers_rotating_as_the_global_ones_keep_their_scaling():
    same = {**ROPE["full_attention"]}
    config = config_from_hf({**_hf_config().to_dict(), "rope_parameters": {
        "full_attention": same, "sliding_attention": same}})
    assert (config.sliding_window_rope_theta, config.rope_scaling.type) == (None, "linear")


@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported (supported: "
                                     "True)"),
    ({"attention_bias": True}, "attention_bias=True is not supported (supported: False)"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported "
                                       "(supported: None; transformers' Gemma 3 does not apply"),
    ({"sliding_window": 0}, "sliding_window=0 is not supported (supported: a positive number"),
    ({"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]},
     "layer_types=['sliding_attention', 'sliding_attention', 'sliding_attention', "
     "'chunked_attention'] is not supported (supported: 4 entries of"),
    ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 100.0}}},
     "rope_parameters['sliding_attention']={'rope_type': 'linear', 'factor': 2.0, "
     "'rope_theta': 100.0} is not supported (supported: rope_type 'default'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}},
     "rope_parameters={'rope_type': 'default', 'rope_theta': 100.0} is not supported "
     "(supported: one entry per layer type"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.5}}},
     "partial_rotary_factor=0.5 is not supported (supported: 1.0)"),
    ({"layer_types": None, "sliding_window_pattern": 0},
     "sliding_window_pattern=0 is not supported (supported: a positive number of layers)"),
])
def test_fields_tessera_cannot_honour_are_refused(change, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config().to_dict(), **change})


def test_the_multimodal_gemma3_is_refused_for_its_text_model():
    with pytest.raises(ConversionError, match=re.escape(
            "model_type 'gemma3' (Gemma3ForConditionalGeneration, text and vision) is not "
            "supported: Tessera has no vision tower; import a text-only Gemma 3")):
        config_from_hf({"model_type": "gemma3", "architectures": [
            "Gemma3ForConditionalGeneration"], "text_config": CONFIG})


def test_gemma3_1b_preset_has_its_published_size():
    from tessera.core.config import ModelConfig
    from tessera.core.parallel.sharding import num_parameters

    config = ModelConfig.from_name("gemma3-1b")
    assert (config.sliding_window, config.sliding_window_rope_theta) == (512, 10000.0)
    assert [i for i in range(26) if config.layer_window(i) is None] == [5, 11, 17, 23]
    assert num_parameters(config) == 999_885_952
