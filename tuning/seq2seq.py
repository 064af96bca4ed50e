"""Text-to-text tuning rows for an encoder-decoder base (T5).

The encoder reads an example's prompt (its task template rendered without the answer); the
decoder is taught the answer by teacher forcing: its inputs are the decoder start token and the
answer shifted right, its targets the answer (with EOS when the run adds it), so the loss is on
the answer's tokens only, as transformers' `T5ForConditionalGeneration` computes it from
`labels`.
"""

from __future__ import annotations

import torch

from tessera.core.config import ModelConfig
from tessera.tuning.data import Example

Seq2SeqBatch = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def is_seq2seq(config: ModelConfig) -> bool:
    """Whether `config` is an encoder-decoder, tuned on text-to-text rows."""
    return config.family == "t5"


def longest_seq2seq(examples: list[Example]) -> int:
    """The longer of the longest prompt (encoder) and the longest answer (decoder)."""
    return max(max(len(e.prompt), len(e.answer)) for e in examples)


def make_seq2seq_batch(examples: list[Example], seq_len: int, pad_id: int,
                       start_id: int) -> Seq2SeqBatch:
    """`encoder_ids (B, seq_len)` (the prompts, right-padded with `pad_id`), `labels
    (B, seq_len)` (the answers, -100 after them) and the decoder's keyword inputs:
    `decoder_input_ids` (`start_id`, then the answer shifted right, `pad_id` after) and
    `encoder_mask` (1 on prompt tokens)."""
    B = len(examples)
    encoder_ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    encoder_mask = torch.zeros((B, seq_len), dtype=torch.long)
    labels = torch.full((B, seq_len), -100, dtype=torch.long)
    decoder_ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    for row, ex in enumerate(examples):
        if not ex.answer:
            raise ValueError(f"{ex.where}: an empty answer has nothing to teach the decoder")
        encoder_ids[row, : len(ex.prompt)] = torch.tensor(ex.prompt)
        encoder_mask[row, : len(ex.prompt)] = 1
        labels[row, : len(ex.answer)] = torch.tensor(ex.answer)
        decoder_ids[row, : len(ex.answer)] = torch.tensor([start_id, *ex.answer[:-1]])
    return encoder_ids, labels, {"decoder_input_ids": decoder_ids, "encoder_mask": encoder_mask}
