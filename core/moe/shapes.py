"""Names, global shapes and tensor-parallel split of the Mixture-of-Experts weights.

This is the MoE part of `core.parallel.sharding` (which calls in here), kept apart so the
sharding rules of dense models read as before. Parameter names (a contract with the converters,
checkpoints and the expert-parallel dispatchers), for an MoE layer i:

- `layers.{i}.feed_forward.router.weight` `(E, hidden)`: router logits `x @ W^T`;
- `layers.{i}.feed_forward.router.expert_bias` `(E,)`: aux-loss-free balancing bias, added to
  the scores for choosing experts only (present when `moe.expert_bias`; not trained by gradient);
- `layers.{i}.feed_forward.experts.w1` `(E, F * (2 if gated else 1), hidden)`: each expert's first
  projection, `[gate; up]` stacked along dim 1 for SwiGLU like the dense `feed_forward.w1`;
- `layers.{i}.feed_forward.experts.w2` `(E, hidden, F)`;
- with a shared expert (`moe.shared_ffn_hidden_size = Fs > 0`):
  `layers.{i}.feed_forward.shared_expert.w1.weight` `(Fs * (2 if gated else 1), hidden)`,
  `...shared_expert.w2.weight` `(hidden, Fs)`, and when it is gated (`moe.shared_expert_gated`,
  Qwen2-MoE; DeepSeek's is not) `...shared_expert_gate.weight` `(1, hidden)`.

MoE weights have no biases. At expert parallelism 1 the router, the routed experts and the
shared expert's gate are replicated over tp (every tp rank runs every expert on its tokens); the
shared expert is split over tp exactly like the dense MLP (column-parallel `w1` with fused
`[gate; up]` halves, row-parallel `w2`).
"""

from __future__ import annotations

from typing import Any


def moe_ffn_size(config: Any) -> int:
    """Each routed expert's FFN hidden size."""
    return config.moe.ffn_hidden_size or config.ffn_hidden_size


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether global layer `layer` is an MoE layer: every `moe.layer_freq`-th, counting from 1
    (Qwen2-MoE's `(layer + 1) % decoder_sparse_step == 0`), from layer `moe.first_dense_layers`
    on (DeepSeek's `first_k_dense_replace`)."""
    m = config.moe
    return (m.num_experts > 0 and layer >= m.first_dense_layers
            and (layer + 1) % m.layer_freq == 0)


def moe_layers(config: Any) -> list[int]:
    """The global indices of the MoE layers."""
    return [i for i in range(config.num_layers) if is_moe_layer(config, i)]


def moe_param_shapes(config: Any, layer: int) -> dict[str, tuple[int, ...]]:
    """The global shapes of MoE layer `layer`'s feed-forward weights, in module order."""
    p, c, e = f"layers.{layer}.feed_forward", config.hidden_size, config.moe.num_experts
    f, gate = moe_ffn_size(config), 2 if config.gated else 1
    shapes: dict[str, tuple[int, ...]] = {f"{p}.router.weight": (e, c)}
    if config.moe.expert_bias:
        shapes[f"{p}.router.expert_bias"] = (e,)
    shapes[f"{p}.experts.w1"] = (e, f * gate, c)
    shapes[f"{p}.experts.w2"] = (e, c, f)
    fs = config.moe.shared_ffn_hidden_size
    if fs:
        shapes[f"{p}.shared_expert.w1.weight"] = (fs * gate, c)
        shapes[f"{p}.shared_expert.w2.weight"] = (c, fs)
        if config.moe.shared_expert_gated:
            shapes[f"{p}.shared_expert_gate.weight"] = (1, c)
    return shapes


def moe_active_expert_weights(config: Any) -> int:
    """Routed-expert weights one token multiplies by, over all MoE layers: k experts' worth
    (the 3-D expert tensors are otherwise not counted as matrix multiplies)."""
    gate = 2 if config.gated else 1
    per_expert = (gate + 1) * moe_ffn_size(config) * config.hidden_size
    return len(moe_layers(config)) * config.moe.top_k * per_expert if config.moe.num_experts else 0


def moe_split(local_name: str, config: Any) -> dict[str, Any] | None:
    """The `ShardSpec` fields of an MoE weight (`local_name` without the `layers.{i}.` prefix),
    or None when `local_name` is not an MoE weight."""
    if not local_name.startswith("feed_forward.") or config.moe.num_experts == 0:
        return None
    leaf = local_name[len("feed_forward."):]
    if leaf == "shared_expert.w1.weight":
        fs = config.moe.shared_ffn_hidden_size
        return {"dim": 0, "parts": (fs, fs) if config.gated else None}
    if leaf == "shared_expert.w2.weight":
        return {"dim": 1}
    if leaf.startswith(("router.", "experts.", "shared_expert_gate.")):
        return {"dim": None}
    return None
