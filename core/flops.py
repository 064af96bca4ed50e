"""Training FLOPs per token of any model family, from its global parameter shapes (for MFU)."""

from __future__ import annotations

import math

from tessera.core.config import ModelConfig
from tessera.core.moe.shapes import moe_active_expert_weights
from tessera.core.parallel.sharding import global_param_shapes


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, counted as Megatron does (Narayanan et al., 2021).

    6 per weight of every matrix multiply (forward 2, backward 4), the output projection
    included and embedding lookups not, plus the attention scores and weighted values:
    12 * layers * seq_len * heads * head_dim (counted as if unmasked, as Megatron does).
    """
    matmul = sum(math.prod(shape) for name, shape in global_param_shapes(config).items()
                 if len(shape) == 2 and "embeddings" not in name)
    if config.tied_embeddings:  # the embedding table is also the output projection
        matmul += config.vocab_size * config.hidden_size
    matmul += moe_active_expert_weights(config)  # Mixture-of-Experts: the k experts run
    attention = 12 * config.num_layers * seq_len * config.num_heads * config.head_dim
    return 6 * matmul + attention
