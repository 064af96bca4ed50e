"""What only a Gemma config says (`ModelConfig.options` of families `gemma2` and `gemma3`).
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Gemma2Options:
    """Gemma 2's and Gemma 3's attention and output details (transformers' names; None: off / default).

    - `query_pre_attn_scalar`: attention scores are scaled by `query_pre_attn_scalar ** -0.5`
      instead of `head_dim ** -0.5`;
    - `attn_logit_softcapping`: scores become `cap * tanh(scores / cap)` before the mask;
    - `final_logit_softcapping`: the output logits likewise;
    - `scale_embeddings`: token embeddings are multiplied by sqrt(hidden_size) (rounded to
      the embedding's dtype first, as Gemma does).
    """

    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    scale_embeddings: bool = True
