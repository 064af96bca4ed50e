"""Gemma 2 (`Gemma2ForCausalLM`: (1 + w) RMSNorms before and after each sublayer, GeGLU,
embeddings scaled by sqrt(hidden), `query_pre_attn_scalar`, attention and final logit soft
caps) against transformers.

A tiny random model built from a config (nothing downloaded), its sliding window as wide as the
context, its caps small enough to bend the scores and logits: imported logits within 1e-4,
greedy serving equal to `generate` for 20 tokens, export giving the same config and logits, a
tp2 reshard keeping them, a peft LoRA round-trip; and the fields Tessera cannot honour refused
by name.
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
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, sliding_window=64, query_pre_attn_scalar=12,
              attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.3,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_config(**overrides):
    return transformers.Gemma2Config(**{**CONFIG, **overrides})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(
        _hf_config(), attn_implementation="eager"), scale=0.3)
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return hf_model, root


def test_imported_logits_match(imported):
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    c = model.config
    assert (c.family, c.norm, c.norm_placement, c.activation, c.tied_embeddings) == (
        "gemma2", "rmsnorm1p", "sandwich", "geglu", True)
    assert (c.options.attn_logit_softcapping, c.options.final_logit_softcapping) == (2.0, 3.0)
    for length in (12, 40):
        assert check.logit_diff(hf_model, model, check.ids(VOCAB, length, batch=2)) <= 1e-4


@pytest.mark.parametrize("option", ["attn_logit_softcapping", "final_logit_softcapping",
                                    "query_pre_attn_scalar", "scale_embeddings"])
def test_each_gemma_detail_matters(imported, option):
    """Turning any one detail off changes the logits: the parity above covers each."""
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    if option == "final_logit_softcapping":
        model.final_softcap = None
    elif option == "scale_embeddings":
        model.config.options.scale_embeddings = False
    else:
        for layer in model.layers.values():
            setattr(layer.attention, "softcap" if option.startswith("attn") else "scale", None)
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


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 24))


def test_tp2_pp2_reshard_keeps_the_logits(imported, tmp_path):
    hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2pp2", check.ids(VOCAB, 24), pp=2)


def test_peft_lora_round_trips(imported, tmp_path):
    hf_model, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, PEFT_TARGETS,
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention"]}, "layer_types=['sliding_attention'] is not "
                                             "supported (supported: 2 entries of"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ({"attention_bias": True}, "attention_bias=True is not supported (supported: False)"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
])
def test_fields_tessera_cannot_honour_are_refused(change, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config().to_dict(), **change})


def test_context_parallel_and_packed_documents_are_refused(imported):
    hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    tokens = check.ids(VOCAB, 8)
    with pytest.raises(NotImplementedError, match="default score scale without a soft cap"):
        model(tokens, document_ids=torch.zeros_like(tokens))


def test_gemma2_2b_preset_has_its_published_size():
    from tessera.core.config import ModelConfig
    from tessera.core.parallel.sharding import num_parameters

    config = ModelConfig.from_name("gemma2-2b")
    assert config.options.final_logit_softcapping == 30.0
    assert num_parameters(config) == 2_614_341_888
