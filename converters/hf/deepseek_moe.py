"""The Mixture-of-Experts part of the DeepSeek-V2/V3 Hugging Face contract (`deepseek_v2`,
`deepseek_v3`): its config fields as a `MoEConfig`, back, and its weight names.

What transformers 5 computes (`DeepseekV2Moe`, `DeepseekV3MoE`), and the `MoEConfig` that does
the same:
- every layer from `first_k_dense_replace` on is MoE (`moe.first_dense_layers`); the dense ones
  use `intermediate_size`, the `n_routed_experts` routed experts `moe_intermediate_size`;
- V2: softmax scores; `topk_method` "greedy" (plain top-k) or "group_limited_greedy" (`n_group`
  groups scored by their best expert, the `topk_group` best kept: `moe.group_score` "max");
  the k weights are the scores times `routed_scaling_factor`, never renormalized;
- V3: sigmoid scores; the choice adds `e_score_correction_bias` (`moe.expert_bias`, which
  Tessera's aux-loss-free balancing then trains) and keeps the `topk_group` of `n_group` groups
  scored by the sum of their best two biased scores (`moe.group_score` "top2_sum"); the weights
  are the unbiased scores, divided by their sum when `norm_topk_prob`, times
  `routed_scaling_factor`;
- both: `n_shared_experts` ungated shared experts, one MLP of `n_shared_experts x
  moe_intermediate_size` added to the routed output (`moe.shared_expert_gated` False).

Fields transformers ignores but DeepSeek's own code honours differently are refused rather than
guessed: V2's `norm_topk_prob: true` (DeepSeek's code normalizes instead of scaling), a
`moe_layer_freq` other than 1, a `topk_method` or `scoring_func` the version does not compute.
Transformers computes no router loss for these families; `aux_loss_alpha`, when the config has
it, weights Tessera's load-balancing loss (else 0: V3 balances by its routing bias).

Weights (per-expert on disk, as `save_pretrained` writes; the fused 3-D `experts.gate_up_proj` /
`experts.down_proj` of transformers' memory are read too, `converters.hf.moe.moe_pairs`):
`mlp.gate.weight`, `mlp.gate.e_score_correction_bias` (V3), `mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight`, `mlp.shared_experts.gate_proj/up_proj/down_proj.weight`.
"""

from __future__ import annotations

from typing import Any

from tessera.converters.hf.family import ConversionError, NameMap
from tessera.core.config import ModelConfig
from tessera.core.moe.config import MoEConfig

_MLP = "model.layers.{}.mlp"
DEEPSEEK_MOE_NAMES: NameMap = {
    "layers.{}.feed_forward.router.weight": (f"{_MLP}.gate.weight",),
    "layers.{}.feed_forward.router.expert_bias": (f"{_MLP}.gate.e_score_correction_bias",),
    "layers.{}.feed_forward.experts.w1": (f"{_MLP}.experts.{{e}}.gate_proj.weight",
                                          f"{_MLP}.experts.{{e}}.up_proj.weight"),
    "layers.{}.feed_forward.experts.w2": (f"{_MLP}.experts.{{e}}.down_proj.weight",),
    "layers.{}.feed_forward.shared_expert.w1.weight": (f"{_MLP}.shared_experts.gate_proj.weight",
                                                       f"{_MLP}.shared_experts.up_proj.weight"),
    "layers.{}.feed_forward.shared_expert.w2.weight": (
        f"{_MLP}.shared_experts.down_proj.weight",),
}

_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _refuse(hf: dict[str, Any], key: str, supported: str) -> None:
    raise ConversionError(f"{hf['model_type']} config: {key}={hf.get(key)!r} is not supported "
                          f"(supported: {supported})")


def _allow(hf: dict[str, Any], key: str, allowed: tuple[Any, ...], supported: str) -> None:
    if key in hf and hf[key] not in allowed:
        _refuse(hf, key, supported)


def deepseek_moe_config(hf: dict[str, Any]) -> MoEConfig:
    """The `MoEConfig` of a DeepSeek-V2/V3 `config.json` (`num_experts` 0 when no layer is
    MoE); raises ConversionError naming a field transformers computes differently."""
    v3 = hf["model_type"] == "deepseek_v3"
    layers, experts = hf["num_hidden_layers"], hf.get("n_routed_experts") or 0
    first_dense = hf.get("first_k_dense_replace") or 0
    if not experts or first_dense >= layers:
        return MoEConfig()
    _allow(hf, "moe_layer_freq", (1, None), "1: transformers makes every layer from "
           "first_k_dense_replace on MoE")
    _allow(hf, "scoring_func", ("sigmoid" if v3 else "softmax",),
           f"{'sigmoid' if v3 else 'softmax'}, what transformers computes for {hf['model_type']}")
    if v3:
        _allow(hf, "topk_method", ("noaux_tc",), "'noaux_tc', what transformers' V3 computes")
        groups, method = hf.get("n_group"), "noaux_tc"
    else:
        method = hf.get("topk_method") or "greedy"
        _allow(hf, "topk_method", (*_V2_TOPK_METHODS, None), " or ".join(_V2_TOPK_METHODS))
        if hf.get("norm_topk_prob"):
            _refuse(hf, "norm_topk_prob", "false: transformers' DeepSeek-V2 never renormalizes "
                    "the top-k weights, DeepSeek's own code renormalizes instead of scaling")
        groups = hf.get("n_group") if method == "group_limited_greedy" else 1
    if not isinstance(groups, int) or groups < 1:
        _refuse(hf, "n_group", f"a whole number >= 1 for topk_method {method!r}")
    kept = hf.get("topk_group") if groups > 1 else 1
    if not isinstance(kept, int) or not 1 <= kept <= groups:
        _refuse(hf, "topk_group", f"a whole number from 1 to n_group={groups}")
    ffn = hf["moe_intermediate_size"]
    return MoEConfig(
        num_experts=experts, top_k=hf["num_experts_per_tok"], ffn_hidden_size=ffn,
        shared_ffn_hidden_size=(hf.get("n_shared_experts") or 0) * ffn,
        shared_expert_gated=False, first_dense_layers=first_dense,
        router_score="sigmoid" if v3 else "softmax", expert_bias=v3,
        norm_topk=bool(hf.get("norm_topk_prob")) if v3 else False,
        routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
        num_groups=groups, topk_groups=kept,
        group_score="top2_sum" if v3 else "max",
        aux_loss_coef=float(hf.get("aux_loss_alpha") or 0.0))


def deepseek_moe_problems(c: ModelConfig) -> dict[str, Any]:
    """The `MoEConfig` fields (as `moe.<field>`: value) keeping `c` from being written as a
    Hugging Face `c.family` model; empty when it can be (or `c` has no MoE layer)."""
    m, v3 = c.moe, c.family == "deepseek_v3"
    if not m.num_experts:
        return {}
    want: dict[str, Any] = {
        "layer_freq": 1, "shared_expert_gated": False, "capacity_factor": None,
        "router_score": "sigmoid" if v3 else "softmax", "expert_bias": v3}
    if not v3:
        want["norm_topk"] = False
    if m.num_groups > 1:
        want["group_score"] = "top2_sum" if v3 else "max"
    clash = {f"moe.{k}": getattr(m, k) for k, v in want.items() if getattr(m, k) != v}
    ffn = m.ffn_hidden_size or c.ffn_hidden_size
    if m.shared_ffn_hidden_size % ffn:
        clash["moe.shared_ffn_hidden_size"] = (
            f"{m.shared_ffn_hidden_size}, not a multiple of the expert size {ffn} "
            "(n_shared_experts x moe_intermediate_size)")
    return clash


def deepseek_moe_fields(c: ModelConfig) -> dict[str, Any]:
    """The `config.json` MoE fields of `c` (one that `deepseek_moe_problems` passes); a model
    without MoE layers writes `first_k_dense_replace = num_hidden_layers`."""
    m = c.moe
    if not m.num_experts:
        return dict(first_k_dense_replace=c.num_layers)
    ffn = m.ffn_hidden_size or c.ffn_hidden_size
    fields = dict(
        n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=ffn,
        n_shared_experts=m.shared_ffn_hidden_size // ffn,
        first_k_dense_replace=m.first_dense_layers,
        routed_scaling_factor=m.routed_scale, n_group=m.num_groups, topk_group=m.topk_groups,
        norm_topk_prob=m.norm_topk)
    if c.family == "deepseek_v2":
        fields["topk_method"] = "group_limited_greedy" if m.num_groups > 1 else "greedy"
    return fields
