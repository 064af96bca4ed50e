"""The Hugging Face <-> Tessera contract of the Mixture-of-Experts families, as data.

Families (`ModelConfig.family`, equal to the HF `model_type`): `mixtral` (`MixtralForCausalLM`),
`qwen2_moe` (`Qwen2MoeForCausalLM`) and `qwen3_moe` (`Qwen3MoeForCausalLM`: no shared expert,
per-head q/k norm, its Qwen3 parts from `converters.hf.qwen3`). Attention, norms, embeddings and
(Qwen's) dense layers map as for Llama; the MoE weights (names in `core.moe.shapes`) map as
follows.

Two on-disk layouts of the routed experts exist; both are read, the first is written (it is what
transformers 5.x `save_pretrained` writes, and what every version loads):
- per expert: `...experts.{e}.w1/w3/w2.weight` (Mixtral: gate, up, down) or
  `...experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen), each `(F, h)` / `(h, F)`. Tessera's
  `experts.w1 (E, 2F, h)` is, flattened to `(E * 2F, h)`, the concatenation gate_0, up_0,
  gate_1, up_1, ... along dim 0, and `experts.w2 (E, h, F)` flattened is down_0, down_1, ...: the
  same stack-along-dim-0 rule as every other fused tensor, plus a reshape;
- fused (transformers 5.x in memory, newer checkpoints): `mlp.experts.gate_up_proj (E, 2F, h)`
  (gate first, as `MixtralExperts` chunks it) and `mlp.experts.down_proj (E, h, F)`, which are
  Tessera's `w1` and `w2` as they are. Mixtral's router is then `mlp.gate.weight`.
So both directions remain pure re-arrangements: HF -> Tessera -> HF is bit-identical.

Qwen2-MoE's `qkv_bias` (biases on q/k/v alone) is `ModelConfig.qkv_bias`. Config fields Tessera
cannot compute exactly are errors that name the field: Mixtral's router jitter noise, Qwen's
`mlp_only_layers` (Qwen3-MoE's converts only when it names layers that are dense anyway:
Tessera places MoE layers only by `decoder_sparse_step`, its `moe.layer_freq`). Both Qwen windows
convert (`qwen2.qwen_window`): Qwen2-MoE's on the layers `max_window_layers` / `layer_types`
pick, Qwen3-MoE's on every layer (transformers' `Qwen3MoeModel` builds one sliding mask for all
layers and reads neither field; a `layer_types` that names full layers is refused). Qwen's dense
layers (`decoder_sparse_step > 1`) use the model's `intermediate_size`, the routed experts
`moe_intermediate_size`.

The load-balancing loss: Hugging Face computes one loss over the router logits of all MoE layers
pooled (`load_balancing_loss_func`), Tessera by default one per layer, averaged (Megatron). An
imported model gets `moe.aux_loss_pooling = "model"` (`HF_AUX_LOSS_POOLING`, recorded in the
checkpoint manifest's model config): `router_aux_loss_coef` was chosen for that loss, and
fine-tuning an imported model should optimize the objective Hugging Face would, to 1e-6
(`tests/unit/converters/test_hf_moe.py`). The price: the pooled loss needs every MoE layer in one
forward, so training it with pp > 1 is refused with a message naming the fix (set the field to
"layer"). The export writes no such field (Hugging Face has only its own pooling).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any

from tessera.converters.hf.family import (
    ConversionError,
    HfFamily,
    NameMap,
    TensorPairs,
    mapped_pairs,
    require,
    with_shared_fields,
)
from tessera.converters.hf.llama import LLAMA_LIKE, ROTARY_BUFFERS, llama_config, rope_to_hf
from tessera.converters.hf.qwen2 import qwen_window, window_to_hf
from tessera.converters.hf.qwen3 import QK_NORM_NAMES, qwen3_base
from tessera.core.config import ModelConfig
from tessera.core.moe.config import MoEConfig

# How Hugging Face pools the load-balancing loss of these families (see the module docstring).
HF_AUX_LOSS_POOLING = "model"

_MIXTRAL_MOE = "model.layers.{}.block_sparse_moe"
_QWEN_MLP = "model.layers.{}.mlp"

# Attention, norms, embeddings and the dense layers of every MoE family: as for Llama.
_DENSE: NameMap = {**LLAMA_LIKE,
                   "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_proj.weight",
                                                        "model.layers.{}.mlp.up_proj.weight")}

# Tessera name pattern -> HF names stacked along dim 0, `{e}` expanded over the experts (expert
# by expert, in the listed order), then reshaped to the Tessera shape.
_QWEN_EXPERTS: NameMap = {
    "layers.{}.feed_forward.router.weight": (f"{_QWEN_MLP}.gate.weight",),
    "layers.{}.feed_forward.experts.w1": (f"{_QWEN_MLP}.experts.{{e}}.gate_proj.weight",
                                          f"{_QWEN_MLP}.experts.{{e}}.up_proj.weight"),
    "layers.{}.feed_forward.experts.w2": (f"{_QWEN_MLP}.experts.{{e}}.down_proj.weight",),
}
_MIXTRAL_NAMES: NameMap = {
    **_DENSE,
    "layers.{}.feed_forward.router.weight": (f"{_MIXTRAL_MOE}.gate.weight",),
    "layers.{}.feed_forward.experts.w1": (f"{_MIXTRAL_MOE}.experts.{{e}}.w1.weight",
                                          f"{_MIXTRAL_MOE}.experts.{{e}}.w3.weight"),
    "layers.{}.feed_forward.experts.w2": (f"{_MIXTRAL_MOE}.experts.{{e}}.w2.weight",),
}
_QWEN2_MOE_NAMES: NameMap = {
    **_DENSE, **_QWEN_EXPERTS,
    "layers.{}.feed_forward.shared_expert.w1.weight": (
        f"{_QWEN_MLP}.shared_expert.gate_proj.weight",
        f"{_QWEN_MLP}.shared_expert.up_proj.weight"),
    "layers.{}.feed_forward.shared_expert.w2.weight": (
        f"{_QWEN_MLP}.shared_expert.down_proj.weight",),
    "layers.{}.feed_forward.shared_expert_gate.weight": (
        f"{_QWEN_MLP}.shared_expert_gate.weight",),
}
# Qwen2-MoE without the shared expert, plus the q/k norms.
_QWEN3_MOE_NAMES: NameMap = {**_DENSE, **QK_NORM_NAMES, **_QWEN_EXPERTS}

# The fused layout's names (every family), replacing the per-expert ones when the files hold it;
# Mixtral's router is then named as Qwen's.
FUSED_EXPERTS: NameMap = {
    "layers.{}.feed_forward.experts.w1": (f"{_QWEN_MLP}.experts.gate_up_proj",),
    "layers.{}.feed_forward.experts.w2": (f"{_QWEN_MLP}.experts.down_proj",),
    "layers.{}.feed_forward.router.weight": (f"{_QWEN_MLP}.gate.weight",),
}


def has_fused_experts(hf_names: Set[str]) -> bool:
    """Whether HF tensor names use the fused expert layout (`experts.gate_up_proj`)."""
    return any(n.endswith("experts.gate_up_proj") for n in hf_names)


def expand_experts(patterns: tuple[str, ...], num_experts: int) -> list[str]:
    """`patterns` with `{e}` expanded expert by expert (patterns without it pass through)."""
    if not any("{e}" in p for p in patterns):
        return list(patterns)
    return [p.replace("{e}", str(e)) for e in range(num_experts) for p in patterns]


def moe_pairs(names: NameMap) -> Callable[[ModelConfig, Set[str] | None], TensorPairs]:
    """The tensor listing of one family with `names` (per-expert `{e}` patterns and the
    `_QWEN_MLP` prefix): experts one by one, or fused when the files are."""
    def pairs(config: ModelConfig, hf_names: Set[str] | None) -> TensorPairs:
        chosen = {**names, **FUSED_EXPERTS} if hf_names and has_fused_experts(hf_names) else names
        return mapped_pairs(config, chosen,
                            expand=lambda p: expand_experts(p, config.moe.num_experts))
    return pairs


# ------------------------------------------------------------------------------------ config


def _moe_base(hf: dict[str, Any], qkv_bias: bool = False) -> dict[str, Any]:
    """The Llama-like fields of an MoE config.json; `qkv_bias`: biases on q/k/v alone."""
    config = llama_config({**hf, "attention_bias": False, "mlp_bias": False})
    return {**config.to_dict(), "name": hf["model_type"], "family": hf["model_type"],
            "qkv_bias": qkv_bias}


def _mixtral_config(hf: dict[str, Any]) -> ModelConfig:
    require(hf, "router_jitter_noise", (0.0, 0, None), 0.0)
    moe = MoEConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    norm_topk=True, aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                    aux_loss_pooling=HF_AUX_LOSS_POOLING)
    return ModelConfig.from_dict({**_moe_base(hf), "moe": moe})


def _qwen2_moe_config(hf: dict[str, Any]) -> ModelConfig:
    require(hf, "mlp_only_layers", ([], None), [])
    window, layers = qwen_window(hf, _qwen2_moe_slides)
    moe = MoEConfig(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    ffn_hidden_size=hf["moe_intermediate_size"],
                    shared_ffn_hidden_size=hf.get("shared_expert_intermediate_size") or 0,
                    layer_freq=hf.get("decoder_sparse_step", 1),
                    norm_topk=bool(hf.get("norm_topk_prob", False)),
                    aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                    aux_loss_pooling=HF_AUX_LOSS_POOLING)
    qkv_bias = bool(hf.get("qkv_bias", False))
    return ModelConfig.from_dict({**_moe_base({**hf, "sliding_window": None}, qkv_bias),
                                  "moe": moe, "sliding_window": window,
                                  "sliding_window_layers": layers})


def _qwen2_moe_slides(hf: dict[str, Any], layer: int) -> bool:
    """Qwen2-MoE's default sliding layers: every other one from the first, below
    `max_window_layers` (transformers' `Qwen2MoeConfig`)."""
    return layer % 2 == 0 and layer < hf.get("max_window_layers", 28)


def _qwen3_moe_window(hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """Qwen3-MoE's (window, layers): with `use_sliding_window`, every layer, whatever
    `max_window_layers` says, as transformers' `Qwen3MoeModel` applies it."""
    types = hf.get("layer_types")
    if hf.get("use_sliding_window") and types is not None and set(types) != {
            "sliding_attention"}:
        raise ConversionError(
            f"qwen3_moe config: layer_types={types} is not supported with use_sliding_window "
            "(supported: no layer_types, or every entry sliding_attention: transformers windows "
            "every Qwen3-MoE layer)")
    return qwen_window(hf, lambda _hf, _layer: True)


def _qwen3_moe_config(hf: dict[str, Any]) -> ModelConfig:
    window, layers = _qwen3_moe_window(hf)
    step = hf.get("decoder_sparse_step", 1)
    sparse_anyway = [i for i in hf.get("mlp_only_layers") or [] if (i + 1) % step == 0]
    if sparse_anyway:
        raise ConversionError(
            f"qwen3_moe config: mlp_only_layers makes layers {sparse_anyway} dense, but Tessera "
            f"places MoE layers only by decoder_sparse_step ({step}); only mlp_only_layers that "
            "name layers dense by that rule convert")
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # 5.x saves the latter
    if experts is None:
        raise KeyError("num_experts")
    moe = MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"],
                    ffn_hidden_size=hf["moe_intermediate_size"], layer_freq=step,
                    norm_topk=bool(hf.get("norm_topk_prob", False)),
                    aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                    aux_loss_pooling=HF_AUX_LOSS_POOLING)
    return ModelConfig.from_dict({**qwen3_base(hf), "moe": moe, "sliding_window": window,
                                  "sliding_window_layers": layers})


def _common_problems(c: ModelConfig, qk_norm: bool, qkv_bias: bool = False) -> list[str]:
    """What keeps `c` from being any of these HF MoE models (empty: nothing)."""
    out = []
    if c.moe.num_experts == 0:
        out.append("num_experts is 0 (a dense model)")
    if (c.norm, c.activation, c.position, c.rotary_fraction, c.bias) != (
            "rmsnorm", "swiglu", "rope", 1.0, False):
        out.append("norm/activation/position/rotary_fraction/bias must be rmsnorm/swiglu/rope/"
                   "1.0/False")
    if c.moe.router_score != "softmax" or c.moe.capacity_factor is not None or (
            c.moe.expert_bias or c.moe.z_loss_coef):
        out.append("router must be softmax, dropless, without expert bias or z-loss")
    if c.qk_norm != qk_norm:  # Qwen3's per-head q/k norm (core.qk_norm)
        out.append(f"qk_norm must be {qk_norm} for {c.family}")
    if c.qkv_bias and not qkv_bias:
        out.append(f"{c.family} has no q/k/v biases: qkv_bias must be False")
    return out


def _mixtral_problems(c: ModelConfig) -> list[str]:
    if c.sliding_window_layers is not None:
        return [f"sliding_window_layers={list(c.sliding_window_layers)}: Mixtral's window "
                "covers every layer"]
    if not c.moe.norm_topk or c.moe.shared_ffn_hidden_size or c.moe.layer_freq != 1 or (
            c.moe.ffn_hidden_size not in (None, c.ffn_hidden_size)):
        return ["Mixtral normalizes the top-k weights, has no shared expert, an MoE block in "
                "every layer and experts of ffn_hidden_size"]
    return []


def _qwen2_moe_problems(c: ModelConfig) -> list[str]:
    if not c.moe.shared_ffn_hidden_size:
        return ["Qwen2-MoE always has a shared expert: set moe_shared_ffn_hidden_size"]
    return []


def _qwen3_moe_problems(c: ModelConfig) -> list[str]:
    out = []
    if c.sliding_window_layers is not None:
        out.append(f"sliding_window_layers={list(c.sliding_window_layers)}: Qwen3-MoE's window "
                   "covers every layer (supported: None)")
    if c.moe.shared_ffn_hidden_size:
        out.append("Qwen3-MoE has no shared expert: set moe_shared_ffn_hidden_size to 0")
    return out


def _checker(qk_norm: bool, problems: Callable[[ModelConfig], list[str]], qkv_bias: bool
             ) -> Callable[[ModelConfig], None]:
    def check(c: ModelConfig) -> None:
        found = _common_problems(c, qk_norm, qkv_bias) + problems(c)
        if found:
            raise ConversionError(f"this {c.family} model cannot be written as a Hugging Face "
                                  f"{c.family} model: {'; '.join(found)}")
    return check


def _common_fields(c: ModelConfig) -> dict[str, Any]:
    """The `config.json` fields every MoE family writes alike."""
    rope = rope_to_hf(c)
    return dict(
        model_type=c.family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps, attention_dropout=c.dropout, rope_parameters=rope,
        rope_theta=c.rope_theta, num_experts_per_tok=c.moe.top_k,
        router_aux_loss_coef=c.moe.aux_loss_coef, output_router_logits=False)


def _mixtral_fields(c: ModelConfig) -> dict[str, Any]:
    return dict(architectures=["MixtralForCausalLM"], num_local_experts=c.moe.num_experts,
                router_jitter_noise=0.0, sliding_window=c.sliding_window)


def _qwen2_moe_fields(c: ModelConfig) -> dict[str, Any]:
    return dict(architectures=["Qwen2MoeForCausalLM"], num_experts=c.moe.num_experts,
                moe_intermediate_size=c.moe.ffn_hidden_size or c.ffn_hidden_size,
                shared_expert_intermediate_size=c.moe.shared_ffn_hidden_size,
                decoder_sparse_step=c.moe.layer_freq, mlp_only_layers=[],
                norm_topk_prob=c.moe.norm_topk, qkv_bias=c.qkv_bias,
                **window_to_hf(c, max_window_layers_is_first=False))


def _qwen3_moe_fields(c: ModelConfig) -> dict[str, Any]:
    return dict(architectures=["Qwen3MoeForCausalLM"], num_experts=c.moe.num_experts,
                moe_intermediate_size=c.moe.ffn_hidden_size or c.ffn_hidden_size,
                decoder_sparse_step=c.moe.layer_freq, mlp_only_layers=[],
                norm_topk_prob=c.moe.norm_topk, attention_bias=False,
                use_sliding_window=c.sliding_window is not None,
                sliding_window=c.sliding_window)


def _writer(fields: Callable[[ModelConfig], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    def config_to_hf(c: ModelConfig, **shared: Any) -> dict[str, Any]:
        return with_shared_fields({**_common_fields(c), **fields(c)}, c, **shared)
    return config_to_hf


def _moe_family(family: str, config_from_hf: Callable[[dict[str, Any]], ModelConfig],
                names: NameMap, qk_norm: bool, problems: Callable[[ModelConfig], list[str]],
                fields: Callable[[ModelConfig], dict[str, Any]],
                qkv_bias: bool = False) -> HfFamily:
    return HfFamily(family=family, config_from_hf=config_from_hf,
                    check_exportable=_checker(qk_norm, problems, qkv_bias),
                    config_to_hf=_writer(fields),
                    name_map=names, pairs=moe_pairs(names), ignored=ROTARY_BUFFERS,
                    fp8_refusal="its experts are grouped weights, not the linears the FP8 "
                                "loaders quantize")


MIXTRAL = _moe_family("mixtral", _mixtral_config, _MIXTRAL_NAMES, False, _mixtral_problems,
                      _mixtral_fields)
QWEN2_MOE = _moe_family("qwen2_moe", _qwen2_moe_config, _QWEN2_MOE_NAMES, False,
                        _qwen2_moe_problems, _qwen2_moe_fields, qkv_bias=True)
QWEN3_MOE = _moe_family("qwen3_moe", _qwen3_moe_config, _QWEN3_MOE_NAMES, True,
                        _qwen3_moe_problems, _qwen3_moe_fields)
