"""DeepSeek-V2/V3 routing in `MoEFeedForward` against transformers' `DeepseekV2Moe` and
`DeepseekV3MoE` with the same weights (fp32, 1e-5): softmax greedy and group-limited choice (V2),
sigmoid choice with the score-correction bias, top-2-sum group scores and optional top-k
normalization (V3), the routed scaling factor and the ungated shared experts. Inputs are drawn
so that the group limit changes the chosen experts (checked), and the bias changes the choice
but not the weights. Refused MoE options name the field, its value and what is supported.
"""

from __future__ import annotations

import pytest
import torch

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.moe.layer import MoEFeedForward
from tessera.core.parallel.groups import ParallelGroups

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3  # noqa: E402

HIDDEN, FFN, EXPERTS, SHARED = 32, 16, 8, 2


def _hf_config(version: int, **fields):
    common = dict(hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=FFN,
                  n_routed_experts=EXPERTS, n_shared_experts=SHARED, num_experts_per_tok=3,
                  num_attention_heads=4, num_hidden_layers=2, vocab_size=64)
    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    return cls(**{**common, **fields})


def _hf_moe(version: int, seed: int, **fields) -> torch.nn.Module:
    config = _hf_config(version, **fields)
    moe = v2.DeepseekV2Moe(config) if version == 2 else v3.DeepseekV3MoE(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return moe.eval()


def _tessera_config(**moe) -> ModelConfig:
    flat = {f"moe_{k}": v for k, v in moe.items()}
    return ModelConfig.from_name(
        "mixtral-tiny", hidden_size=HIDDEN, num_heads=4, ffn_hidden_size=64, num_layers=2,
        num_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_shared_ffn_hidden_size=SHARED * FFN,
        moe_shared_expert_gated=False, **flat)


def _tessera_moe(config: ModelConfig, hf: torch.nn.Module) -> MoEFeedForward:
    """The Tessera layer holding `hf`'s weights (names as `converters.hf.deepseek_moe`)."""
    layer = MoEFeedForward(config, 1, ParallelGroups(), sp=False).eval()
    shared = hf.shared_experts
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
        layer.experts.w1.copy_(hf.experts.gate_up_proj)
        layer.experts.w2.copy_(hf.experts.down_proj)
        layer.shared_expert.w1.weight.copy_(torch.cat([shared.gate_proj.weight,
                                                       shared.up_proj.weight]))
        layer.shared_expert.w2.weight.copy_(shared.down_proj.weight)
    assert layer.shared_expert_gate is None
    return layer


def _tokens(seed: int) -> torch.Tensor:
    return torch.randn(2, 24, HIDDEN, generator=torch.Generator().manual_seed(seed))


# (HF version, HF config fields, the matching `MoEConfig` fields)
VARIANTS = {
    "v2-greedy": (2, dict(topk_method="greedy", routed_scaling_factor=1.5),
                  dict(norm_topk=False, routed_scale=1.5)),
    "v2-group-limited": (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                 routed_scaling_factor=2.0),
                         dict(norm_topk=False, routed_scale=2.0, num_groups=4, topk_groups=2,
                              group_score="max")),
    "v3-noaux-tc-norm": (3, dict(n_group=4, topk_group=2, norm_topk_prob=True,
                                 routed_scaling_factor=2.5),
                         dict(router_score="sigmoid", expert_bias=True, norm_topk=True,
                              routed_scale=2.5, num_groups=4, topk_groups=2,
                              group_score="top2_sum")),
    "v3-noaux-tc-unnormalized": (3, dict(n_group=2, topk_group=1, norm_topk_prob=False,
                                         routed_scaling_factor=1.0),
                                 dict(router_score="sigmoid", expert_bias=True, norm_topk=False,
                                      num_groups=2, topk_groups=1, group_score="top2_sum")),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_layer_equals_transformers_deepseek_moe(name):
    version, hf_fields, moe_fields = VARIANTS[name]
    hf = _hf_moe(version, seed=0, **hf_fields)
    if version == 3:  # a bias that changes the choice (checked below)
        hf.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.4, EXPERTS))
    config = _tessera_config(top_k=3, **moe_fields)
    layer = _tessera_moe(config, hf)
    x = _tokens(1)
    with torch.no_grad():
        want = hf(x)
        got = layer(x.transpose(0, 1)).transpose(0, 1)  # Tessera's layout is (T, B, C)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if config.moe.num_groups > 1:  # the group limit decides something on these tokens
        routing = layer.router(x.reshape(-1, HIDDEN))
        layer.router.num_groups = 1
        unlimited = layer.router(x.reshape(-1, HIDDEN))
        same = (routing.chosen.sort(-1).values == unlimited.chosen.sort(-1).values).all(-1)
        assert not same.all()


def test_score_correction_bias_changes_choice_not_weights():
    hf = _hf_moe(3, seed=2, n_group=2, topk_group=2, norm_topk_prob=True,
                 routed_scaling_factor=2.5)
    config = _tessera_config(top_k=3, router_score="sigmoid",
                             expert_bias=True, routed_scale=2.5, num_groups=2, topk_groups=2,
                             group_score="top2_sum")
    layer = _tessera_moe(config, hf)
    x = _tokens(3).reshape(-1, HIDDEN)
    with torch.no_grad():
        plain = layer.router(x)
        layer.router.expert_bias[5] = 2.0
        biased = layer.router(x)
        sigmoid = torch.sigmoid(x @ layer.router.weight.t())
    assert (biased.chosen == 5).any(-1).all() and not (plain.chosen == 5).any(-1).all()
    chosen = sigmoid.gather(1, biased.chosen)
    torch.testing.assert_close(biased.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_first_dense_layers_keep_the_dense_mlp():
    from tessera.core.init import build_model
    from tessera.core.moe.shapes import moe_layers

    config = ModelConfig.from_name("mixtral-tiny", num_layers=3, moe_first_dense_layers=1,
                                   moe_ffn_hidden_size=16)
    assert moe_layers(config) == [1, 2]
    model = build_model(config, seed=0)
    assert not isinstance(model.layers["0"].feed_forward, MoEFeedForward)
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == 2 * config.ffn_hidden_size
    assert model.layers["1"].feed_forward.experts.w2.shape[-1] == 16


@pytest.mark.parametrize(("fields", "message"), [
    ({"moe_num_groups": 3}, r"moe_num_groups 3 must be >= 1 and divide num_experts 4 .* use "
                            r"one of \[1, 2, 4\]"),
    ({"moe_num_groups": 2, "moe_topk_groups": 3},
     "moe_topk_groups 3 must be between 1 and moe_num_groups 2"),
    ({"moe_num_groups": 4, "moe_topk_groups": 1},
     "moe_top_k 2 exceeds the 1 experts of the moe_topk_groups 1 groups of 1"),
    ({"moe_num_groups": 4, "moe_topk_groups": 2, "moe_group_score": "top2_sum"},
     "moe_group_score 'top2_sum' needs groups of >= 2 experts"),
    ({"moe_group_score": "mean"}, r"moe_group_score 'mean' is unknown; choose 'max' .* or "
                                  r"'top2_sum'"),
    ({"moe_routed_scale": 0.0}, "moe_routed_scale must be > 0"),
    ({"moe_first_dense_layers": 2}, "moe_first_dense_layers 2 must be between 0 and "
                                    "num_layers - 1 = 1"),
])
def test_bad_deepseek_moe_fields_name_field_value_and_choices(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_name("mixtral-tiny", **fields)
