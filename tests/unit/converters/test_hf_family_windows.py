"""The sliding windows Gemma 2, Phi-3, Qwen3, Qwen2-MoE and Qwen3-MoE define, against
transformers, with a window of 8 and prompts and generations well past it.

Tiny random models built from a config (nothing downloaded), each with the window on the layers
transformers gives it: Gemma 2's every other layer (its default `layer_types`), Phi-3's every
layer, Qwen3's every layer (`max_window_layers=0`), Qwen2-MoE's layer 0 (every other layer
below `max_window_layers`), Qwen3-MoE's every layer (its `max_window_layers` unread).
Imported logits within 1e-4 (fp32), greedy serving through the paged cache equal to `generate`
for 20 tokens, paged blocks outside the window freed where every layer slides, the export giving
the same config and logits; the window fields transformers would not honour refused by name.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB, WINDOW, BLOCK = 256, 8, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
               initializer_range=0.1, pad_token_id=0)
_QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=WINDOW)
# name: (config class, fields, the windowed layers as imported: None for every layer)
MODELS = {
    "gemma2": ("Gemma2Config", dict(_COMMON, head_dim=8, sliding_window=WINDOW,
                                    query_pre_attn_scalar=8, attn_logit_softcapping=4.0,
                                    final_logit_softcapping=8.0), (0,)),
    "phi3": ("Phi3Config", dict(_COMMON, sliding_window=WINDOW, tie_word_embeddings=False,
                                original_max_position_embeddings=128),
             None),
    "qwen3": ("Qwen3Config", dict(_COMMON, **_QWEN_WINDOW, max_window_layers=0, head_dim=8,
                                  tie_word_embeddings=False), None),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, **_QWEN_WINDOW, max_window_layers=1,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32,
                                         tie_word_embeddings=False), (0,)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, **_QWEN_WINDOW, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         tie_word_embeddings=False),
                  None),
}


def _hf_config(name: str, **overrides):
    cls, fields, _ = MODELS[name]
    return getattr(transformers, cls)(**{**fields, **overrides})


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory):
    name, root = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(
        _hf_config(name), attn_implementation="eager"), scale=0.1)
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return name, hf_model, root


def test_window_is_imported_and_logits_match_past_it(imported):
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    assert (model.config.sliding_window, model.config.sliding_window_layers) == (
        WINDOW, MODELS[name][2])
    tokens = check.ids(VOCAB, 40, batch=2)
    assert check.logit_diff(hf_model, model, tokens) <= 1e-4
    for layer in model.layers.values():  # the window matters
        layer.attention.window = None
    assert check.logit_diff(hf_model, model, tokens) > 1e-3


def test_greedy_paged_serving_equals_generate_and_frees_blocks(imported):
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 12)[0].tolist()
    kv = KVCacheConfig(kind="paged", block_size=BLOCK, num_blocks=64)
    got, stats = check.engine_run(model, prompt, 20, kv)
    assert got == check.hf_greedy(hf_model, prompt, 20)
    if MODELS[name][2] is None:  # every layer slides: blocks behind the window are given back
        assert stats["kv_block_window_frees_total"] >= 32 // BLOCK - (
            math.ceil(WINDOW / BLOCK) + 1)
    else:  # a layer attends to everything: every block is kept
        assert stats["kv_block_window_frees_total"] == 0


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    _, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


@pytest.mark.parametrize("name, change, message", [
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]},
     "gemma2 config: layer_types=['sliding_attention', 'chunked_attention'] is not supported "
     "(supported: 2 entries of ['full_attention', 'sliding_attention'])"),
    ("gemma2", {"sliding_window": 0},
     "gemma2 config: sliding_window=0 is not supported (supported: a positive number"),
    ("phi3", {"sliding_window": -2},
     "phi3 config: sliding_window=-2 is not supported (supported: a positive number"),
    ("qwen3", {"use_sliding_window": False, "layer_types": ["full_attention",
                                                            "sliding_attention"]},
     "qwen3 config: layer_types names sliding_attention layers but use_sliding_window is false"),
    ("qwen2_moe", {"use_sliding_window": False, "sliding_window": 0,
                   "layer_types": ["sliding_attention", "full_attention"]},
     "qwen2_moe config: layer_types names sliding_attention layers but use_sliding_window is "
     "false"),
])
def test_window_fields_transformers_would_not_honour_are_refused(name, change, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config(name).to_dict(), **change})


@pytest.mark.parametrize("imported", ["qwen3_moe"], indirect=True)
def test_qwen3_moe_serving_from_a_long_prompt_and_a_tp2_reshard_keep_the_window(imported,
                                                                               tmp_path):
    _, hf_model, root = imported
    prompt = check.ids(VOCAB, 40)[0].tolist()
    model = load_checkpoint(root / "ckpt").eval()
    assert check.engine_greedy(model, prompt, 12) == check.hf_greedy(hf_model, prompt, 12)
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 40))
    assert load_checkpoint(tmp_path / "tp2").config.sliding_window == WINDOW


def test_qwen3_moe_windows_every_layer_and_refuses_layer_types_naming_full_ones():
    # max_window_layers=1 windows layer 0 alone in Qwen2-MoE; Qwen3-MoE never reads the field
    assert config_from_hf({**_hf_config("qwen3_moe").to_dict(), "max_window_layers": 1}
                          ).sliding_window_layers is None
    hf = {**_hf_config("qwen3_moe").to_dict(),
          "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(ConversionError, match=re.escape(
            "qwen3_moe config: layer_types=['full_attention', 'sliding_attention'] is not "
            "supported with use_sliding_window (supported: no layer_types, or every entry "
            "sliding_attention")):
        config_from_hf(hf)
    assert config_from_hf({**hf, "layer_types": ["sliding_attention"] * 2}) == config_from_hf(
        _hf_config("qwen3_moe").to_dict())


@pytest.mark.parametrize("name", list(MODELS))
def test_a_window_covering_every_position_is_no_window(name):
    config = config_from_hf(_hf_config(name, sliding_window=128).to_dict())
    assert (config.sliding_window, config.sliding_window_layers) == (None, None)
