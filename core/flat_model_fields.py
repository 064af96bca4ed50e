"""Model configs in the flat form of older checkpoint manifests, YAML files and overrides.

Before `ModelConfig` held sub-configs, its Mixture-of-Experts options and its T5 and BERT options
were top-level fields (`num_experts`, `moe_top_k`, `num_decoder_layers`, `type_vocab_size`, ...),
and every manifest wrote all of them. `nest_flat_fields` moves such keys into the nested form
(`moe`, `options`) so those manifests, and the flat `--model-overrides` names, keep working.
Imports nothing from `core.config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tessera.core.errors import ConfigError
from tessera.core.rope_config import RopeScaling

_PLAIN_ROPE = dataclasses.asdict(RopeScaling())

# flat name -> `MoEConfig` field
FLAT_MOE: dict[str, str] = {
    "num_experts": "num_experts", "moe_top_k": "top_k", "moe_ffn_hidden_size": "ffn_hidden_size",
    "moe_shared_ffn_hidden_size": "shared_ffn_hidden_size", "moe_layer_freq": "layer_freq",
    "moe_router_score": "router_score", "moe_norm_topk": "norm_topk",
    "moe_aux_loss_coef": "aux_loss_coef", "moe_z_loss_coef": "z_loss_coef",
    "moe_capacity_factor": "capacity_factor", "moe_expert_bias": "expert_bias",
    "moe_expert_bias_rate": "expert_bias_rate", "moe_aux_loss_pooling": "aux_loss_pooling",
    "moe_shared_expert_gated": "shared_expert_gated",
    "moe_first_dense_layers": "first_dense_layers", "moe_routed_scale": "routed_scale",
    "moe_num_groups": "num_groups", "moe_topk_groups": "topk_groups",
    "moe_group_score": "group_score",
}
# flat name (the same name in the family's options) -> the value every flat manifest wrote for
# a family that has no such option
FLAT_OPTIONS: dict[str, Any] = {
    "num_decoder_layers": None, "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "decoder_start_token_id": 0, "scaled_output": False,
    "type_vocab_size": 0, "binary_head": False,
}

# Fields added after the flat form, with the default that says nothing new.
_LATER_DEFAULTS: dict[str, Any] = {"qk_norm_width": "head", "norm_placement": "input",
                                   "sliding_window": None, "sliding_window_layers": None,
                                   "sliding_window_rope_theta": None, "mla": None}
# `MoEConfig` fields added after the flat form (flat names), likewise.
_LATER_MOE_DEFAULTS: dict[str, Any] = {
    "moe_shared_expert_gated": True, "moe_first_dense_layers": 0, "moe_routed_scale": 1.0,
    "moe_num_groups": 1, "moe_topk_groups": 1, "moe_group_score": "max"}


def as_dict(value: Any) -> dict[str, Any]:
    """A sub-config as a dict: a dataclass instance's fields, a mapping's items, None: {}."""
    if value is None:
        return {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return dict(value)
    raise ConfigError(f"expected a mapping of fields, got {value!r}")


def nest_flat_fields(data: dict[str, Any], family: str, options: type | None) -> dict[str, Any]:
    """`data` with its flat MoE and family-option keys moved into `moe` and `options` (dicts;
    a flat key overrides the same field of a nested one). `options` is the family's options
    class (None: it has none); a flat option key it lacks must hold the value flat manifests
    wrote for every family, or it is an error naming the key."""
    out = {k: v for k, v in data.items() if k not in FLAT_MOE and k not in FLAT_OPTIONS}
    moe = {FLAT_MOE[k]: v for k, v in data.items() if k in FLAT_MOE}
    if moe:
        out["moe"] = {**as_dict(data.get("moe")), **moe}
    known = {f.name for f in dataclasses.fields(options)} if options is not None else set()
    flat = {k: v for k, v in data.items() if k in FLAT_OPTIONS}
    taken = {k: v for k, v in flat.items() if k in known}
    stray = sorted(k for k, v in flat.items() if k not in known and v != FLAT_OPTIONS[k])
    if stray:
        raise ConfigError(f"model fields {stray} mean nothing to a family {family!r} model; "
                          f"remove them or pick the family that has them")
    if taken:
        out["options"] = {**as_dict(data.get("options")), **taken}
    return out


def flat_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig.to_dict()` output in the flat form (what `to_dict` wrote before the
    sub-configs: every MoE field under its flat name, every family option present, with the
    flat default where the family has no such option). Digests of a config hash this form,
    so they stay what they were (`core.fingerprint`): the fields added since (`rope_scaling`,
    `qkv_bias`, `qk_norm_width`, `norm_placement`, `sliding_window`, `sliding_window_layers`,
    `sliding_window_rope_theta`, `mla`, the MoE fields of `_LATER_MOE_DEFAULTS`) appear only
    where they say something the older fields do not (a value other than their default)."""
    out = {k: v for k, v in data.items() if k not in ("moe", "options")}
    if as_dict(out.get("rope_scaling")) in ({}, _PLAIN_ROPE):
        out.pop("rope_scaling", None)
    if out.get("qkv_bias") in (None, out.get("bias")):
        out.pop("qkv_bias", None)
    for key, default in _LATER_DEFAULTS.items():
        if out.get(key, default) == default:
            out.pop(key, None)
    moe = as_dict(data.get("moe"))
    out.update({flat: moe[name] for flat, name in FLAT_MOE.items() if name in moe
                and moe[name] != _LATER_MOE_DEFAULTS.get(flat, object())})
    options = as_dict(data.get("options"))
    out.update({flat: options.get(flat, default) for flat, default in FLAT_OPTIONS.items()})
    return out
