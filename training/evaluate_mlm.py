"""Masked-LM evaluation of a BERT checkpoint (`tessera evaluate` on a family "bert" model).

The documents are cut into windows as for GPT (`evaluate.windows`, `seq_len - 3` tokens each),
and each window becomes a masked-LM sample exactly as pretraining makes them
(`bert_dataset.BertDataset`: 15% of the tokens picked, 80/10/10), from a fixed seed, so the same
checkpoint and data always give the same numbers; short sequences and next-sentence pairs are
off (every window is scored whole). The result is the mean cross-entropy over the picked tokens,
its exponential, and the masked-LM accuracy: the share of picked tokens whose original id is the
model's top prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from tessera.training.bert_dataset import BertDataset, BertSpecials, MaskingConfig
from tessera.training.evaluate import windows

EVAL_SEED = 1234


class _Windows:
    """Windows held in memory, read by `BertDataset` as it reads GPT's."""

    def __init__(self, items: list[torch.Tensor]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def sample_tokens(self, i: int) -> np.ndarray:
        return self.items[i].numpy()


@torch.no_grad()
def evaluate_masked_lm(model, documents: Iterable[np.ndarray], seq_len: int, batch: int = 8,
                       max_windows: int | None = None, seed: int = EVAL_SEED
                       ) -> dict[str, float]:
    """Masked-LM loss, perplexity and accuracy of the BERT `model` over `documents`."""
    if seq_len < 5:
        raise ValueError(f"a BERT sample needs seq_len >= 5, got {seq_len}")
    held = _Windows(list(windows(documents, seq_len - 4, max_windows)))
    if not len(held):
        raise ValueError(f"fewer than {seq_len - 3} tokens to evaluate on: lower --seq-len, or "
                         "choose another --split")
    data = BertDataset(held, seq_len, BertSpecials.of_model(model.config.vocab_size), seed,
                       MaskingConfig(nsp=False, short_seq_prob=0.0))
    total, correct, count = 0.0, 0, 0
    for start in range(0, len(data), batch):
        rows = [data[i] for i in range(start, min(start + batch, len(data)))]
        b = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        logits = model(b["tokens"], token_types=b["token_types"],
                       attention_mask=b["attention_mask"]).float()
        picked = b["labels"] != -100
        total += float(F.cross_entropy(logits[picked], b["labels"][picked], reduction="sum"))
        correct += int((logits[picked].argmax(-1) == b["labels"][picked]).sum())
        count += int(picked.sum())
    mean = total / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(mean), "accuracy": correct / max(count, 1),
            "tokens": count}
