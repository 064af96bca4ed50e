"""`MoEConfig`: the Mixture-of-Experts options of a decoder block (`ModelConfig.moe`).

Imports nothing from tessera (and no torch): `core.config` holds one, and its checks live in
`core.moe.validate`. The defaults describe a dense model (`num_experts` 0: no MoE layers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """How the MLP of every `layer_freq`-th decoder layer becomes a routed set of experts."""

    num_experts: int = 0  # routed experts per MoE layer; 0: dense (no MoE layers)
    top_k: int = 2  # experts each token is sent to
    ffn_hidden_size: int | None = None  # each routed expert's FFN size (None: the model's)
    shared_ffn_hidden_size: int = 0  # one dense MLP beside the routed experts (0: none)
    shared_expert_gated: bool = True  # its output times sigmoid(x @ gate) (Qwen2-MoE); False:
    # added as it is (DeepSeek's n_shared_experts x moe_intermediate_size MLP)
    layer_freq: int = 1  # layer i is MoE when (i + 1) % freq == 0 (Qwen's decoder_sparse_step)
    first_dense_layers: int = 0  # layers i < this stay dense (DeepSeek's first_k_dense_replace)
    router_score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True  # renormalize the k chosen weights to sum to 1 (Mixtral)
    routed_scale: float = 1.0  # the k weights times this, after norm_topk (routed_scaling_factor)
    # Group-limited choice (DeepSeek): the E experts form `num_groups` equal groups, each token
    # keeps the `topk_groups` groups of highest group score and picks its k experts from those.
    num_groups: int = 1  # 1: no group limit
    topk_groups: int = 1
    group_score: str = "max"  # max: the group's best score (V2) | top2_sum: its best two (V3)
    aux_loss_coef: float = 0.001  # load balancing: coef x E x sum_i f_i P_i, mean over layers
    z_loss_coef: float = 0.0  # router z-loss: coef x mean(logsumexp(logits)^2)
    capacity_factor: float | None = None  # None: dropless; else ceil(n k / E x factor) each
    expert_bias: bool = False  # aux-loss-free balancing: a routing-only bias per expert
    expert_bias_rate: float = 1e-3  # its update per step: rate x sign(mean load - load)
    # Load-balancing loss pooling (`core.moe.pooled_aux`): "layer" = one loss per MoE layer,
    # mean over layers (Megatron); "model" = one loss over all MoE layers' tokens (Hugging
    # Face's `load_balancing_loss_func`; needs pp = 1 in training).
    aux_loss_pooling: str = "layer"
