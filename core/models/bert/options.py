"""`BertOptions`: what a family "bert" `ModelConfig` says beyond the common fields
(`ModelConfig.options`). Imports nothing from tessera and no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BertOptions:
    """Token-type (segment A / B) embeddings and the optional next-sentence head."""

    type_vocab_size: int = 2  # token-type embeddings (checked >= 1 by `bert.config`)
    binary_head: bool = False  # [CLS] pooler (dense + tanh) and next-sentence classifier
