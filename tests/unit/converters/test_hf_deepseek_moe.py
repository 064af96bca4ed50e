"""DeepSeek-V2 and DeepSeek-V3 with their Mixture-of-Experts layers (`DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`) against transformers.

Tiny random models built from configs (nothing downloaded): 3 layers, the first dense
(`first_k_dense_replace=1`), 8 routed experts in 2 groups of which each token may use 1, two
shared experts; V2 with group-limited greedy softmax routing, V3 with sigmoid routing through a
non-zero `e_score_correction_bias` and normalized weights, both with a routed scaling factor.
Imported logits within 1e-4 (also from transformers' fused in-memory expert layout), each
routing detail mattering to them, greedy serving equal to `generate`, export giving the same
config and logits, a tp2 reshard keeping them, a peft LoRA (on the attention) round-trip; the
MoE fields Tessera cannot honour refused by name.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import (  # noqa: E402
    ConversionError,
    check_exportable,
    config_from_hf,
)
from tessera.core.checkpoint import load_checkpoint  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB = 128
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=None,
              max_position_embeddings=64, initializer_range=0.2, first_k_dense_replace=1,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
              n_shared_experts=2, n_group=2, topk_group=1, pad_token_id=0, eos_token_id=1,
              bos_token_id=2)
ROUTING = {"deepseek_v2": dict(topk_method="group_limited_greedy", routed_scaling_factor=2.0),
           "deepseek_v3": dict(norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=12)}


def _hf_config(kind: str, **overrides):
    cls = transformers.DeepseekV2Config if kind == "deepseek_v2" else transformers.DeepseekV3Config
    return cls(**{**CONFIG, **ROUTING[kind], **overrides})


@pytest.fixture(scope="module", params=sorted(ROUTING))
def imported(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(
        _hf_config(kind), attn_implementation="eager"), scale=0.3)
    if kind == "deepseek_v3":  # a routing bias that changes the choice
        with torch.no_grad():
            for i in (1, 2):
                hf_model.model.layers[i].mlp.gate.e_score_correction_bias.copy_(
                    torch.linspace(-0.2, 0.3, 8) * i)
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return kind, hf_model, root


def test_imported_logits_match(imported):
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    m = model.config.moe
    assert (m.num_experts, m.first_dense_layers, m.num_groups, m.topk_groups,
            m.shared_ffn_hidden_size, m.shared_expert_gated) == (8, 1, 2, 1, 32, False)
    assert m.expert_bias == (kind == "deepseek_v3")
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 24, batch=2)) <= 1e-4


@pytest.mark.parametrize("detail", ["num_groups", "routed_scale", "per_version"])
def test_each_routing_detail_matters(imported, detail):
    """Dropping the group limit or the routed scaling, and V3's routing bias or V2's plain
    (never renormalized) weights, change the logits: the parity above covers each."""
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    for i in (1, 2):
        router = model.layers[str(i)].feed_forward.router
        if detail != "per_version":
            setattr(router, detail, 1)
        elif kind == "deepseek_v3":
            router.expert_bias.data.zero_()
        else:
            router.norm_topk = True
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 24, batch=2)) > 1e-3


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    kind, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 24),
                         transformers)


def test_fused_expert_layout_imports(imported, tmp_path):
    """A file in transformers' in-memory layout (fused `mlp.experts.gate_up_proj`) imports to
    the same model."""
    kind, hf_model, _ = imported
    state = hf_model.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    (tmp_path / "hf").mkdir()
    hf_model.config.save_pretrained(tmp_path / "hf")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "hf" / "model.safetensors")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt").eval()
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, 24, batch=2)) <= 1e-4


def test_greedy_serving_equals_generate(imported):
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 12, seed=5)[0].tolist()
    assert check.engine_greedy(model, prompt, 16) == check.hf_greedy(hf_model, prompt, 16)


@pytest.mark.slow  # 20-30 s a version; the dense DeepSeek tests run peft in the default run
def test_peft_lora_round_trips(imported, tmp_path):
    kind, hf_model, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, ["kv_b_proj", "o_proj"],
                          check.ids(VOCAB, 16, batch=2), transformers, peft)


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    kind, hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 16))


def test_real_configs_have_the_published_sizes():
    """DeepSeek-V2-Lite's and DeepSeek-V3's config fields give their published parameter
    counts, 15.7B and 671B (V3 without its multi-token-prediction layer)."""
    from tessera.core.parallel.sharding import num_parameters

    lite = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, n_shared_experts=2, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        topk_method="greedy", n_group=1, topk_group=1).to_dict()
    v3 = {**transformers.DeepseekV3Config().to_dict(), "topk_method": "noaux_tc",
          "scoring_func": "sigmoid", "moe_layer_freq": 1}
    assert num_parameters(config_from_hf(lite)) == pytest.approx(15.7e9, rel=2e-3)
    assert num_parameters(config_from_hf(v3)) == pytest.approx(671e9, rel=1e-3)


@pytest.mark.parametrize("kind, change, message", [
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True is not supported (supported: "
                                              "false: transformers' DeepSeek-V2 never"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported "
                                                 "(supported: greedy or group_limited_greedy)"),
    ("deepseek_v3", {"topk_method": "group_limited_greedy"},
     "topk_method='group_limited_greedy' is not supported (supported: 'noaux_tc'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported "
                                                 "(supported: sigmoid"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported (supported: 1"),
    ("deepseek_v3", {"n_group": None}, "n_group=None is not supported (supported: a whole "
                                       "number >= 1"),
    ("deepseek_v2", {"topk_group": None}, "topk_group=None is not supported (supported: a "
                                          "whole number from 1 to n_group=2)"),
])
def test_moe_fields_tessera_cannot_honour_are_refused(kind, change, message):
    with pytest.raises(ConversionError, match=re.escape(f"{kind} config: {message}")):
        config_from_hf({**_hf_config(kind).to_dict(), **change})


def test_a_gated_shared_expert_is_not_exported(imported):
    kind, _, root = imported
    config = load_checkpoint(root / "ckpt").config
    gated = dataclasses.replace(config, moe=dataclasses.replace(config.moe,
                                                                shared_expert_gated=True))
    with pytest.raises(ConversionError, match=r"'moe.shared_expert_gated': True"):
        check_exportable(gated)
