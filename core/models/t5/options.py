"""`T5Options`: what a family "t5" `ModelConfig` says beyond the common fields
(`ModelConfig.options`). Imports nothing from tessera and no torch (the registry's family
modules must stay importable without it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class T5Options:
    """An encoder of `ModelConfig.num_layers` layers and a decoder of `num_decoder_layers`
    (None: as many), relative position buckets, the decoder starting from
    `decoder_start_token_id`; `scaled_output` multiplies the decoder output by
    hidden_size ** -0.5 before the (tied) output projection, as the original T5 does."""

    num_decoder_layers: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    decoder_start_token_id: int = 0
    scaled_output: bool = False
