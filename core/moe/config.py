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
    shared_ffn_hidden_size: int = 0  # Qwen2-MoE shared expert with a sigmoid gate (0: none)
    layer_freq: int = 1  # layer i is MoE when (i + 1) % freq == 0 (Qwen's decoder_sparse_step)
    router_score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = True  # renormalize the k chosen weights to sum to 1 (Mixtral)
    aux_loss_coef: float = 0.001  # load balancing: coef x E x sum_i f_i P_i, mean over layers
    z_loss_coef: float = 0.0  # router z-loss: coef x mean(logsumexp(logits)^2)
    capacity_factor: float | None = None  # None: dropless; else ceil(n k / E x factor) each
    expert_bias: bool = False  # aux-loss-free balancing: a routing-only bias per expert
    expert_bias_rate: float = 1e-3  # its update per step: rate x sign(mean load - load)
    # Load-balancing loss pooling (`core.moe.pooled_aux`): "layer" = one loss per MoE layer,
    # mean over layers (Megatron); "model" = one loss over all MoE layers' tokens (Hugging
    # Face's `load_balancing_loss_func`; needs pp = 1 in training).
    aux_loss_pooling: str = "layer"
