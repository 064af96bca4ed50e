"""Checks of the Mixture-of-Experts fields of `ModelConfig`, and of an MoE model on a `Layout`.

Both return a list of problems (empty when fine), each naming the numbers that clash and the
fix; `core.config` raises them as one `ConfigError`. Imports nothing from `core.config` (which
calls in here lazily), so the config module stays free of import cycles.
"""

from __future__ import annotations

from typing import Any

ROUTER_SCORES = ("softmax", "sigmoid")
AUX_LOSS_POOLINGS = ("layer", "model")


def moe_problems(config: Any) -> list[str]:
    """Every reason the MoE fields of `config` (a `ModelConfig` with `num_experts > 0`) clash."""
    c, out = config, []
    if c.num_experts < 0:
        return [f"num_experts must be >= 0 (0: dense), got {c.num_experts}"]
    if not 1 <= c.moe_top_k <= c.num_experts:
        out.append(f"moe_top_k {c.moe_top_k} must be between 1 and num_experts {c.num_experts} "
                   f"(a token cannot pick more experts than there are); set moe_top_k <= "
                   f"{c.num_experts} or add experts")
    if c.moe_ffn_hidden_size is not None and c.moe_ffn_hidden_size < 1:
        out.append(f"moe_ffn_hidden_size must be >= 1 or None (= ffn_hidden_size), got "
                   f"{c.moe_ffn_hidden_size}")
    if c.moe_shared_ffn_hidden_size < 0:
        out.append(f"moe_shared_ffn_hidden_size must be >= 0 (0: no shared expert), got "
                   f"{c.moe_shared_ffn_hidden_size}")
    if not 1 <= c.moe_layer_freq <= c.num_layers:
        out.append(f"moe_layer_freq {c.moe_layer_freq} must be between 1 (every layer) and "
                   f"num_layers {c.num_layers} (layer i is MoE when (i + 1) % freq == 0)")
    if c.moe_router_score not in ROUTER_SCORES:
        out.append(f"moe_router_score {c.moe_router_score!r} is unknown; choose one of "
                   f"{list(ROUTER_SCORES)}")
    for name in ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_expert_bias_rate"):
        if getattr(c, name) < 0:
            out.append(f"{name} must be >= 0, got {getattr(c, name)}")
    if c.moe_aux_loss_pooling not in AUX_LOSS_POOLINGS:
        out.append(f"moe_aux_loss_pooling {c.moe_aux_loss_pooling!r} is unknown; choose "
                   f"'layer' (one loss per MoE layer, mean over layers) or 'model' (one loss "
                   f"over all MoE layers' tokens, as Hugging Face)")
    if c.moe_capacity_factor is not None and c.moe_capacity_factor <= 0:
        out.append(f"moe_capacity_factor must be > 0 (or None for dropless routing), got "
                   f"{c.moe_capacity_factor}")
    return out


def moe_layout_problems(config: Any, layout: Any) -> list[str]:
    """What an MoE model needs of a layout at expert parallelism 1: the shared expert is split
    over tp like the dense MLP (routed experts are replicated over tp)."""
    shared = config.moe_shared_ffn_hidden_size
    if shared and shared % layout.tp:
        return [f"moe_shared_ffn_hidden_size {shared} is not divisible by tp {layout.tp} (the "
                f"shared expert is split over tp like the dense MLP); use a tp that divides it"]
    return []
