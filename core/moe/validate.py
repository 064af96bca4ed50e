"""Checks of a `ModelConfig`'s Mixture-of-Experts options (`moe`, a `MoEConfig`), and of an MoE
model on a `Layout`.

Both return a list of problems (empty when fine), each naming the numbers that clash and the
fix; `core.config` raises them as one `ConfigError`. Imports nothing from `core.config` (which
calls in here lazily), so the config module stays free of import cycles.
"""

from __future__ import annotations

from typing import Any

ROUTER_SCORES = ("softmax", "sigmoid")
AUX_LOSS_POOLINGS = ("layer", "model")
GROUP_SCORES = ("max", "top2_sum")


def moe_problems(config: Any) -> list[str]:
    """Every reason the MoE options of `config` (a `ModelConfig` with `moe.num_experts > 0`)
    clash. Messages use the flat names `--model-overrides` also takes (`moe_top_k`, ...)."""
    c, m, out = config, config.moe, []
    if m.num_experts < 0:
        return [f"num_experts must be >= 0 (0: dense), got {m.num_experts}"]
    if not 1 <= m.top_k <= m.num_experts:
        out.append(f"moe_top_k {m.top_k} must be between 1 and num_experts {m.num_experts} "
                   f"(a token cannot pick more experts than there are); set moe_top_k <= "
                   f"{m.num_experts} or add experts")
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        out.append(f"moe_ffn_hidden_size must be >= 1 or None (= ffn_hidden_size), got "
                   f"{m.ffn_hidden_size}")
    if m.shared_ffn_hidden_size < 0:
        out.append(f"moe_shared_ffn_hidden_size must be >= 0 (0: no shared expert), got "
                   f"{m.shared_ffn_hidden_size}")
    if not 1 <= m.layer_freq <= c.num_layers:
        out.append(f"moe_layer_freq {m.layer_freq} must be between 1 (every layer) and "
                   f"num_layers {c.num_layers} (layer i is MoE when (i + 1) % freq == 0)")
    if m.router_score not in ROUTER_SCORES:
        out.append(f"moe_router_score {m.router_score!r} is unknown; choose one of "
                   f"{list(ROUTER_SCORES)}")
    for name in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
        if getattr(m, name) < 0:
            out.append(f"moe_{name} must be >= 0, got {getattr(m, name)}")
    if m.aux_loss_pooling not in AUX_LOSS_POOLINGS:
        out.append(f"moe_aux_loss_pooling {m.aux_loss_pooling!r} is unknown; choose "
                   f"'layer' (one loss per MoE layer, mean over layers) or 'model' (one loss "
                   f"over all MoE layers' tokens, as Hugging Face)")
    if not 0 <= m.first_dense_layers < c.num_layers:
        out.append(f"moe_first_dense_layers {m.first_dense_layers} must be between 0 and "
                   f"num_layers - 1 = {c.num_layers - 1} (layers below it stay dense; at least "
                   f"one layer must be MoE)")
    if m.routed_scale <= 0:
        out.append(f"moe_routed_scale must be > 0 (it multiplies the routed experts' weights), "
                   f"got {m.routed_scale}")
    out += _group_problems(m)
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        out.append(f"moe_capacity_factor must be > 0 (or None for dropless routing), got "
                   f"{m.capacity_factor}")
    return out


def _group_problems(m: Any) -> list[str]:
    """What keeps group-limited expert choice (`num_groups`, `topk_groups`, `group_score`)
    from being well defined."""
    if m.group_score not in GROUP_SCORES:
        return [f"moe_group_score {m.group_score!r} is unknown; choose 'max' (a group's best "
                f"score) or 'top2_sum' (the sum of its best two)"]
    if m.num_groups < 1 or m.num_experts % m.num_groups:
        return [f"moe_num_groups {m.num_groups} must be >= 1 and divide num_experts "
                f"{m.num_experts} (experts form equal groups); use one of "
                f"{[g for g in range(1, m.num_experts + 1) if m.num_experts % g == 0]}"]
    per_group = m.num_experts // m.num_groups
    if not 1 <= m.topk_groups <= m.num_groups:
        return [f"moe_topk_groups {m.topk_groups} must be between 1 and moe_num_groups "
                f"{m.num_groups}"]
    if m.top_k > m.topk_groups * per_group:
        return [f"moe_top_k {m.top_k} exceeds the {m.topk_groups * per_group} experts of the "
                f"moe_topk_groups {m.topk_groups} groups of {per_group} a token may use; raise "
                f"moe_topk_groups or lower moe_top_k"]
    if m.num_groups > 1 and m.group_score == "top2_sum" and per_group < 2:
        return [f"moe_group_score 'top2_sum' needs groups of >= 2 experts, but num_experts "
                f"{m.num_experts} / moe_num_groups {m.num_groups} = {per_group}; use fewer "
                f"groups or moe_group_score 'max'"]
    return []


def moe_layout_problems(config: Any, layout: Any) -> list[str]:
    """What an MoE model needs of a layout at expert parallelism 1: the shared expert is split
    over tp like the dense MLP (routed experts are replicated over tp)."""
    shared = config.moe.shared_ffn_hidden_size
    if shared and shared % layout.tp:
        return [f"moe_shared_ffn_hidden_size {shared} is not divisible by tp {layout.tp} (the "
                f"shared expert is split over tp like the dense MLP); use a tp that divides it"]
    return []
