"""Qwen2 / Qwen2.5 dense (`Qwen2ForCausalLM`: biases on q/k/v only, tied embeddings at the small
sizes, yarn for long context) and Qwen2-MoE as it ships (`qkv_bias=True`), against transformers.

Tiny random models built from a config (nothing downloaded), every bias perturbed away from 0 so
a dropped or misplaced one shows. For each: imported logits within 1e-4, greedy serving equal to
`generate` for 20 tokens, export giving the same config and logits, a tp2 reshard keeping them,
a peft LoRA round-trip; and the fields Tessera cannot honour refused by name.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.core.parallel.sharding import global_param_shapes  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
MODELS = {
    # Qwen2.5-0.5B's shape in small: tied output, grouped-query heads.
    "qwen2": ("Qwen2Config", dict(**_COMMON, intermediate_size=64, tie_word_embeddings=True)),
    # Qwen2.5 long context: untied, yarn past an original length of 16.
    "qwen2_yarn": ("Qwen2Config", dict(**_COMMON, intermediate_size=64, tie_word_embeddings=False,
                                       rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                            original_max_position_embeddings=16,
                                                            rope_theta=1e6))),
    # Qwen2-MoE as shipped: qkv_bias=True; layer 0 dense, layer 1 MoE with a shared expert.
    "qwen2_moe": ("Qwen2MoeConfig", dict(**_COMMON, intermediate_size=64, qkv_bias=True,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32,
                                         decoder_sparse_step=2, tie_word_embeddings=False)),
}
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_config(name: str, **overrides):
    cls, fields = MODELS[name]
    return getattr(transformers, cls)(**{**fields, **overrides})


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
    assert (c.qkv_bias, c.bias) == (True, False)
    shapes = global_param_shapes(c)
    assert "layers.0.attention.wqkv.bias" in shapes and "layers.0.attention.wo.bias" not in shapes
    assert c.tied_embeddings == (name == "qwen2")
    for length in (12, 40):  # 40 crosses the yarn model's original length
        tokens = check.ids(VOCAB, length, batch=2)
        assert check.logit_diff(hf_model, model, tokens) <= 1e-4, (name, length)


def test_the_qkv_biases_matter(imported):
    """Without its q/k/v biases the model gives other logits: the parity above covers them."""
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    with torch.no_grad():
        for i in model.layers:
            model.layers[i].attention.wqkv.bias.zero_()
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 12)) > 1e-3


def test_greedy_serving_equals_generate(imported):
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 10, seed=5)[0].tolist()
    want = check.hf_greedy(hf_model, prompt, 20)
    assert check.engine_greedy(model, prompt, 20) == want, name


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    name, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    name, hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 24))


@pytest.mark.parametrize("imported", ["qwen2", "qwen2_moe"], indirect=True)
def test_peft_lora_round_trips(imported, tmp_path):
    name, hf_model, root = imported
    targets = PEFT_TARGETS if name == "qwen2" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, targets,
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


@pytest.mark.parametrize("name, change, message", [
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (supported: 'silu')"),
    ("qwen2", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e6}},
     "rope type 'proportional' is not supported"),
    # transformers' Qwen2MoeConfig writes sliding_window=0 when use_sliding_window is off.
    ("qwen2_moe", {"use_sliding_window": True}, "qwen2_moe config: sliding_window=0 is not "
                                                "supported (supported: a positive number"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] is not supported"),
])
def test_fields_tessera_cannot_honour_are_refused(name, change, message):
    import re

    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config(name).to_dict(), **change})


def test_export_refuses_biases_qwen2_does_not_have(tmp_path):
    from tessera.converters.hf_mapping import check_exportable
    from tessera.core.config import ModelConfig

    qwen2 = ModelConfig(family="qwen2", qkv_bias=True)
    check_exportable(qwen2)
    with pytest.raises(ConversionError, match="'bias': True"):
        check_exportable(ModelConfig(family="qwen2", bias=True))
    with pytest.raises(ConversionError, match="qkv_bias must be False"):
        check_exportable(ModelConfig.from_name("qwen3-moe-tiny", qkv_bias=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_half_precision_files_import_exactly(tmp_path, dtype):
    """A checkpoint as the Hub ships it: half precision, sharded behind
    model.safetensors.index.json. Imported as stored, every tensor is HF's bit for bit; cast to
    fp32 it gives the logits of transformers loading those files in fp32 (not of the model cast
    back to fp32, whose rotary frequencies the half-precision cast has coarsened)."""
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(_hf_config("qwen2")))
    hf_model.to(dtype).save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt")
    assert model.tok_embeddings.weight.dtype == dtype
    assert torch.equal(model.layers["1"].attention.wqkv.bias,
                       torch.cat([hf_model.model.layers[1].self_attn.q_proj.bias,
                                  hf_model.model.layers[1].self_attn.k_proj.bias,
                                  hf_model.model.layers[1].self_attn.v_proj.bias]))
    import_hf(tmp_path / "hf", tmp_path / "fp32", dtype="fp32")
    tokens = check.ids(VOCAB, 16)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32).eval()
    assert check.logit_diff(reference, load_checkpoint(tmp_path / "fp32").eval(), tokens) <= 1e-4
